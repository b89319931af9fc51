#!/usr/bin/env python
"""ListOps (Long Range Arena) classified with softmax, RFA, FAVOR+ and LARA encoders: test accuracy,
time per update and peak memory, as ratios to softmax's.

    python results/lra.py --setting tiny --seeds 1                  # a CPU screening
    python results/lra.py --setting long --updates 20 --cpu          # time per update and memory only
    python results/lra.py --setting lra --seeds 1 2 3               # LRA's ListOps (a GPU)
    python results/lra.py --report

The data is generated once per setting (recipes/lra/listops.py, recipes/lra/prepare.sh); the
optimiser is recipes/lra/train.sh's; the test split of the checkpoint best on valid is scored by
fairseq-validate. Settings: tiny, short expressions (20-300 tokens) and a 2 x 64 model, 400 updates,
whose accuracies say little about LRA; long, LRA's lengths (500-2,000) on 4,000 training
expressions, 2 x 128, 1,000 updates; lra, LRA's ListOps as recipes/lra does it (96,000 expressions,
rfa_classifier_lra_listops, 5,000 updates of 32).
"""
import sys

from runner import PY, main, run, train, valid_scores, validate

NAME, OUT, WORK = "lra", "results/lra_study.jsonl", "work/lra_study"
METRICS = [("test accuracy", "test_accuracy", 1), ("best valid accuracy", "valid_accuracy", 1)]
VARIANTS = {kind: ["--encoder-attention", kind] for kind in ("softmax", "rfa", "favor", "lara")}


def model(layers, dim) -> list:
    return ["--arch", "rfa_classifier", "--encoder-layers", layers, "--encoder-embed-dim", dim,
            "--encoder-ffn-embed-dim", 2 * dim, "--encoder-attention-heads", 4]


SETTINGS = {
    "tiny": dict(data=dict(train=4000, valid=500, test=500, min_length=20, max_length=300, max_depth=6, max_args=5),
                 model=model(2, 64), updates=400, warmup=100, lr="2e-3", positions=302),
    "long": dict(data=dict(train=4000, valid=500, test=500, min_length=500, max_length=2000, max_depth=10,
                           max_args=10), model=model(2, 128), updates=1000, warmup=200, lr="1.58e-3", positions=2002),
    "lra": dict(data=None, model=["--arch", "rfa_classifier_lra_listops"], updates=5000, warmup=1000, lr="1.58e-3",
                positions=2002),
}


def prepare(a):
    """The binarised data of the setting, made once: --work/SETTING/data/data-bin."""
    data = a.work / a.setting / "data"
    if not (data / "data-bin" / "label" / "test.bin").exists():
        g = SETTINGS[a.setting]["data"]
        if g is not None:  # else prepare.sh generates LRA's own sizes
            (data / "raw").mkdir(parents=True, exist_ok=True)
            run([PY, "recipes/lra/listops.py", "--out-dir", data / "raw", "--seed", 1,
                 *[x for k, v in g.items() for x in (f"--{k.replace('_', '-')}", v)]], data / "generate.log")
        run(["env", f"WORK={data}", f"RAW_DIR={data / 'raw'}", "bash", "recipes/lra/prepare.sh", "listops"],
            data / "prepare.log")
    return data / "data-bin"


def run_one(variant, s, seed, data, out, a) -> dict:
    every = max(50, s["updates"] // 10)  # validate and save this often; keep the best on valid
    batch = ["--batch-size", "32", "--required-batch-size-multiple", "1"]
    record = train([data, "--user-dir", "rfa_fairseq", "--task", "sentence_prediction", "--num-classes", "10",
                    "--init-token", "0", "--max-positions", s["positions"], "--criterion", "sentence_prediction",
                    *s["model"], *VARIANTS[variant], "--optimizer", "adam", "--adam-betas", "(0.9, 0.98)",
                    "--adam-eps", "1e-9", "--weight-decay", "0.1", "--lr", s["lr"], "--lr-scheduler", "inverse_sqrt",
                    "--warmup-updates", s["warmup"], *batch, "--save-interval-updates", every,
                    "--validate-interval-updates", every, "--keep-interval-updates", "1", "--best-checkpoint-metric",
                    "accuracy", "--maximize-best-checkpoint-metric", "--seed", seed, "--log-interval", "50"],
                   out, s["updates"], a)
    record["valid_accuracy"] = max(v["accuracy"] for v in valid_scores((out / "train.log").read_text()))
    test = validate(data, out / "checkpoint_best.pt", "test", out / "test.log", a, "--task", "sentence_prediction",
                    "--criterion", "sentence_prediction", *batch, "--num-workers", "0")
    return {**record, "test_accuracy": test["accuracy"], "test_loss": test["loss"]}


if __name__ == "__main__":
    main(sys.modules[__name__])
