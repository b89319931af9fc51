#!/usr/bin/env python
"""Softmax -> RFA-Gate conversion on Multi30k de-en (T2R-style finetuning) against RFA-Gate trained
from scratch, at a setting of results/quality.py (its model, data and N updates), test BLEU:

    python results/convert.py --setting final --seeds 1
    python results/convert.py --report

  softmax                   quality.py's softmax run (the same folder under the same --work: trained once)
  converted                 scripts/convert_from_softmax.py --rfa-gate --cross-attention rfa of it (the paper's model)
  converted_softcross       the same with --cross-attention softmax: only the decoder's self-attention is replaced
  finetuned[_softcross]-F   the converted model finetuned F*N updates (--finetune-from-model, warm-up F*N/5)
  scratch[_softcross]-F     quality.py's gate_bias2 (gate_softcross) run, trained on from update N to N + F*N
                            (a copy of its checkpoint: the same data order, schedule and seed)
A scratch row's train_s is that of its last F*N updates.
"""
import shutil
import sys

import quality
from runner import PY, bleu, folder, main, run, train

NAME, OUT, WORK = "convert", "results/convert_study.jsonl", quality.WORK
SETTINGS = quality.SETTINGS
METRICS = [("updates in all", "total_updates", 0), ("test BLEU", "test_bleu", 2), ("train s", "train_s", 1)]
FRACTIONS = ("0.1", "0.2")
VARIANTS = {"softmax": "softmax"}  # the row's name: what it is
for cross in ("", "_softcross"):
    VARIANTS[f"converted{cross}"] = "converted"
    VARIANTS.update({f"finetuned{cross}-{f}": "finetuned" for f in FRACTIONS})
VARIANTS.update({f"scratch{cross}-{f}": "scratch" for cross in ("", "_softcross") for f in FRACTIONS})
prepare = quality.prepare


def trained(variant, s, seed, data, a):
    """The checkpoint of quality.py's run of ``variant`` at this setting, trained first if need be."""
    out = folder(a, variant, seed)
    out.mkdir(parents=True, exist_ok=True)
    return train(quality.train_flags(variant, s, seed, data), out, s["updates"], a), out / "checkpoint_last.pt"


def run_one(variant, s, seed, data, out, a) -> dict:
    kind, n, f = VARIANTS[variant], s["updates"], variant.partition("-")[2]
    extra = round(float(f or 0) * n)
    softcross = "_softcross" in variant
    base = "gate_softcross" if softcross else "gate_bias2"  # RFA-Gate from scratch, with this cross attention
    record, ckpt = trained("softmax", s, seed, data, a)
    if kind in ("converted", "finetuned"):
        record = {}
        ckpt = folder(a, "converted_softcross" if softcross else "converted", seed) / "converted.pt"
        if not ckpt.exists():
            ckpt.parent.mkdir(parents=True, exist_ok=True)
            run([PY, "scripts/convert_from_softmax.py", "--input", folder(a, "softmax", seed) / "checkpoint_last.pt",
                 "--output", ckpt, "--seed", seed, "--rfa-gate", "--cross-attention",
                 "softmax" if softcross else "rfa"],
                ckpt.parent / "convert.log")
    if kind == "finetuned":
        warmup = dict(s, warmup=max(1, min(s["warmup"], extra // 5)))
        record = train(quality.train_flags(base, warmup, seed, data) + ["--finetune-from-model", ckpt], out, extra, a)
        ckpt = out / "checkpoint_last.pt"
    if kind == "scratch":
        _, start = trained(base, s, seed, data, a)
        if not (out / "checkpoint_last.pt").exists():
            shutil.copy(start, out / "checkpoint_last.pt")
        record, ckpt = train(quality.train_flags(base, s, seed, data), out, n + extra, a), out / "checkpoint_last.pt"
    r = bleu(data / "bin", ckpt, "test", data / "test.ref.en", out, a)
    return {**record, "total_updates": n + extra, "test_bleu": r["bleu"], "test_tokens_per_s": r.get("tokens_per_s")}


if __name__ == "__main__":
    main(sys.modules[__name__])
