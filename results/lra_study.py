#!/usr/bin/env python
"""ListOps (Long Range Arena) with softmax, RFA, FAVOR+ and LARA encoders: test accuracy, time per
update and peak memory, as ratios to softmax. A resumable queue of training runs.

    python results/lra_study.py --setting tiny --attentions softmax rfa favor lara --seeds 1
    python results/lra_study.py --setting lra --seeds 1 2 3          # LRA's ListOps (a GPU)
    python results/lra_study.py --report                             # the table of what is recorded
    python results/lra_study.py --setting long --updates 20 --cpu   # time per update only (a group of its own)

Every run generates (once per setting) ListOps with recipes/lra/listops.py, binarises it with
recipes/lra/prepare.sh, trains the classifier with fairseq-train (sentence_prediction task),
scores the test split of checkpoint_best.pt with fairseq-validate and appends one JSON line to
--out (default results/lra_study.jsonl): accuracies, seconds per update (fairseq's train_wall,
which leaves out validation and checkpoints; also the whole run's time per update), peak memory
(the CUDA allocator's peak on a GPU, else the training process's peak resident memory, which
includes the ~0.5 GB of Python, torch and fairseq and so understates the differences), the
device and the threads. A run already recorded is skipped; an interrupted one resumes from its checkpoint (its
work folder, work/lra_study/, is kept). Timings spoil each other: run one queue at a time, or
pin each to its own core (``OMP_NUM_THREADS=1 taskset -c N``).

Settings (all share the data generator and the optimiser of recipes/lra/train.sh):
- tiny: short expressions (lengths 20-300), 2 layers of 64 dims, 400 updates: a CPU screening
  whose accuracies say little about LRA, but whose ratios say how the attentions compare at
  these lengths;
- long: LRA's lengths (500-2,000) on 4,000 training expressions, 2 layers of 128 dims, 1,000
  updates: long inputs at a small cost (a GPU; hours on a CPU);
- lra: LRA's ListOps as recipes/lra does it (96,000 / 2,000 / 2,000 expressions,
  rfa_classifier_lra_listops, 5,000 updates of 32).
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
BIN = Path(PY).parent
ATTENTIONS = ("softmax", "rfa", "favor", "lara")

SETTINGS = {
    "tiny": dict(data=dict(train=4000, valid=500, test=500, min_length=20, max_length=300, max_depth=6, max_args=5),
                 model=["--arch", "rfa_classifier", "--encoder-layers", "2", "--encoder-embed-dim", "64",
                        "--encoder-ffn-embed-dim", "128", "--encoder-attention-heads", "4"],
                 updates=400, warmup=100, lr="2e-3", positions=302),
    "long": dict(data=dict(train=4000, valid=500, test=500, min_length=500, max_length=2000, max_depth=10,
                           max_args=10),
                 model=["--arch", "rfa_classifier", "--encoder-layers", "2", "--encoder-embed-dim", "128",
                        "--encoder-ffn-embed-dim", "256", "--encoder-attention-heads", "4"],
                 updates=1000, warmup=200, lr="1.58e-3", positions=2002),
    "lra": dict(data=None, model=["--arch", "rfa_classifier_lra_listops"], updates=5000, warmup=1000, lr="1.58e-3",
                positions=2002),
}

# Runs fairseq-train in this process and writes its peak memory to argv[1] (a file) on the way out.
TRAIN_WITH_PEAK = """
import json, resource, sys
import torch
from fairseq_cli.train import cli_main
peak_file = sys.argv.pop(1)
try:
    cli_main()
