#!/usr/bin/env python
"""Softmax -> RFA-Gate conversion on Multi30k de-en (T2R-style) against RFA-Gate from scratch at a setting of quality.py
(N updates), test BLEU: ``converted[_softcross]``, ``finetuned[_softcross]-F`` (F*N updates more), ``scratch[_softcross]-F``.

    python results/convert.py --setting final --seeds 1
"""
import shutil
import sys

import quality
from runner import PY, bleu, folder, main, run, train

NAME, OUT, WORK = "convert", "results/convert_study.jsonl", quality.WORK
SETTINGS = quality.SETTINGS
METRICS = [("updates in all", "total_updates", 0), ("test BLEU", "test_bleu", 2), ("train s", "train_s", 1)]
FRACTIONS = ("0.1", "0.2")
VARIANTS = {"softmax": "softmax", **{name: kind for cross in ("", "_softcross") for name, kind in [  # the row: what it is
    (f"converted{cross}", "converted"), *((f"finetuned{cross}-{f}", "finetuned") for f in FRACTIONS)]}}
VARIANTS.update({f"scratch{cross}-{f}": "scratch" for cross in ("", "_softcross") for f in FRACTIONS})
prepare = quality.prepare


def trained(variant, s, seed, data, a):
    """The checkpoint of quality.py's run of ``variant`` at this setting, trained first if need be."""
    out = folder(a, variant, seed)
    out.mkdir(parents=True, exist_ok=True)
    return train(quality.train_flags(variant, s, seed, data), out, s["updates"], a), out / "checkpoint_last.pt"


def run_one(variant, s, seed, data, out, a) -> dict:
    kind, n, softcross = VARIANTS[variant], s["updates"], "_softcross" in variant
    extra = round(float(variant.partition("-")[2] or 0) * n)
    base = "gate_softcross" if softcross else "gate_bias2"  # RFA-Gate from scratch, with this cross attention
    record, ckpt = trained("softmax", s, seed, data, a)
    if kind in ("converted", "finetuned"):
        record = {}
        ckpt = folder(a, "converted_softcross" if softcross else "converted", seed) / "converted.pt"
        if not ckpt.exists():
            ckpt.parent.mkdir(parents=True, exist_ok=True)
            run([PY, "scripts/convert_from_softmax.py", "--input", folder(a, "softmax", seed) / "checkpoint_last.pt",
                 "--output", ckpt, "--seed", seed, "--rfa-gate", "--cross-attention", "softmax" if softcross else "rfa"],
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
