#!/usr/bin/env python
"""ListOps (Long Range Arena) with softmax, RFA, FAVOR+ and LARA encoders: test accuracy of the checkpoint best on valid,
time per update, peak memory. Settings: tiny (a CPU screening), long (LRA's lengths), lra (recipes/lra's).

    python results/lra.py --setting long --updates 20 --cpu          # time per update and memory only
"""
import sys

from runner import PY, main, run, tool, train, valid_scores

NAME, OUT, WORK = "lra", "results/lra_study.jsonl", "work/lra_study"
METRICS = [("test accuracy", "test_accuracy", 1), ("best valid accuracy", "valid_accuracy", 1)]
VARIANTS = {kind: ["--encoder-attention", kind] for kind in ("softmax", "rfa", "favor", "lara")}


def model(layers, dim) -> list:
    return ["--arch", "rfa_classifier", "--encoder-layers", layers, "--encoder-embed-dim", dim,
            "--encoder-ffn-embed-dim", 2 * dim, "--encoder-attention-heads", 4]


SETTINGS = {
    "tiny": dict(data=dict(train=4000, valid=500, test=500, min_length=20, max_length=300, max_depth=6, max_args=5),
                 model=model(2, 64), updates=400, warmup=100, lr="2e-3", positions=302),
    "long": dict(data=dict(train=4000, valid=500, test=500, min_length=500, max_length=2000, max_depth=10, max_args=10),
                 model=model(2, 128), updates=1000, warmup=200, lr="1.58e-3", positions=2002),
    "lra": dict(data=None, model=["--arch", "rfa_classifier_lra_listops"], updates=5000, warmup=1000, lr="1.58e-3", positions=2002),
}


def prepare(a):
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
    task = ["--user-dir", "rfa_fairseq", "--task", "sentence_prediction", "--criterion", "sentence_prediction",
            "--batch-size", "32", "--required-batch-size-multiple", "1"]
    record = train([data, *task, "--num-classes", "10", "--init-token", "0", "--max-positions", s["positions"], *s["model"],
                    *VARIANTS[variant], "--optimizer", "adam", "--adam-betas", "(0.9, 0.98)", "--adam-eps", "1e-9",
                    "--weight-decay", "0.1", "--lr", s["lr"], "--lr-scheduler", "inverse_sqrt", "--warmup-updates",
                    s["warmup"], "--save-interval-updates", every, "--validate-interval-updates", every,
                    "--keep-interval-updates", "1", "--best-checkpoint-metric", "accuracy", "--maximize-best-checkpoint-metric",
                    "--seed", seed, "--log-interval", "50"], out, s["updates"], a)
    record["valid_accuracy"] = max(v["accuracy"] for v in valid_scores((out / "train.log").read_text()))
    test = valid_scores(run([tool("fairseq-validate"), data, *task, "--path", out / "checkpoint_best.pt", "--valid-subset",
                             "test", "--num-workers", "0", *a.cpu_flag], out / "test.log"), "test")[-1]
    return {**record, "test_accuracy": test["accuracy"], "test_loss": test["loss"]}


if __name__ == "__main__":
    main(sys.modules[__name__])
