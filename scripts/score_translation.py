#!/usr/bin/env python
"""Score fairseq-generate output with sacreBLEU and read its decoding speed.

    python scripts/score_translation.py GENERATE_STDOUT GENERATE_LOG REFERENCE [--json OUT.json --label NAME]

GENERATE_STDOUT holds the H- lines (with --post-process applied), GENERATE_LOG fairseq's
"Translated N sentences (T tokens) in Xs" line. The references are used as they are.
"""
import argparse
import json
import re

import sacrebleu

SPEED = re.compile(r"Translated ([\d,]+) sentences \(([\d,]+) tokens\) in ([\d.]+)s "
                   r"\(([\d.]+) sentences/s, ([\d.]+) tokens/s\)")


def hypotheses(path):
    hyps = {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.startswith("H-"):
                head, _score, text = (line.rstrip("\n").split("\t") + [""])[:3]
                hyps[int(head[2:])] = text
    return [hyps[i] for i in sorted(hyps)]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("generate_out")
    p.add_argument("generate_log")
    p.add_argument("reference")
    p.add_argument("--json", help="append a JSON record here")
    p.add_argument("--label", default="")
    args = p.parse_args()
    hyps = hypotheses(args.generate_out)
    refs = open(args.reference, encoding="utf-8").read().splitlines()
    if len(hyps) != len(refs):
        raise SystemExit(f"{len(hyps)} hypotheses for {len(refs)} references: some sentences were not translated")
    metric = sacrebleu.BLEU(force=True)  # Multi30k references are tokenised by design
    bleu = metric.corpus_score(hyps, [refs])
    record = {"label": args.label, "bleu": round(bleu.score, 2), "signature": str(metric.get_signature()),
              "sentences": len(hyps)}
    print(f"sacreBLEU ({len(hyps)} sentences): {bleu.score:.2f}  [{metric.get_signature()}]")
    m = SPEED.search(open(args.generate_log, encoding="utf-8").read())
    if m:
        record.update(tokens=int(m.group(2).replace(",", "")), seconds=float(m.group(3)),
                      tokens_per_s=float(m.group(5)), sentences_per_s=float(m.group(4)))
        print(f"decoding: {m.group(2)} tokens in {m.group(3)} s = {m.group(5)} tokens/s, {m.group(4)} sentences/s")
    if args.json:
        with open(args.json, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
