#!/usr/bin/env python
"""Chunk size of the chunked causal RFA op: time per call by chunk size, length, gate and mode.

``rfa_fairseq.ops.chunk_causal_rfa(q, k, v, log_g, chunk_size=C)`` with the shapes of one layer
of a transformer-base sized model: batch = max(1, --tokens-per-batch // T) (default 8192 tokens),
H = 8 heads, F = 128 features (64 random features, sin/cos), K = 64 per head, fp32. q and k are
sin/cos random features (rows of norm 1), v is gaussian, log g = logsigmoid(gaussian).

Modes:
- ``train``: forward + backward (inputs require grad; ``out.backward(fixed random grad)``), the
  training call (``output_final_state=False``);
- ``infer``: forward only under ``torch.inference_mode`` with ``output_final_state=True``: the
  prefix / multi-token incremental call.

Prints, per (mode, gated, length), milliseconds per call (median over --repeats after one
warm-up call) for each chunk size and the best chunk size; writes JSON with --out (each row also
has the peak memory of its measurement, bench.common.PeakMemory).

    python bench/chunk_size.py --chunk-sizes 16 32 64 128 256 --lengths 512 2048 8192 --repeats 3 --out bench/chunk_size.json
    python bench/chunk_size.py --tiny      # seconds: small shapes, lengths 64 128

Measure on a quiet machine: the best chunk size depends on the device (and on its load).
"""
import argparse
import gc
import math
import os
import sys
from typing import Dict, List

import torch
import torch.nn.functional as F

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from bench.common import PeakMemory, machine_info, median, timed, write_json  # noqa: E402

FULL = dict(chunk_sizes=[16, 32, 64, 128, 256], lengths=[512, 2048, 8192], tokens_per_batch=8192,
            heads=8, random_features=64, head_dim=64)
TINY = dict(chunk_sizes=[8, 16, 32, 64], lengths=[64, 128], tokens_per_batch=256,
            heads=2, random_features=8, head_dim=8)
MODES = ("train", "infer")
GATING = ("ungated", "gated")


def make_inputs(batch, heads, length, random_features, head_dim, gated, requires_grad, device, seed=0):
    """q, k: sin/cos random features ``[B, H, T, 2D]`` (norm 1); v ``[B, H, T, K]``; log g ``[B, H, T]``."""
    gen = torch.Generator().manual_seed(seed)

    def features():
        angles = torch.randn(batch, heads, length, random_features, generator=gen) * 2.0
        return torch.cat([angles.sin(), angles.cos()], dim=-1) / math.sqrt(random_features)

    q, k = features(), features()
    v = torch.randn(batch, heads, length, head_dim, generator=gen)
    log_g = F.logsigmoid(torch.randn(batch, heads, length, generator=gen) + 2.0) if gated else None
    grad_out = torch.randn(batch, heads, length, head_dim, generator=gen)
    inputs = [q, k, v, log_g]
    inputs = [None if x is None else x.to(device).requires_grad_(requires_grad) for x in inputs]
    return inputs, grad_out.to(device)


def measure(op, inputs, grad_out, chunk_size, mode, device, repeats):
    q, k, v, log_g = inputs
    leaves = [x for x in inputs if x is not None]

    if mode == "train":
        def call():
            for x in leaves:
                x.grad = None
            op(q, k, v, log_g, chunk_size=chunk_size).backward(grad_out)
    else:
        def call():
            with torch.inference_mode():
                op(q, k, v, log_g, output_final_state=True, chunk_size=chunk_size)

    gc.collect()
    with PeakMemory(device) as mem:
        times = timed(call, device, repeats, warmup=1)
    for x in leaves:
        x.grad = None
    return times, mem.peak_bytes


