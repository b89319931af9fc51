#!/usr/bin/env python
"""Train a joint sentencepiece model and encode text files with it (for the recipes).

    python scripts/sentencepiece_tool.py train --model-prefix spm --vocab-size 8000 a.txt b.txt
    python scripts/sentencepiece_tool.py encode --model spm.model IN OUT [IN OUT ...]
"""
import argparse
import gzip
import sys

import sentencepiece as spm


def _open(path):
    return gzip.open(path, "rt", encoding="utf-8") if path.endswith(".gz") else open(path, encoding="utf-8")


def train(args):
    def sentences():
        for path in args.inputs:
            with _open(path) as f:
                for line in f:
                    line = line.strip()
                    if line:
                        yield line

    spm.SentencePieceTrainer.train(
        sentence_iterator=sentences(), model_prefix=args.model_prefix, vocab_size=args.vocab_size,
        model_type=args.model_type, character_coverage=args.character_coverage,
        input_sentence_size=args.input_sentence_size, shuffle_input_sentence=True,
        # fairseq's dictionary adds its own specials; keep sentencepiece's out of the text.
        bos_id=-1, eos_id=-1, unk_id=0, pad_id=-1, minloglevel=2,
    )


def encode(args):
    if len(args.files) % 2:
        sys.exit("encode: give input/output path pairs")
    sp = spm.SentencePieceProcessor(model_file=args.model)
    for src, dst in zip(args.files[::2], args.files[1::2]):
        with _open(src) as fin, open(dst, "w", encoding="utf-8") as fout:
            for line in fin:
                fout.write(" ".join(sp.encode(line.strip(), out_type=str)) + "\n")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train")
    t.add_argument("--model-prefix", required=True)
    t.add_argument("--vocab-size", type=int, required=True)
    t.add_argument("--model-type", default="unigram", choices=["unigram", "bpe"])
    t.add_argument("--character-coverage", type=float, default=1.0)
    t.add_argument("--input-sentence-size", type=int, default=10_000_000)
    t.add_argument("inputs", nargs="+")
    e = sub.add_parser("encode")
    e.add_argument("--model", required=True)
    e.add_argument("files", nargs="+")
    args = parser.parse_args()
    train(args) if args.cmd == "train" else encode(args)


if __name__ == "__main__":
    main()