finally:
    peak = {"max_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)}
    if torch.cuda.is_available():
        peak["cuda_peak_mb"] = round(torch.cuda.max_memory_allocated() / 2 ** 20, 1)
        peak["device"] = torch.cuda.get_device_name()
    with open(peak_file, "w") as f:
        json.dump(peak, f)
"""


def run(cmd, log, env=None):
    with open(log, "w") as f:
        subprocess.run([str(c) for c in cmd], stdout=f, stderr=subprocess.STDOUT, check=True, cwd=ROOT, env=env)


def environment():
    return {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}", "RFA_USE_CURRENT_ENV": "1",
            "PYTHONWARNINGS": "ignore"}


def prepare(setting: str, work: Path) -> Path:
    """The binarised data of a setting (made once): work/<setting>/data/data-bin."""
    data = work / setting / "data"
    if (data / "data-bin" / "label" / "test.bin").exists():
        return data / "data-bin"
    raw = data / "raw"
    g = SETTINGS[setting]["data"]
    if g is not None:  # else prepare.sh generates LRA's own sizes
        raw.mkdir(parents=True, exist_ok=True)
        run([PY, "recipes/lra/listops.py", "--out-dir", raw, "--train", g["train"], "--valid", g["valid"],
             "--test", g["test"], "--min-length", g["min_length"], "--max-length", g["max_length"],
             "--max-depth", g["max_depth"], "--max-args", g["max_args"], "--seed", 1], work / f"{setting}.generate.log")
    run(["bash", "recipes/lra/prepare.sh", "listops"], work / f"{setting}.prepare.log",
        env={**environment(), "WORK": str(data), "RAW_DIR": str(raw)})
    return data / "data-bin"


def gpu() -> bool:
    out = subprocess.run([PY, "-c", "import torch; print(torch.cuda.is_available())"], capture_output=True, text=True)
    return out.stdout.strip() == "True"


def train_threads() -> int:
    return int(os.environ.get("OMP_NUM_THREADS") or len(os.sched_getaffinity(0)))


def one_run(attention: str, setting: str, seed: int, data: Path, work: Path, on_gpu: bool, updates: int) -> dict:
    s = {**SETTINGS[setting], "updates": updates}
    # a run cut short (--updates) has its own folder: a full run must not resume from it
    out = work / setting / (f"{attention}-seed{seed}" + ("" if updates == SETTINGS[setting]["updates"] else f"-u{updates}"))
    out.mkdir(parents=True, exist_ok=True)
    timing = out / "timing.json"  # written once training has finished
    device = [] if on_gpu else ["--cpu"]
    if not timing.exists():
        resumed = (out / "checkpoint_last.pt").exists()
        run([PY, "-c", TRAIN_WITH_PEAK, out / "peak.json", data, "--user-dir", "rfa_fairseq",
             "--task", "sentence_prediction", "--num-classes", "10", "--init-token", "0",
             "--max-positions", s["positions"], "--criterion", "sentence_prediction", *s["model"],
             "--encoder-attention", attention, "--optimizer", "adam", "--adam-betas", "(0.9, 0.98)",
             "--adam-eps", "1e-9", "--weight-decay", "0.1", "--lr", s["lr"], "--lr-scheduler", "inverse_sqrt",
             "--warmup-updates", s["warmup"], "--batch-size", "32", "--required-batch-size-multiple", "1",
             "--max-update", s["updates"], "--save-dir", out, "--no-epoch-checkpoints",
             "--save-interval-updates", max(50, s["updates"] // 10), "--validate-interval-updates",
             max(50, s["updates"] // 10), "--keep-interval-updates", "1", "--best-checkpoint-metric", "accuracy",
             "--maximize-best-checkpoint-metric", "--seed", seed, "--num-workers", "0", "--log-format", "simple",
             "--log-interval", "50", *device], out / "train.log")
        log = (out / "train.log").read_text()
        done = re.search(r"done training in ([\d.]+) seconds", log)
        valid = re.findall(r"valid on 'valid' subset .*?accuracy ([\d.]+)", log)
        timing.write_text(json.dumps({"train_s": float(done.group(1)) if done else None, "resumed": resumed,
                                      "threads": train_threads(), "best_valid_accuracy": max(map(float, valid))}))
    t = json.loads(timing.read_text())
    run([BIN / "fairseq-validate", data, "--user-dir", "rfa_fairseq", "--task", "sentence_prediction",
         "--criterion", "sentence_prediction", "--path", out / "checkpoint_best.pt", "--valid-subset", "test",
         "--batch-size", "32", "--required-batch-size-multiple", "1", "--num-workers", "0", *device],
        out / "test.log")
    test = re.search(r"valid on 'test' subset \| loss ([\d.]+) .*?accuracy ([\d.]+)", (out / "test.log").read_text())
    peak = json.loads((out / "peak.json").read_text()) if (out / "peak.json").exists() else {}
    # fairseq's per-epoch train_wall (whole seconds) counts the updates alone, not validation and saving
    train_wall = sum(int(w) for w in re.findall(r"\| train \| epoch \d+ \|.*?\| train_wall (\d+) \|",
                                                (out / "train.log").read_text()))
    return {"attention": attention, "setting": setting, "seed": seed, "updates": s["updates"],
            "valid_accuracy": t["best_valid_accuracy"], "test_accuracy": float(test.group(2)),
            "test_loss": float(test.group(1)), "train_s": t["train_s"],
            # only a run trained in one go has a meaningful time per update
            "s_per_update": None if t["resumed"] or not train_wall else round(train_wall / s["updates"], 4),
            "s_per_update_with_validation": None if t["resumed"] or not t["train_s"]
            else round(t["train_s"] / s["updates"], 4),
            "train_threads": t["threads"], "device": peak.get("device", "cpu"),
            "peak_mb": peak.get("cuda_peak_mb", peak.get("max_rss_mb")),
            "peak_kind": "cuda_allocated" if "cuda_peak_mb" in peak else "max_rss",
            "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                     cwd=ROOT).stdout.strip()}


def load(path: Path):
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def report(records):
    """Per setting, device and thread count: accuracies (mean over seeds) and the median time per
    update and peak memory, each also as a ratio to softmax's in the same group."""
    groups = {}
    for r in records:
        label = r["setting"]
        if r.get("updates", SETTINGS[r["setting"]]["updates"]) != SETTINGS[r["setting"]]["updates"]:
            label += f", {r['updates']} updates"  # a timing probe (--updates): a group of its own
        groups.setdefault((label, r["device"], r["train_threads"]), {}).setdefault(r["attention"], []).append(r)
    print("| setting | device, threads | attention | seeds | test accuracy (mean, min-max) | best valid | "
          "s/update (x softmax) | peak MB (x softmax) |")
    print("|---|---|---|---|---|---|---|---|")
    for (setting, device, threads), by_attention in sorted(groups.items(), key=lambda kv: str(kv[0])):
        def median(rs, key):
            values = [r[key] for r in rs if r.get(key)]
            return statistics.median(values) if values else None

        base_t = median(by_attention.get("softmax", []), "s_per_update")
        base_m = median(by_attention.get("softmax", []), "peak_mb")
        for attention in sorted(by_attention, key=lambda a: ATTENTIONS.index(a) if a in ATTENTIONS else 99):
            rs = by_attention[attention]
            acc = [r["test_accuracy"] for r in rs]
            spread = f" ({min(acc):.1f}-{max(acc):.1f})" if len(acc) > 1 else ""
            t, m = median(rs, "s_per_update"), median(rs, "peak_mb")
            t_cell = "-" if t is None else f"{t:.3f}" + (f" ({t / base_t:.2f}x)" if base_t else "")
            m_cell = "-" if m is None else f"{m:.0f}" + (f" ({m / base_m:.2f}x)" if base_m else "")
            print(f"| {setting} | {device}, {threads} | {attention} | {','.join(str(r['seed']) for r in rs)} | "
                  f"{statistics.mean(acc):.1f}{spread} | {statistics.mean(r['valid_accuracy'] for r in rs):.1f} | "
                  f"{t_cell} | {m_cell} |")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--setting", choices=list(SETTINGS), default="tiny")
    p.add_argument("--attentions", nargs="+", default=list(ATTENTIONS))
    p.add_argument("--seeds", nargs="+", type=int, default=[1])
    p.add_argument("--out", type=Path, default=ROOT / "results/lra_study.jsonl")
    p.add_argument("--work", type=Path, default=ROOT / "work/lra_study")
    p.add_argument("--updates", type=int, default=None,
                   help="train this many updates instead of the setting's (a timing probe; recorded as its own group)")
    p.add_argument("--cpu", action="store_true", help="train on the CPU even when a GPU is seen")
    p.add_argument("--report", action="store_true", help="print the recorded results and stop")
    args = p.parse_args(argv)
    unknown = [a for a in args.attentions if a not in ATTENTIONS]
    if unknown:
        p.error(f"unknown attention(s) {unknown}; known: {', '.join(ATTENTIONS)}")
    if args.report:
        report(load(args.out))
        return
    updates = SETTINGS[args.setting]["updates"] if args.updates is None else args.updates
    if updates < 1:
        p.error(f"--updates must be at least 1, got {updates}")
    args.work.mkdir(parents=True, exist_ok=True)
    data = prepare(args.setting, args.work)
    on_gpu = not args.cpu and gpu()
    for seed in args.seeds:
        for attention in args.attentions:
            done = {(r["attention"], r["setting"], r["seed"], r.get("updates")) for r in load(args.out)}
            if (attention, args.setting, seed, updates) in done:
                print(f"[lra-study] {args.setting} {attention} seed {seed}: recorded, skipped", flush=True)
                continue
            print(f"[lra-study] {args.setting} {attention} seed {seed}: running", flush=True)
            record = one_run(attention, args.setting, seed, data, args.work, on_gpu, updates)
            with open(args.out, "a") as f:
                f.write(json.dumps(record) + "\n")
            print(f"[lra-study] {args.setting} {attention} seed {seed}: test accuracy {record['test_accuracy']}, "
                  f"{record['s_per_update']} s/update, peak {record['peak_mb']} MB", flush=True)


if __name__ == "__main__":
    main()
