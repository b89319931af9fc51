#!/usr/bin/env python
"""BLEU of detokenised hypotheses against detokenised references, as the recipes report it.

    python recipes/tools/score_bleu.py --hyp test.hyp.de --ref test.de [--lang de --tokenised] \\
        [--lang de --compound-split] [--name newstest2014]

First, and primary: sacreBLEU (13a tokenisation, mixed case) with its signature, comparable
across papers that report sacreBLEU. Then, as the papers of the field report it:

- ``--tokenised``: BLEU on Moses-tokenised text (sacremoses, the Python port of Moses'
  tokenizer.perl -l LANG, without aggressive hyphen splitting), computed without further
  tokenisation (tok:none): the "tokenised BLEU" of fairseq's IWSLT14 and WMT14 en-fr examples.
- ``--compound-split``: the "tokenised BLEU with compound splitting" of Vaswani et al. (2017)
  and Ott et al. (2018), which the RFA paper reports for WMT14 en-de: Moses-tokenised text in
  which every hyphen between two non-space characters is split off as "##AT##-##AT##" (fairseq's
  scripts/compound_split_bleu.sh: s{(\\S)-(\\S)}{$1 ##AT##-##AT## $2}g).

Both are higher than sacreBLEU and only comparable with scores computed the same way.
"""
import argparse
import re
import sys

import sacrebleu

_COMPOUND = re.compile(r"(\S)-(\S)")


def compound_split(line: str) -> str:
    """fairseq's compound_split_bleu.sh rule (non-overlapping, left to right, like perl's s///g)."""
    return _COMPOUND.sub(r"\1 ##AT##-##AT## \2", line)


def moses_tokeniser(lang: str):
    """A function line -> Moses-tokenised line for ``lang`` (sacremoses' MosesTokenizer)."""
    try:
        from sacremoses import MosesTokenizer
    except ImportError:
        sys.exit("score_bleu.py: the tokenised scores need sacremoses (pip install sacremoses; "
                 "scripts/setup_env.sh installs it)")
    tokenizer = MosesTokenizer(lang=lang)
    # escape=False: keep & < > ' " as characters (tokenizer.perl -no-escape); both sides are
    # tokenised alike, so the score is the same either way and the text stays readable.
    return lambda line: tokenizer.tokenize(line, escape=False, return_str=True)


def read_lines(path):
    with open(path, encoding="utf-8") as f:
        return [line.rstrip("\n") for line in f]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hyp", required=True, help="detokenised hypotheses, one per line, in test-set order")
    parser.add_argument("--ref", required=True, help="detokenised references, one per line")
    parser.add_argument("--lang", help="target language (Moses tokeniser rules), needed by the tokenised scores")
    parser.add_argument("--tokenised", action="store_true", help="also print BLEU on Moses-tokenised text")
    parser.add_argument("--compound-split", action="store_true",
                        help="also print BLEU on Moses-tokenised text with compound splitting")
    parser.add_argument("--name", default="test", help="name of the test set for the report")
    args = parser.parse_args(argv)
    if (args.tokenised or args.compound_split) and not args.lang:
        parser.error("--tokenised and --compound-split need --lang (the target language, for the Moses tokeniser)")

    hyps, refs = read_lines(args.hyp), read_lines(args.ref)
    if len(hyps) != len(refs):
        sys.exit(f"{args.hyp} has {len(hyps)} lines but {args.ref} has {len(refs)}")

    bleu = sacrebleu.BLEU()
    score = bleu.corpus_score(hyps, [refs])
    print(f"sacreBLEU ({args.name}, {len(hyps)} sentences, detokenised): {score.score:.2f}")
    print(f"  signature: {bleu.get_signature()}")
    print(f"  {score}")

    if args.tokenised or args.compound_split:
        tokenise = moses_tokeniser(args.lang)
        tok_hyps, tok_refs = [tokenise(h) for h in hyps], [tokenise(r) for r in refs]
        if args.tokenised:
            report("tokenised BLEU", args.name, tok_hyps, tok_refs)
        if args.compound_split:
            report("tokenised BLEU with compound splitting (##AT##-##AT##)", args.name,
                   [compound_split(h) for h in tok_hyps], [compound_split(r) for r in tok_refs])


def report(what, name, hyps, refs):
    """BLEU of already tokenised text (tok:none)."""
    bleu = sacrebleu.BLEU(tokenize="none", force=True)
    score = bleu.corpus_score(hyps, [refs])
    print(f"{what} ({name}, Moses tokens): {score.score:.2f}")
    print(f"  signature: {bleu.get_signature()}")
    print(f"  {score}")


if __name__ == "__main__":
    main()
