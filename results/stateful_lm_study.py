#!/usr/bin/env python
"""Stateful RFA-Gate language model against the same model without state and against softmax, on
the WikiText-103 text in ../shared/data (split by article, as results/wikitext_small.sh): a
resumable queue of runs that appends one JSON line per run.

    python results/stateful_lm_study.py                        # the four variants, seed 1
    python results/stateful_lm_study.py --updates 1000 --seeds 1 2
    python results/stateful_lm_study.py --report

Same model (4 layers, 256 dims, 4 heads, FFN 1024, adaptive softmax) and budget (--updates of
16 rows x --block tokens) for all four (RFA without the gate is the quality study's LM row):
  softmax            transformer_lm, --task language_modeling; test perplexity of fixed blocks and
                     with fairseq's sliding --context-window (half a block)
  rfa_gate           rfa_transformer_lm --rfa-gate, --task language_modeling (every block alone)
  rfa                rfa_transformer_lm, --task language_modeling
  rfa_gate_stateful  the same model with --task rfa_stateful_lm (state carried across updates)
  rfa_gate_stateful_g8  the same with --stream-groups 8: 8 groups of 16 streams take turns
The RFA models are scored both ways: blocks alone (--task language_modeling) and with the state
carried through the whole test split (--task rfa_stateful_lm, one stream). The text is small
(about 345K training tokens), so every model overfits within the budget: the checkpoint scored
is the one with the best validation loss (fairseq's checkpoint_best.pt, one per epoch), and the
record says at which update it was saved. A recorded run is skipped; an interrupted one resumes
from its checkpoint (work folder --work).
"""
import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
BIN = Path(PY).parent
RFA = ["--user-dir", "rfa_fairseq", "--arch", "rfa_transformer_lm"]
VARIANTS = {
    # --user-dir: fairseq-train resumes a run only with the classes the plugin allow-lists
    "softmax": ("language_modeling", ["--user-dir", "rfa_fairseq", "--arch", "transformer_lm"]),
    "rfa_gate": ("language_modeling", RFA + ["--rfa-gate"]),
    "rfa": ("language_modeling", RFA),
    "rfa_gate_stateful": ("rfa_stateful_lm", RFA + ["--rfa-gate"]),
    # 8 groups of 16 streams take turns, so successive updates read different articles
    "rfa_gate_stateful_g8": ("rfa_stateful_lm", RFA + ["--rfa-gate", "--stream-groups", "8"]),
}
ROWS = 16  # rows per batch for both tasks (language_modeling: --max-tokens ROWS * block)


def run(cmd, log):
    with open(log, "w") as f:
        subprocess.run([str(c) for c in cmd], stdout=f, stderr=subprocess.STDOUT, check=True, cwd=ROOT)
    return Path(log).read_text()


