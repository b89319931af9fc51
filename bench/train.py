#!/usr/bin/env python
"""Training cost (forward + backward) and peak memory, softmax against RFA side by side (docs/benchmarks.md). ``lm
--fla-unguard``: where fla-core refuses RFA-Gate's backward (Hopper, Triton 3.4 to 3.7.0), lift its guard for this run
if fla's gradients are within FLA_GRADIENT_RATIO of the torch path's, else drop rfa_gate_fla.

    python bench/train.py lm --lengths 256 1024 8192 --out train_lm.json     # also: translation DATA_BIN, encoder
"""
import argparse
import gc
import multiprocessing
import os
import sys

import torch
import torch.nn.functional as F
from torch import nn

from rfa_fairseq.config import RFAConfig
from rfa_fairseq.modules import build_encoder_self_attention
from rfa_fairseq.modules.heads import merge_heads, split_heads
from rfa_fairseq.ops import chunk_causal_rfa, feature_size, fla_causal_rfa, fla_installed, fla_refuses_gated_backward

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402
from report import mib  # noqa: E402

RFA, GATE = ["--arch", "rfa_transformer_lm"], ["--arch", "rfa_transformer_lm", "--rfa-gate"]
LM = {"softmax": ["--arch", "transformer_lm"], "sdpa": ["--arch", "transformer_lm"], "rfa": RFA, "rfa_gate": GATE,
      "rfa_recompute": RFA + ["--rfa-recompute"], "rfa_gate_recompute": GATE + ["--rfa-recompute"],
      **{f"rfa_gate_{b}": GATE + ["--rfa-backend", b] for b in ("torch", "fla")}}  # the kernels by name (rfa_gate: auto)
MT = {"softmax": ["--arch", "transformer_iwslt_de_en"], "rfa": ["--arch", "rfa_transformer_iwslt_de_en", "--cross-attention", "rfa"],
      "rfa_gate": ["--arch", "rfa_transformer_iwslt_de_en", "--cross-attention", "rfa", "--rfa-gate"],
      "rfa_gate_softcross": ["--arch", "rfa_transformer_iwslt_de_en", "--rfa-gate"]}
FLA_GRADIENT_RATIO = 0.02  # --fla-unguard: largest RMS(fla - torch) / RMS(torch) of a gradient, 5x bf16's 2^-8
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}  # lm --dtype: the model cast, as --bf16
ENCODER = ("softmax", "sdpa", "rfa", "favor", "lara")
SETTINGS = {  # mode: (variants, default variants, sizes, sizes with --tiny)
    "lm": (list(LM), list(LM)[:4], dict(lengths=[256, 512, 1024, 4096, 8192], tokens_per_batch=8192, layers=6,
                                        embed_dim=512, heads=8, ffn_dim=2048, vocab=32000),
           dict(lengths=[32, 64], tokens_per_batch=256, layers=2, embed_dim=64, heads=4, ffn_dim=128, vocab=100)),
    "translation": (list(MT), list(MT)[:3], dict(layers=2, embed_dim=256, heads=4, ffn_dim=512),
                    dict(layers=1, embed_dim=32, heads=4, ffn_dim=64)),
    "encoder": (list(ENCODER), list(ENCODER),
                dict(lengths=[512, 1024, 2048, 4096, 8192, 16384], embed_dim=512, heads=8, feature_dim=64, landmarks=16),
                dict(lengths=[64, 128], embed_dim=32, heads=4, feature_dim=8, landmarks=4)),
}


class SDPAAttention(nn.Module):
    """A MultiheadAttention's projections through ``F.scaled_dot_product_attention``: the baseline of lm and encoder."""

    def __init__(self, mha, causal):
        super().__init__()
        self.causal, self.heads = causal, mha.num_heads
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = mha.q_proj, mha.k_proj, mha.v_proj, mha.out_proj

    def forward(self, query, key=None, value=None, key_padding_mask=None, incremental_state=None, attn_mask=None, **_):
        if key_padding_mask is not None or incremental_state is not None or attn_mask is not None:
            raise NotImplementedError("SDPAAttention: no padding, no incremental state, no mask")
        q, k, v = (split_heads(proj(query), self.heads) for proj in (self.q_proj, self.k_proj, self.v_proj))
        return self.out_proj(merge_heads(F.scaled_dot_product_attention(q, k, v, is_causal=self.causal))), None

    def _get_input_buffer(self, incremental_state):  # fairseq's decoder layer asks for it
        return {}


