#!/usr/bin/env python
"""Training step cost at sentence lengths: softmax against RFA and RFA-Gate translation models on
real batches, with the operators that take the time.

Builds each model as fairseq-train does (``--arch`` plus the sizes below, dropout 0.1, label
smoothing 0.1), takes the first ``--batches`` batches of ``--max-tokens`` from the binarised
training split, and times forward + backward of the criterion (no optimizer step: it costs the
same for every variant). Variants take turns step by step, so a busy machine slows them alike.
Prints the median seconds per step, the ratio to softmax, and for one more step of each variant
the torch profiler's operators by self CPU time.

    python bench/train_sentences.py work/study/data/bin --layers 2 --dim 256 --ffn 512
    python bench/train_sentences.py DATA_BIN --variants softmax rfa_gate --steps 5 --json out.json
"""
import argparse
import json
import os
import statistics
import sys
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from bench.common import USER_DIR, machine_info  # noqa: E402

VARIANTS = {
    "softmax": ["--arch", "transformer_iwslt_de_en"],
    "rfa": ["--arch", "rfa_transformer_iwslt_de_en", "--cross-attention", "rfa"],
    "rfa_gate": ["--arch", "rfa_transformer_iwslt_de_en", "--cross-attention", "rfa", "--rfa-gate"],
    # the plugin's default translation model: RFA-Gate self-attention, fairseq's cross attention
    "rfa_gate_softcross": ["--arch", "rfa_transformer_iwslt_de_en", "--rfa-gate"],
}


def build(data, variant, a):
    from fairseq import options, tasks

    sizes = []
    for side in ("encoder", "decoder"):
        sizes += [f"--{side}-layers", a.layers, f"--{side}-embed-dim", a.dim, f"--{side}-ffn-embed-dim", a.ffn,
                  f"--{side}-attention-heads", a.heads]
    words = [data, "--user-dir", USER_DIR, *VARIANTS[variant], "--share-all-embeddings", *map(str, sizes),
             "--dropout", "0.1", "--criterion", "label_smoothed_cross_entropy", "--label-smoothing", "0.1",
             "--max-tokens", str(a.max_tokens), "--cpu", "--seed", "1"]
    args = options.parse_args_and_arch(options.get_training_parser(), input_args=words)
    torch.manual_seed(1)
    task = tasks.setup_task(args)
    return task, task.build_model(args).train(), task.build_criterion(args), args


def batches(task, args, n):
    task.load_dataset("train")
    itr = task.get_batch_iterator(task.dataset("train"), max_tokens=args.max_tokens, seed=1,
                                  max_positions=(1024, 1024)).next_epoch_itr(shuffle=True)
    return [next(itr) for _ in range(n)]


def step(model, criterion, sample):
    model.zero_grad(set_to_none=True)
    loss, _, _ = criterion(model, sample)
    loss.backward()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("data", help="binarised translation data (a fairseq-preprocess destdir)")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--ffn", type=int, default=512)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=4000)
    p.add_argument("--batches", type=int, default=4, help="distinct batches, used in turn")
    p.add_argument("--steps", type=int, default=8, help="timed steps per variant (after one warm-up step)")
    p.add_argument("--top", type=int, default=12, help="profiler operators to print per variant")
    p.add_argument("--json", help="write the results here")
    a = p.parse_args(argv)
    built = {v: build(a.data, v, a) for v in a.variants}
    task, _, _, args = built[a.variants[0]]
    samples = batches(task, args, a.batches)
    times = {v: [] for v in a.variants}
    for i in range(a.steps + 1):
        for v, (_, model, criterion, _) in built.items():
            t = time.perf_counter()
            step(model, criterion, samples[i % len(samples)])
            if i:  # the first step of each variant is a warm-up
                times[v].append(time.perf_counter() - t)
    med = {v: statistics.median(ts) for v, ts in times.items()}
    tokens = sum(s["ntokens"] for s in samples) / len(samples)
    print(f"{machine_info('cpu')['device']}, {torch.get_num_threads()} threads; {a.layers}+{a.layers} layers x "
          f"{a.dim}, FFN {a.ffn}; batches of {tokens:.0f} target tokens")
    base = med.get("softmax")
    for v in a.variants:
        ratio = f"  x softmax {med[v] / base:.2f}" if base else ""
        print(f"{v:10s} {med[v]:.3f} s/step{ratio}")
    profiles = {}
    for v, (_, model, criterion, _) in built.items():
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            step(model, criterion, samples[0])
        rows = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
        total = sum(e.self_cpu_time_total for e in rows)
        profiles[v] = [(e.key, e.self_cpu_time_total / 1e3, e.count) for e in rows[: a.top]]
        print(f"\n{v}: {total / 1e3:.0f} ms profiled; operators by self CPU time")
        for key, ms, count in profiles[v]:
            print(f"  {key:42s} {ms:8.1f} ms {100 * ms * 1e3 / total:5.1f}%  x{count}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"machine": machine_info("cpu"), "args": vars(a), "tokens_per_batch": tokens,
                       "s_per_step": med, "profiles": profiles}, f, indent=1)


if __name__ == "__main__":
    main()
