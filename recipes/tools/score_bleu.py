#!/usr/bin/env python
"""BLEU of detokenised hypotheses against detokenised references, as the recipes report it.

    python recipes/tools/score_bleu.py --hyp test.hyp.de --ref test.de [--tokenised] [--compound-split] [--name newstest2014]

Prints sacreBLEU (13a tokenisation, mixed case) with its signature. With --tokenised it also
prints BLEU on 13a-tokenised text (tok:none on pre-tokenised input: the "tokenised BLEU" that
IWSLT14 results are usually given in, up to the tokeniser). With --compound-split it
also prints the "tokenised BLEU with compound splitting" of Vaswani et al. (2017) and Ott et al.
(2018), which the RFA paper reports for WMT14 en-de: hypotheses and references are tokenised
(here with sacreBLEU's 13a tokeniser, standing in for the Moses tokeniser of the original
pipeline), every hyphen between two non-space characters is split off as "##AT##-##AT##"
(fairseq's scripts/compound_split_bleu.sh: s{(\\S)-(\\S)}{$1 ##AT##-##AT## $2}g), and BLEU is
computed on the result without further tokenisation (tok:none). Such scores are higher than
sacreBLEU's and only comparable to scores computed the same way.
"""
import argparse
import re
import sys

import sacrebleu
from sacrebleu.tokenizers.tokenizer_13a import Tokenizer13a

_COMPOUND = re.compile(r"(\S)-(\S)")


def compound_split(line: str) -> str:
    """fairseq's compound_split_bleu.sh rule (non-overlapping, left to right, like perl's s///g)."""
    return _COMPOUND.sub(r"\1 ##AT##-##AT## \2", line)


def read_lines(path):
    with open(path, encoding="utf-8") as f:
        return [line.rstrip("\n") for line in f]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hyp", required=True, help="detokenised hypotheses, one per line, in test-set order")
    parser.add_argument("--ref", required=True, help="detokenised references, one per line")
    parser.add_argument("--tokenised", action="store_true", help="also print BLEU on 13a-tokenised text")
    parser.add_argument("--compound-split", action="store_true", help="also print compound-split tokenised BLEU")
    parser.add_argument("--name", default="test", help="name of the test set for the report")
    args = parser.parse_args(argv)

    hyps, refs = read_lines(args.hyp), read_lines(args.ref)
    if len(hyps) != len(refs):
        sys.exit(f"{args.hyp} has {len(hyps)} lines but {args.ref} has {len(refs)}")

    bleu = sacrebleu.BLEU()
    score = bleu.corpus_score(hyps, [refs])
    print(f"sacreBLEU ({args.name}, {len(hyps)} sentences, detokenised): {score.score:.2f}")
    print(f"  signature: {bleu.get_signature()}")
    print(f"  {score}")

    tokenise = Tokenizer13a()
    if args.tokenised:
        report("tokenised BLEU", args.name, [tokenise(h) for h in hyps], [tokenise(r) for r in refs])
    if args.compound_split:
        report("tokenised BLEU with compound splitting (##AT##-##AT##)", args.name,
               [compound_split(tokenise(h)) for h in hyps], [compound_split(tokenise(r)) for r in refs])


def report(what, name, hyps, refs):
    """BLEU of already tokenised text (tok:none)."""
    bleu = sacrebleu.BLEU(tokenize="none", force=True)
    score = bleu.corpus_score(hyps, [refs])
    print(f"{what} ({name}, 13a tokens): {score.score:.2f}")
    print(f"  signature: {bleu.get_signature()}")
    print(f"  {score}")


if __name__ == "__main__":
    main()