def build_lm(args, variant, max_len):
    args.data = getattr(args, "data", None) or harness.fake_dictionary(args.vocab, names=("dict.txt",))
    sizes = dict(layers=args.layers, embed_dim=args.embed_dim, input_dim=args.embed_dim, output_dim=args.embed_dim,
                 attention_heads=args.heads, ffn_embed_dim=args.ffn_dim)
    model, task, parsed = harness.build_model([args.data, "--task", "language_modeling", "--dropout", "0", "--tokens-per-sample",
                                               str(max_len), "--max-target-positions", str(max_len)] + LM[variant] + [
        f for k, v in sizes.items() for f in ("--decoder-" + k.replace("_", "-"), str(v))])
    model.to(args.device, DTYPES[args.dtype]).train()
    if variant == "sdpa":
        for layer in model.decoder.layers:
            layer.self_attn = SDPAAttention(layer.self_attn, causal=True)
        model.decoder.buffered_future_mask = lambda tensor: None
    return model, task, parsed


def lm_step(args, variant, length):
    model, task, _ = build_lm(args, variant, max(args.lengths))
    d, g, batch = task.source_dictionary, torch.Generator().manual_seed(length), max(1, args.tokens_per_batch // length)
    tokens = torch.randint(d.nspecial, len(d), (batch, length), generator=g).to(args.device)
    target = torch.randn(batch, length, args.embed_dim, generator=g).to(args.device, DTYPES[args.dtype])

    def step():
        model.zero_grad(set_to_none=True)
        (model.decoder.extract_features(tokens, None)[0] * target).sum().backward()
    return step, model, dict(batch=batch, tokens=batch * length)


def fla_gradient_errors(args, length) -> dict:
    """RMS(fla - torch) / RMS(torch) of the gradients of phi(q), phi(k), v and log g through one causal RFA-Gate op at
    the lm benchmark's shapes: fla in ``--dtype``, ``chunk_causal_rfa`` in fp32 from the same rounded inputs."""
    cfg, g = RFAConfig(), torch.Generator().manual_seed(length)
    B, H, K = max(1, args.tokens_per_batch // length), args.heads, args.embed_dim // args.heads
    Fd = feature_size(cfg.rfa_kernel, cfg.rfa_causal_feature_dim, K)
    q, k = (torch.rand(2, B, H, length, Fd, generator=g) / Fd).unbind(0)  # positive: denominators away from 0
    inputs = (q, k, torch.randn(B, H, length, K, generator=g), F.logsigmoid(torch.randn(B, H, length, generator=g) + 2))
    r = torch.randn(B, H, length, K, generator=g).to(args.device)
    grads = []
    for op, dtype in ((fla_causal_rfa, DTYPES[args.dtype]), (chunk_causal_rfa, torch.float32)):
        xs = [x.to(args.device, DTYPES[args.dtype], copy=True).to(dtype).requires_grad_() for x in inputs]
        (op(*xs)[0].float() * r).sum().backward()
        grads.append([x.grad.float() for x in xs])
    return {name: ((a - b).square().mean().sqrt() / b.square().mean().sqrt()).item()
            for name, a, b in zip(("q", "k", "v", "log_g"), *grads)}


def encoder_module(args, variant):
    torch.manual_seed(0)
    module = build_encoder_self_attention("softmax" if variant == "sdpa" else variant, args.embed_dim, args.heads,
                                          feature_dim=args.feature_dim, landmarks=args.landmarks)
    return (SDPAAttention(module, causal=False) if variant == "sdpa" else module).to(args.device).train()


def encoder_step(args, variant, length):
    need = 16 * args.heads * length ** 2  # fairseq's softmax keeps 4 fp32 T x T tensors per head for backward
    if variant == "softmax" and need > args.max_memory_gb * 2**30:
        return f"its attention matrices would need about {need / 2**30:.0f} GiB (> --max-memory-gb)"
    module, g = encoder_module(args, variant), torch.Generator().manual_seed(length)
    x = torch.randn(length, 1, args.embed_dim, generator=g).to(args.device).requires_grad_()
    r = torch.randn(length, 1, args.embed_dim, generator=g).to(args.device)

    def step():
        x.grad = None
        module.zero_grad(set_to_none=True)
        (module(x, x, x)[0] * r).sum().backward()
    return step, module, dict(tokens=length)


def measure_variant(args, make_step, variant, length) -> dict:  # a row's fields
    try:
        made = make_step(args, variant, length)
        if isinstance(made, str):
            return {"skipped": made}
        step, model, fields = made
        if args.threads:  # a fresh process (--fresh-process) starts with torch's own thread count
            torch.set_num_threads(args.threads)
        return dict(fields, **harness.measure(step, args.device, args.repeats, args.clock, args.statistic, [model]))
    except Exception as e:
        return {"error": harness.failure(e)}


def by_length(args, make_step, power):
    """Each length, every variant; a step costs the last length's seconds x (length ratio) ** power[quadratic]."""
    rows, last, failed = [], {}, {}
    for length in args.lengths:
        for variant in args.variants:
            rows.append(row := dict(model=variant, length=length))
            guess = last[variant][1] * (length / last[variant][0]) ** power[variant in ("softmax", "sdpa")] \
                * (args.repeats + 1) if variant in last else 0
            if variant in failed or guess > args.max_seconds:
                row["skipped"] = failed.get(variant) or f"predicted {guess:.0f} s > --max-seconds {args.max_seconds:g}"
            elif args.fresh_process:
                with multiprocessing.get_context("spawn").Pool(1) as pool:
                    row.update(pool.apply(measure_variant, (args, make_step, variant, length)))
            else:
                row.update(measure_variant(args, make_step, variant, length))
                gc.collect()
            if "seconds" in row:
                row["tokens_per_s"], last[variant] = row["tokens"] / row["seconds"], (length, row["seconds"])
            if "error" in row and variant not in failed:
                failed[variant] = ("out of memory" if row["error"] == "out of memory" else "failed") + f" at length {length}"
            print(f"{variant:18s} {length:6d}: " + (f"skipped, {row['skipped']}" if "skipped" in row else
                  f"{row.get('seconds', float('nan')):9.4f} s/step, peak {mib(row.get('peak_bytes'))} "
                  f"MiB {row.get('error', '')}"), flush=True)
    return rows


def translation(args):
    from fairseq import utils
    flags = [args.data, "--task", "translation", "--share-all-embeddings", "--dropout", "0.1", "--seed", "1", "--criterion",
             "label_smoothed_cross_entropy", "--label-smoothing", "0.1", "--max-tokens", str(args.max_tokens)] + [
        x for side in ("encoder", "decoder") for k, v in (("layers", args.layers), ("embed-dim", args.embed_dim),
                                                          ("ffn-embed-dim", args.ffn_dim), ("attention-heads", args.heads))
        for x in (f"--{side}-{k}", str(v))]
    built = {v: harness.build_model(flags + MT[v]) for v in args.variants}
    for model, _, _ in built.values():
        model.to(args.device).train()
    (task := built[args.variants[0]][1]).load_dataset("train")
    itr = task.get_batch_iterator(task.dataset("train"), max_tokens=args.max_tokens, seed=1, max_positions=(1024, 1024)
                                  ).next_epoch_itr(shuffle=True)
    samples = [next(itr) for _ in range(min(args.batches, len(itr)))]
    samples = [utils.move_to_cuda(s) for s in samples] if args.device == "cuda" else samples
    rows, tokens = {v: dict(model=v, times=[]) for v in args.variants}, sum(s["ntokens"] for s in samples) / len(samples)
    for i in range(args.repeats):  # the variants take turns step by step
        for v, (model, task, parsed) in built.items():
            criterion = task.build_criterion(parsed)

            def step():
                model.zero_grad(set_to_none=True)
                criterion(model, samples[i % len(samples)])[0].backward()
            if i == 0:  # a warm-up step (peak memory), then a timed one
                rows[v].update(harness.measure(step, args.device, 1, args.clock, watch=[model]))
            else:
                rows[v]["times"] += harness.timed(step, args.device, clock=args.clock)
    for r in rows.values():
        r.update(seconds=harness.STATISTICS[args.statistic](r["times"]), tokens=tokens)
        r["tokens_per_s"] = tokens / r["seconds"]
    return list(rows.values())


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    modes = p.add_subparsers(dest="mode", required=True)
    for mode, (variants, default, full, tiny) in SETTINGS.items():
        sub = modes.add_parser(mode, help=f"the {mode} benchmark (see above)")
        if mode == "translation":
            sub.add_argument("data", help="binarised translation data (a fairseq-preprocess destdir)")
            sub.add_argument("--max-tokens", type=harness.positive, default=4000)
            sub.add_argument("--batches", type=harness.positive, default=4, help="distinct batches, used in turn")
        else:
            sub.add_argument("--max-seconds", type=float, default=600.0, help="skip a length predicted to take longer")
        if mode in ("lm", "encoder"):
            sub.add_argument("--fresh-process", action="store_true", help="each row in a process of its own (peak memory)")
        sub.add_argument("--variants", nargs="+", choices=variants, default=default)
        for name in full:
            sub.add_argument("--" + name.replace("_", "-"), type=harness.positive, nargs="+" if name == "lengths" else None,
                             help=f"default {full[name]} (--tiny: {tiny[name]})")
        harness.common_flags(sub, repeats=3)
        sub.add_argument("--tiny", action="store_true", help="small sizes (for tests)")
    modes.choices["encoder"].add_argument("--max-memory-gb", type=float, default=10.0, help="skip softmax above this")
    modes.choices["lm"].add_argument("--dtype", choices=sorted(DTYPES), default="fp32", help="the model's, as --bf16 / --fp16")
    modes.choices["lm"].add_argument("--fla-unguard", action="store_true", help="lift fla's Hopper guard after a gradient check")
    args = p.parse_args(argv)
    sub = modes.choices[args.mode]
    harness.setup(sub, args)
    for name, value in SETTINGS[args.mode][3 if args.tiny else 2].items():
        setattr(args, name, value if getattr(args, name) is None else getattr(args, name))
    if hasattr(args, "embed_dim") and args.embed_dim % args.heads:
        sub.error(f"--embed-dim {args.embed_dim} is not divisible by --heads {args.heads}")
    return args


def main(argv=None):
    args, fla_guard = parse_args(argv), {}
    if args.mode == "lm" and "rfa_gate_fla" in args.variants and fla_installed() and fla_refuses_gated_backward():
        if not args.fla_unguard:
            sys.exit("rfa_gate_fla: fla-core refuses RFA-Gate's backward on this stack (Hopper with Triton >= 3.4 and < 3.7.1, its "
                     "issue 640); upgrade Triton, or pass --fla-unguard to check fla's gradients here and lift the guard for this run")
        import fla.ops.common.chunk_o as chunk_o

        chunk_o.TRITON_ABOVE_3_7_1 = True  # the guard's own condition, read when a gated backward starts
        errors = {length: fla_gradient_errors(args, length) for length in args.lengths}
        worst = max(e for per in errors.values() for e in per.values())
        chunk_o.TRITON_ABOVE_3_7_1 = lifted = worst <= FLA_GRADIENT_RATIO
        print(f"--fla-unguard: fla's gradients against the torch path's, largest relative RMS error {worst:.2e} "
              f"({'<=' if lifted else '>'} {FLA_GRADIENT_RATIO}): " +
              ("the guard is lifted for this run" if lifted else "the guard stays, rfa_gate_fla is dropped"), flush=True)
        fla_guard = {"fla_guard": {"guard": "lifted" if lifted else "kept", "gradient_errors": errors}}
        args.variants = [v for v in args.variants if lifted or v != "rfa_gate_fla"]
    if args.mode in ("lm", "encoder"):  # lm: tokens per step fixed, so softmax's step grows linearly with length
        rows = by_length(args, lm_step if args.mode == "lm" else encoder_step, (0, 1) if args.mode == "lm" else (1, 2))
    else:
        rows = translation(args)
    reference = "softmax" if any(r["model"] == "softmax" for r in rows) else rows[0]["model"]
    harness.add_ratios(rows, reference, group=("length",) if args.mode != "translation" else ())
    harness.add_ratios(rows, "sdpa", field="ratio_sdpa")
    return harness.save(args, argv, f"train-{args.mode}", rows, reference=reference, args=vars(args), **fla_guard)


if __name__ == "__main__":
    sys.exit(harness.exit_status(main()))
