#!/usr/bin/env python
"""Translation quality on Multi30k de-en: softmax, RFA, RFA-Gate and their options trained alike, decoded with beam 4,
scored by sacreBLEU on valid and test, with scripts/rfa_diagnostics.py on valid (docs/quality.md).

    python results/quality.py --setting screen --variants softmax rfa rfa_gate --seeds 1 2 3
"""
import json
import sys

from runner import PY, bleu, main, run, train, valid_scores

NAME, OUT, WORK = "quality", "results/quality_study.jsonl", "work/study"
METRICS = [("valid BLEU", "valid_bleu", 2), ("test BLEU", "test_bleu", 2), ("valid loss", "valid_loss", 3)]
TIME = "s_per_update_with_validation"  # what the recorded runs have: the whole run's seconds per update
SCREEN = dict(layers=2, dim=256, ffn=512, heads=4, updates=600, warmup=150, lr="3e-3")  # ideas against each other
SETTINGS = {"screen": SCREEN, "final": dict(layers=3, dim=256, ffn=1024, heads=4, updates=2000, warmup=400, lr="2e-3"),
            # transformer-base size (6+6 x 512) trained briefly, for the decoding benchmark's real output lengths
            "base": dict(layers=6, dim=512, ffn=2048, heads=8, updates=400, warmup=200, lr="1e-3"),
            "quickstart": dict(SCREEN, updates=330, splits=("test",)),  # scripts/quickstart.sh
            "precision": dict(SCREEN, splits=("valid",))}  # mixed precision against fp32 (scripts/gpu_check.sh --precision)
# --user-dir also for fairseq's models: the plugin allow-lists what fairseq-train's resuming unpickles
PLUGIN = ["--user-dir", "rfa_fairseq", "--arch", "rfa_transformer_iwslt_de_en"]
RFA = PLUGIN + ["--cross-attention", "rfa"]  # the paper's model: RFA cross attention too
GATE, PAPER_GATE = RFA + ["--rfa-gate"], RFA + ["--rfa-gate", "--rfa-gate-bias", "0"]  # the paper's gate
VARIANTS = {
    "softmax": ["--user-dir", "rfa_fairseq", "--arch", "transformer_iwslt_de_en"],
    "rfa": RFA, "rfa_gate": PAPER_GATE,
    "gate_bias2": GATE + ["--rfa-gate-bias", "2"],  # the gate's start at sigmoid(2) (now the default)
    "gate_decay": PAPER_GATE + ["--rfa-gate-form", "decay"],
    "gate_decay_bias2": GATE + ["--rfa-gate-form", "decay", "--rfa-gate-bias", "2"],
    "gate_sigma2": PAPER_GATE + ["--rfa-init-sigma", "2"], "rfa_sigma2": RFA + ["--rfa-init-sigma", "2"],
    "favor": RFA + ["--rfa-kernel", "favor"],
    "elu": RFA + ["--rfa-kernel", "elu"], "gate_elu": GATE + ["--rfa-kernel", "elu"],
    # RFA(-Gate) self-attention behind fairseq's softmax cross attention (the defaults)
    "gate_softcross": PLUGIN + ["--rfa-gate", "--cross-attention", "softmax"],
    **{f"gate_softcross_{p}": PLUGIN + ["--rfa-gate", "--cross-attention", "softmax", f"--{p}"]
       for p in ("bf16", "fp16", "amp")},  # fairseq's mixed precision (CUDA only)
    "rfa_softcross": PLUGIN + ["--cross-attention", "softmax"],
    "softdec": PLUGIN + ["--decoder-attention", "softmax"],  # fairseq's softmax decoder in the plugin's model
    "gate_softcross_f32": PLUGIN + ["--rfa-gate", "--rfa-causal-feature-dim", "32"],  # half the causal state
    "elu_softcross": PLUGIN + ["--rfa-kernel", "elu"], "gate_elu_softcross": PLUGIN + ["--rfa-gate", "--rfa-kernel", "elu"],
    # linear encoders behind the default RFA-Gate decoder and behind fairseq's softmax decoder; LARA: 8 landmarks
    **{f"{prefix}enc_{kind}": decoder + ["--encoder-attention", kind] + ["--lara-landmarks", "8"] * (kind == "lara")
       for prefix, decoder in (("", PLUGIN + ["--rfa-gate"]), ("softdec_", PLUGIN + ["--decoder-attention", "softmax"]))
       for kind in ("rfa", "favor", "lara")},
}
DEFAULT_VARIANTS = ["softmax", "rfa", "rfa_gate"]


def prepare(a):  # the Multi30k data (scripts/prepare_multi30k.sh): --work/data/{bin, spm.model, valid.ref.en, test.ref.en}
    run(["bash", "scripts/prepare_multi30k.sh", a.work / "data"], a.work / "prepare.log")
    return a.work / "data"


def train_flags(variant, s, seed, data) -> list:  # fairseq-train's arguments but for --max-update and --save-dir
    sizes = [x for side in ("encoder", "decoder") for k, v in (("layers", s["layers"]), ("embed-dim", s["dim"]),
             ("ffn-embed-dim", s["ffn"]), ("attention-heads", s["heads"])) for x in (f"--{side}-{k}", v)]
    return [data / "bin", *VARIANTS[variant], "--share-all-embeddings", *sizes, "--dropout", "0.1", "--optimizer", "adam",
            "--adam-betas", "(0.9, 0.98)", "--clip-norm", "1.0", "--lr", s["lr"], "--lr-scheduler", "inverse_sqrt",
            "--warmup-updates", s["warmup"], "--criterion", "label_smoothed_cross_entropy", "--label-smoothing", "0.1",
            "--max-tokens", "4000", "--seed", seed, "--log-interval", "25"]


def has_rfa_modules(variant) -> bool:
    """Whether scripts/rfa_diagnostics.py has RFA modules to read: an RFA decoder or an rfa / favor encoder."""
    flags = VARIANTS[variant]
    return flags[:len(PLUGIN)] == PLUGIN and "--decoder-attention" not in flags or any(
        f == "--encoder-attention" and flags[i + 1] != "lara" for i, f in enumerate(flags))


def run_one(variant, s, seed, data, out, a) -> dict:
    record = {"flags": " ".join(VARIANTS[variant]), **train(train_flags(variant, s, seed, data), out, s["updates"], a)}
    valid = valid_scores((out / "train.log").read_text())
    if valid:  # the last validation, after the last update (label-smoothed cross entropy, base 2)
        record["valid_loss"] = valid[-1]["loss"]
    for split in s.get("splits", ("valid", "test")):
        r = bleu(data / "bin", out / "checkpoint_last.pt", split, data / f"{split}.ref.en", out, a)
        record.update({f"{split}_bleu": r["bleu"], f"{split}_tokens_per_s": r.get("tokens_per_s")})
    if "valid_bleu" in record and has_rfa_modules(variant):
        run([PY, "scripts/rfa_diagnostics.py", data / "bin", "--path", out / "checkpoint_last.pt", "--json",
             out / "diagnostics.json"], out / "diagnostics.log")
        record["diagnostics"] = {m["module"].replace("decoder.layers.", ""): {
            k: (round(m[k], 4) if isinstance(m[k], float) else m[k])
            for k in ("sigma_mean", "mean_gate", "clamped_pct", "negative_pct")}
            for m in json.loads((out / "diagnostics.json").read_text())["modules"]}
    return record


if __name__ == "__main__":
    main(sys.modules[__name__])