def run(args) -> List[Dict]:
    from rfa_fairseq.ops import chunk_causal_rfa

    rows: List[Dict] = []
    width = max(8, max(len(str(c)) for c in args.chunk_sizes) + 2)
    header = f"{'mode':5s} {'gate':7s} {'length':>6s} {'batch':>5s} " + "".join(
        f"{'C=' + str(c):>{width}s}" for c in args.chunk_sizes) + f" {'best':>6s}"
    print("milliseconds per call:", flush=True)
    print(header, flush=True)
    for mode in args.modes:
        for gating in args.gating:
            for length in args.lengths:
                batch = max(1, args.tokens_per_batch // length)
                inputs, grad_out = make_inputs(batch, args.heads, length, args.random_features, args.head_dim,
                                               gating == "gated", mode == "train", args.device, seed=args.seed)
                line = []
                for chunk in args.chunk_sizes:
                    times, peak = measure(chunk_causal_rfa, inputs, grad_out, chunk, mode, args.device, args.repeats)
                    row = {"mode": mode, "gated": gating == "gated", "length": length, "batch": batch,
                           "chunk_size": chunk, "effective_chunk_size": min(chunk, length),
                           "ms": 1e3 * median(times), "times": times, "peak_bytes": peak}
                    rows.append(row)
                    line.append(row)
                best = min(line, key=lambda r: r["ms"])
                for r in line:
                    r["best_chunk_size"] = best["chunk_size"]
                    r["relative_to_best"] = r["ms"] / best["ms"]
                print(f"{mode:5s} {gating:7s} {length:6d} {batch:5d} " + "".join(
                    f"{r['ms']:{width}.2f}" for r in line) + f" {best['chunk_size']:6d}", flush=True)
                del inputs, grad_out
    print("\nbest chunk size (ms per call; x = time relative to the default chunk size 64 where measured):")
    for mode in args.modes:
        for gating in args.gating:
            for length in args.lengths:
                line = [r for r in rows if r["mode"] == mode and r["gated"] == (gating == "gated")
                        and r["length"] == length]
                best = min(line, key=lambda r: r["ms"])
                at64 = [r for r in line if r["chunk_size"] == 64]
                rel = f" ({best['ms'] / at64[0]['ms']:.2f}x of C=64)" if at64 else ""
                print(f"  {mode:5s} {gating:7s} T={length:<6d} C={best['chunk_size']:<4d} {best['ms']:9.2f} ms{rel}")
    return rows


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--chunk-sizes", type=int, nargs="+", help=f"default {FULL['chunk_sizes']}")
    p.add_argument("--lengths", type=int, nargs="+", help=f"default {FULL['lengths']}")
    p.add_argument("--tokens-per-batch", type=int, help=f"batch = max(1, this // length); default {FULL['tokens_per_batch']}")
    p.add_argument("--heads", type=int, help=f"H (default {FULL['heads']})")
    p.add_argument("--random-features", type=int, help=f"D; F = 2D sin/cos features (default {FULL['random_features']})")
    p.add_argument("--head-dim", type=int, help=f"K (default {FULL['head_dim']})")
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES),
                   help="train: forward + backward; infer: forward only (inference mode, final state)")
    p.add_argument("--gating", nargs="+", choices=GATING, default=list(GATING))
    p.add_argument("--repeats", type=int, default=3, help="timed calls (median) after one warm-up call")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--threads", type=int, help="torch intra-op threads (CPU)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tiny", action="store_true",
                   help=f"small shapes for tests: {TINY}")
    p.add_argument("--out", help="JSON output path")
    args = p.parse_args(argv)
    profile = TINY if args.tiny else FULL
    for name, value in profile.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: CUDA is not available")
    if min(args.chunk_sizes + args.lengths) < 1 or args.repeats < 1 or args.tokens_per_batch < 1:
        p.error("--chunk-sizes, --lengths, --repeats and --tokens-per-batch must be positive")
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"device {args.device}, fp32, H={args.heads}, F={2 * args.random_features} "
          f"({args.random_features} random features, sin/cos), K={args.head_dim}, "
          f"{args.tokens_per_batch} tokens per call, threads {torch.get_num_threads()}", flush=True)
    rows = run(args)
    if args.out:
        write_json(args.out, dict(machine_info(args.device), args=vars(args), op="rfa_fairseq.ops.chunk_causal_rfa"),
                   rows)
    return rows


if __name__ == "__main__":
    main()