def prepare(work: Path, source: Path) -> Path:
    data = work / "bin"
    if not (data / "dict.txt").exists():
        text = work / "text"
        subprocess.run([PY, "results/split_wikitext_by_article.py", text, source / "wiki.valid.tokens",
                        source / "wiki.test.tokens"], check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
        run([BIN / "fairseq-preprocess", "--only-source", "--trainpref", text / "train.tokens", "--validpref",
             text / "valid.tokens", "--testpref", text / "test.tokens", "--destdir", data, "--workers", "1"],
            work / "preprocess.log")
    return data


def model_args(a) -> list:
    return ["--decoder-layers", a.layers, "--decoder-embed-dim", a.dim, "--decoder-ffn-embed-dim", 4 * a.dim,
            "--decoder-attention-heads", a.heads, "--adaptive-softmax-cutoff", a.cutoffs,
            "--criterion", "adaptive_loss"]


def perplexity(data: Path, ckpt: Path, task: str, block: int, log: Path, extra=()) -> float:
    batch = ["--batch-size", "1"] if task == "rfa_stateful_lm" else ["--max-tokens", ROWS * block]
    out = run([BIN / "fairseq-eval-lm", data, "--user-dir", "rfa_fairseq", "--task", task, "--path", ckpt,
               "--gen-subset", "test", "--tokens-per-sample", block, *batch, "--cpu", *extra], log)
    m = re.search(r"Perplexity: ([\d.]+)", out)
    if not m:
        raise RuntimeError(f"no perplexity in {log}")
    return float(m.group(1))


def one_run(variant: str, seed: int, a, data: Path) -> dict:
    task, arch = VARIANTS[variant]
    out = a.work / f"{variant}-u{a.updates}-seed{seed}"
    out.mkdir(parents=True, exist_ok=True)
    batch = ["--batch-size", ROWS] if task == "rfa_stateful_lm" else ["--max-tokens", ROWS * a.block]
    log = run([BIN / "fairseq-train", data, "--task", task, *arch, *model_args(a), "--dropout", "0.2",
               "--tokens-per-sample", a.block, "--ddp-backend", "legacy_ddp", "--optimizer", "adam",
               "--adam-betas", "(0.9, 0.98)", "--clip-norm", "1.0", "--lr", a.lr, "--lr-scheduler", "inverse_sqrt",
               "--warmup-updates", a.warmup, *batch, "--seed", seed, "--max-update", a.updates,
               "--save-dir", out, "--no-epoch-checkpoints", "--log-format", "simple", "--log-interval", "50",
               "--cpu", "--num-workers", "0"], out / "train.log")
    done = re.search(r"done training in ([\d.]+) seconds", log)
    ckpt = out / "checkpoint_best.pt"  # chosen on the validation split: see the module docstring
    valid = re.findall(r"valid on 'valid' subset \| loss [\d.]+ \| ppl ([\d.]+) .*?\| num_updates (\d+)", log)
    record = {"variant": variant, "train_task": task, "seed": seed, "updates": a.updates, "warmup": a.warmup, "block": a.block,
              "model": f"{a.layers}x{a.dim}, {a.heads} heads", "train_s": float(done.group(1)) if done else None,
              "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                       cwd=ROOT).stdout.strip()}
    if valid:  # the validation perplexities (base 2 in fairseq's log) and where the best one was
        best_ppl, best_update = min((float(ppl), int(n)) for ppl, n in valid)
        record.update(valid_ppl_best=best_ppl, best_update=best_update)
    record["test_ppl_blocks"] = perplexity(data, ckpt, "language_modeling", a.block, out / "eval_blocks.log")
    if variant == "softmax":
        record["test_ppl_sliding"] = perplexity(data, ckpt, "language_modeling", a.block, out / "eval_sliding.log",
                                                ["--context-window", a.block // 2])
    else:
        record["test_ppl_stateful"] = perplexity(data, ckpt, "rfa_stateful_lm", a.block, out / "eval_stateful.log")
    return record


def load(path: Path):
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def report(records):
    print("| variant | trained with | updates | seed | best valid ppl (update) | test ppl, blocks alone "
          "| with state | sliding window | train s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in records:
        cells = [r.get(k) for k in ("test_ppl_blocks", "test_ppl_stateful", "test_ppl_sliding")]
        cells = [f"{c:.2f}" if c is not None else "-" for c in cells]
        best = f"{r['valid_ppl_best']:.2f} ({r['best_update']})" if "valid_ppl_best" in r else "-"
        print(f"| {r['variant']} | {r['train_task']} | {r['updates']} | {r['seed']} | {best} | {' | '.join(cells)} "
              f"| {r['train_s']} |")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    p.add_argument("--seeds", nargs="+", type=int, default=[1])
    p.add_argument("--updates", type=int, default=500,
                   help="training updates (16 rows x --block tokens each); the best validation checkpoint is scored")
    p.add_argument("--warmup", type=int, default=100,
                   help="warm-up updates of the inverse square root schedule (fixed, so that a shorter run follows "
                        "the start of a longer one)")
    p.add_argument("--block", type=int, default=256, help="--tokens-per-sample, in training and evaluation")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--cutoffs", default="3000,10000", help="adaptive softmax cutoffs")
    p.add_argument("--lr", default="2e-3")
    p.add_argument("--source", type=Path, default=ROOT.parent / "shared/data/wikitext103-eval")
    p.add_argument("--out", type=Path, default=ROOT / "results/stateful_lm.jsonl")
    p.add_argument("--work", type=Path, default=ROOT / "work/stateful_lm_study")
    p.add_argument("--report", action="store_true", help="print the recorded results and stop")
    a = p.parse_args(argv)
    if a.report:
        report(load(a.out))
        return
    a.work.mkdir(parents=True, exist_ok=True)
    data = prepare(a.work, a.source)
    for seed in a.seeds:
        for variant in a.variants:
            key = (variant, seed, a.updates, a.block)
            if key in {(r["variant"], r["seed"], r["updates"], r["block"]) for r in load(a.out)}:
                print(f"[stateful_lm] {variant} seed {seed}: recorded, skipped", flush=True)
                continue
            print(f"[stateful_lm] {variant} seed {seed}: running", flush=True)
            record = one_run(variant, seed, a, data)
            with open(a.out, "a") as f:
                f.write(json.dumps(record) + "\n")
            print(f"[stateful_lm] {json.dumps(record)}", flush=True)


if __name__ == "__main__":
    main()
