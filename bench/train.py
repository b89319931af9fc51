#!/usr/bin/env python
"""Training cost (forward + backward) and peak memory: softmax against RFA, side by side.

``lm``: the LM decoder stack (``transformer_lm`` dimensions, 6 x 512), a step being
``decoder.extract_features(tokens)``, ``(features * R).sum().backward()`` with a fixed random R
(no vocabulary projection: the same for all, it would hide the attention), ``--tokens-per-batch``
tokens per step at every length. Variants: ``softmax`` (fairseq's MultiheadAttention), ``sdpa``
(the same projections through torch's ``scaled_dot_product_attention``, no T x T mask), ``rfa``,
``rfa_gate`` and their ``*_recompute`` forms (``--rfa-recompute``).
``translation``: real batches of a binarised corpus (``--max-tokens``), label-smoothed cross
entropy forward + backward, softmax against RFA and RFA-Gate translation models, the variants
taking turns step by step. ``encoder``: one encoder self-attention module (512 dims, 8 heads) on
one source of T tokens: softmax, sdpa, rfa, favor, lara. ``chunk``: ``ops.chunk_causal_rfa``
alone by chunk size (how ``--rfa-chunk-size`` was chosen), forward + backward (``train``) or the
forward with its final state (``infer``).

Per row: ``--statistic`` seconds of ``--repeats`` steps after one warm-up step, whose peak memory
above the start is recorded (bench/harness.py); tokens/s and its ``ratio`` to softmax in the same
run (and ``ratio_sdpa``; > 1 is faster). A length predicted to take over ``--max-seconds``, or
that ran out of memory at a shorter length, is skipped and recorded.

    python bench/train.py lm --lengths 256 1024 8192 --out train_lm.json
    python bench/train.py translation DATA_BIN --out train_translation.json
    python bench/train.py encoder --lengths 1024 4096 --out encoder.json
    python bench/train.py chunk --chunk-sizes 32 64 128 --lengths 512 2048 --out chunk.json
"""
import argparse
import gc
import math
import os
import sys
import tempfile

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402

LM = {"softmax": ["--arch", "transformer_lm"], "sdpa": ["--arch", "transformer_lm"],
      "rfa": ["--arch", "rfa_transformer_lm"], "rfa_gate": ["--arch", "rfa_transformer_lm", "--rfa-gate"],
      "rfa_recompute": ["--arch", "rfa_transformer_lm", "--rfa-recompute"],
      "rfa_gate_recompute": ["--arch", "rfa_transformer_lm", "--rfa-gate", "--rfa-recompute"]}
MT = {"softmax": ["--arch", "transformer_iwslt_de_en"],
      "rfa": ["--arch", "rfa_transformer_iwslt_de_en", "--cross-attention", "rfa"],
      "rfa_gate": ["--arch", "rfa_transformer_iwslt_de_en", "--cross-attention", "rfa", "--rfa-gate"],
      "rfa_gate_softcross": ["--arch", "rfa_transformer_iwslt_de_en", "--rfa-gate"]}
ENCODER = ("softmax", "sdpa", "rfa", "favor", "lara")
QUADRATIC = ("softmax", "sdpa")
DTYPES = {"float32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
# mode: (variants, default variants, full settings, --tiny settings)
SETTINGS = {
    "lm": (LM, list(LM)[:4], dict(lengths=[256, 512, 1024, 4096, 8192], tokens_per_batch=8192, layers=6, embed_dim=512,
                                  heads=8, ffn_dim=2048, vocab=32000),
           dict(lengths=[32, 64], tokens_per_batch=256, layers=2, embed_dim=64, heads=4, ffn_dim=128, vocab=100)),
    "translation": (MT, list(MT)[:3], dict(layers=2, embed_dim=256, heads=4, ffn_dim=512),
                    dict(layers=1, embed_dim=32, heads=4, ffn_dim=64)),
    "encoder": (ENCODER, list(ENCODER), dict(lengths=[512, 1024, 2048, 4096, 8192, 16384], embed_dim=512, heads=8,
                                             feature_dim=64, landmarks=16),
                dict(lengths=[64, 128], embed_dim=32, heads=4, feature_dim=8, landmarks=4)),
    "chunk": ((), [], dict(chunk_sizes=[16, 32, 64, 128, 256], lengths=[512, 2048, 8192], tokens_per_batch=8192,
                           heads=8, feature_dim=64, head_dim=64),
              dict(chunk_sizes=[8, 16, 32], lengths=[64, 128], tokens_per_batch=256, heads=2, feature_dim=8, head_dim=8)),
}


class SDPAAttention(nn.Module):
    """A fairseq MultiheadAttention's q/k/v/out projections through ``F.scaled_dot_product_attention``
    (Time x Batch x Channel), causal or not: the exact-softmax baseline of lm and encoder. Training
    only: no padding mask, no incremental state, no attention weights."""

    def __init__(self, mha, causal):
        super().__init__()
        self.causal, self.heads = causal, mha.num_heads
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = mha.q_proj, mha.k_proj, mha.v_proj, mha.out_proj

    def forward(self, query, key=None, value=None, key_padding_mask=None, incremental_state=None, attn_mask=None, **_):
        if key_padding_mask is not None or incremental_state is not None or attn_mask is not None:
            raise NotImplementedError("SDPAAttention: no padding, no incremental state, no mask")
        T, B, C = query.shape

        def heads(x):  # [T, B, C] -> [B, H, T, K]
            return x.view(T, B, self.heads, C // self.heads).permute(1, 2, 0, 3)

        o = F.scaled_dot_product_attention(heads(self.q_proj(query)), heads(self.k_proj(query)),
                                           heads(self.v_proj(query)), is_causal=self.causal)
        return self.out_proj(o.permute(2, 0, 1, 3).reshape(T, B, C)), None

    def _get_input_buffer(self, incremental_state):  # fairseq's decoder layer asks for it
        return {}


def build(args, variant, extra):
    """A fairseq model of ``variant`` (random weights, seed 0, dropout 0 unless ``extra`` says) and its task."""
    from fairseq import options, tasks

    parsed = options.parse_args_and_arch(options.get_training_parser(), extra + ["--user-dir", harness.user_dir()])
    torch.manual_seed(0)
    task = tasks.setup_task(parsed)
    model = task.build_model(parsed).to(args.device).train()
    if variant == "sdpa":
        for layer in model.decoder.layers:
            layer.self_attn = SDPAAttention(layer.self_attn, causal=True)
        model.decoder.buffered_future_mask = lambda tensor: None
    return model, task, parsed


def build_lm(args, variant, max_len):
    if not hasattr(args, "data"):
        args.data = harness.fake_dictionary(tempfile.mkdtemp(prefix="rfa_bench_"), args.vocab, names=("dict.txt",))
    dims = ["--decoder-layers", args.layers, "--decoder-embed-dim", args.embed_dim, "--decoder-input-dim", args.embed_dim,
            "--decoder-output-dim", args.embed_dim, "--decoder-attention-heads", args.heads,
            "--decoder-ffn-embed-dim", args.ffn_dim, "--tokens-per-sample", max_len, "--max-target-positions", max_len]
    return build(args, variant, [args.data, "--task", "language_modeling", "--dropout", "0"] + LM[variant] + [str(d) for d in dims])


def lm_step(args, variant, length):
    model, task, _ = build_lm(args, variant, max(args.lengths))
    d, g = task.source_dictionary, torch.Generator().manual_seed(length)
    batch = max(1, args.tokens_per_batch // length)
    tokens = torch.randint(d.nspecial, len(d), (batch, length), generator=g).to(args.device)
    target = torch.randn(batch, length, args.embed_dim, generator=g).to(args.device)

    def step():
        model.zero_grad(set_to_none=True)
        with torch.autocast(args.device, dtype=DTYPES[args.dtype], enabled=DTYPES[args.dtype] is not None):
            features = model.decoder.extract_features(tokens, None)[0]
        (features.float() * target).sum().backward()
    return step, model, batch * length, dict(batch=batch)


def encoder_module(args, variant):
    from rfa_fairseq.modules.encoder_attention import build_encoder_self_attention

    torch.manual_seed(0)
    module = build_encoder_self_attention("softmax" if variant == "sdpa" else variant, args.embed_dim, args.heads,
                                          feature_dim=args.feature_dim, landmarks=args.landmarks)
    return (SDPAAttention(module, causal=False) if variant == "sdpa" else module).to(args.device).train()


def encoder_step(args, variant, length):
    if variant == "softmax" and 16 * args.heads * length ** 2 > args.max_memory_gb * 2**30:
        return f"its attention matrices (4 fp32 copies per head) would need {16 * args.heads * length ** 2 / 2**30:.0f} GiB"
    module, g = encoder_module(args, variant), torch.Generator().manual_seed(length)
    x = torch.randn(length, 1, args.embed_dim, generator=g).to(args.device).requires_grad_()
    r = torch.randn(length, 1, args.embed_dim, generator=g).to(args.device)

    def step():
        x.grad = None
        module.zero_grad(set_to_none=True)
        (module(x, x, x)[0] * r).sum().backward()
    return step, module, length, {}


def by_length(args, make_step, power):
    """Every variant at every length (taking turns at each length); ``make_step`` returns
    (step, model, tokens, extra fields) or the reason to skip."""
    rows, last, failed = [], {}, {}
    for length in args.lengths:
        for variant in args.variants:
            row = dict(model=variant, length=length)
            rows.append(row)
            if variant in failed:
                row["skipped"] = f"out of memory at length {failed[variant]}"
            elif variant in last:
                guess = last[variant][1] * (length / last[variant][0]) ** power[variant in QUADRATIC] * (args.repeats + 1)
                if guess > args.max_seconds:
                    row["skipped"] = f"predicted {guess:.0f} s > --max-seconds {args.max_seconds:g}"
            made = None if "skipped" in row else make_step(args, variant, length)
            if isinstance(made, str):
                row["skipped"] = made
            if "skipped" in row:
                print(f"{variant:18s} {length:6d}: skipped, {row['skipped']}", flush=True)
                continue
            step, model, tokens, extra = made
            try:
                row.update(extra, tokens=tokens, **harness.measure(step, args.device, args.repeats, args.clock,
                                                                   args.statistic, watch=[model]))
            except (RuntimeError, MemoryError) as e:
                if not harness.is_oom(e):
                    raise
                row["error"], failed[variant] = "out of memory", length
            del step, model, made
            gc.collect()
            if "seconds" in row:
                row["tokens_per_s"] = tokens / row["seconds"]
                last[variant] = (length, row["seconds"])
            print(f"{variant:18s} {length:6d}: {row.get('seconds', float('nan')):9.4f} s/step, "
                  f"peak {(row.get('peak_bytes') or 0) / 2**20:9.1f} MiB {row.get('error', '')}", flush=True)
    return rows


def translation(args):
    flags = [args.data, "--task", "translation", "--share-all-embeddings", "--dropout", "0.1", "--seed", "1",
             "--criterion", "label_smoothed_cross_entropy", "--label-smoothing", "0.1", "--max-tokens", str(args.max_tokens)]
    for side in ("encoder", "decoder"):
        flags += [f"--{side}-layers", str(args.layers), f"--{side}-embed-dim", str(args.embed_dim),
                  f"--{side}-ffn-embed-dim", str(args.ffn_dim), f"--{side}-attention-heads", str(args.heads)]
    built = {v: build(args, v, flags + MT[v]) for v in args.variants}
    model, task, parsed = built[args.variants[0]]
    task.load_dataset("train")
    itr = task.get_batch_iterator(task.dataset("train"), max_tokens=args.max_tokens, seed=1,
                                  max_positions=(1024, 1024)).next_epoch_itr(shuffle=True)
    samples = [to_device(next(itr), args.device) for _ in range(min(args.batches, len(itr)))]
    criteria = {v: task.build_criterion(p) for v, (_, _, p) in built.items()}
    rows = {v: dict(model=v, times=[]) for v in args.variants}
    for i in range(args.repeats + 1):  # the variants take turns step by step; the first step warms up
        for v, (model, _, _) in built.items():
            def step():
                model.zero_grad(set_to_none=True)
                criteria[v](model, samples[i % len(samples)])[0].backward()
            if i == 0:
                with harness.PeakMemory(args.device, watch=[model]) as mem:
                    step()
                rows[v]["peak_bytes"] = mem.peak_bytes
            else:
                rows[v]["times"] += harness.timed(step, args.device, clock=args.clock)
    tokens = sum(s["ntokens"] for s in samples) / len(samples)
    for r in rows.values():
        r.update(seconds=harness.STATISTICS[args.statistic](r["times"]), tokens=tokens)
        r["tokens_per_s"] = tokens / r["seconds"]
    return list(rows.values())


def to_device(sample, device):
    from fairseq import utils

    return utils.move_to_cuda(sample) if device == "cuda" else sample


def chunk(args):
    from rfa_fairseq.ops import chunk_causal_rfa

    rows = []
    for mode in args.passes:
        for gated in (False, True):
            for length in args.lengths:
                B, H, D, K = max(1, args.tokens_per_batch // length), args.heads, args.feature_dim, args.head_dim
                g = torch.Generator().manual_seed(0)
                q, k = [torch.cat([a.sin(), a.cos()], -1) / math.sqrt(D)
                        for a in (2 * torch.randn(B, H, length, D, generator=g) for _ in range(2))]
                v, grad = torch.randn(B, H, length, K, generator=g), torch.randn(B, H, length, K, generator=g)
                log_g = F.logsigmoid(torch.randn(B, H, length, generator=g) + 2) if gated else None
                inputs = [x.to(args.device).requires_grad_(mode == "train") for x in (q, k, v, log_g) if x is not None]
                grad = grad.to(args.device)
                for size in args.chunk_sizes:
                    def step():
                        if mode == "train":
                            chunk_causal_rfa(*inputs[:3], inputs[3] if gated else None, chunk_size=size).backward(grad)
                        else:
                            with torch.inference_mode():
                                chunk_causal_rfa(*inputs[:3], inputs[3] if gated else None, chunk_size=size, return_state=True)
                    rows.append({"model": f"C={size}", "pass": mode, "gated": gated, "length": length, "batch": B,
                                 "chunk_size": size, **harness.measure(step, args.device, args.repeats, args.clock,
                                                                       args.statistic)})
                    for x in inputs:
                        x.grad = None
                print(f"{mode:5s} gated={gated!s:5s} {length:6d}: " + " ".join(
                    f"C={r['chunk_size']} {1e3 * r['seconds']:.2f} ms" for r in rows[-len(args.chunk_sizes):]), flush=True)
    return rows


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    modes = p.add_subparsers(dest="mode", required=True)
    subs = {m: modes.add_parser(m, help=h) for m, h in (
        ("lm", "LM decoder stack by length"), ("translation", "real batches of a binarised corpus"),
        ("encoder", "one encoder self-attention module by source length"), ("chunk", "chunk size of chunk_causal_rfa"))}
    subs["translation"].add_argument("data", help="binarised translation data (a fairseq-preprocess destdir)")
    for mode, sub in subs.items():
        variants, default, full, tiny = SETTINGS[mode]
        if variants:
            sub.add_argument("--variants", nargs="+", choices=list(variants), default=default)
        for name in full:
            many = name in ("lengths", "chunk_sizes")
            sub.add_argument("--" + name.replace("_", "-"), type=harness.positive, nargs="+" if many else None,
                             help=f"default {full[name]} (--tiny: {tiny[name]})")
        harness.common_flags(sub, repeats=3)
        sub.add_argument("--tiny", action="store_true", help="small sizes (for tests)")
        if mode != "translation":
            sub.add_argument("--max-seconds", type=float, default=600.0, help="skip a length predicted to take longer")
    subs["lm"].add_argument("--dtype", choices=list(DTYPES), default="float32", help="bf16/fp16: torch.autocast (CUDA)")
    subs["translation"].add_argument("--max-tokens", type=harness.positive, default=4000)
    subs["translation"].add_argument("--batches", type=harness.positive, default=4, help="distinct batches, in turn")
    subs["encoder"].add_argument("--max-memory-gb", type=float, default=10.0,
                                 help="skip softmax where its attention matrices would need more")
    subs["chunk"].add_argument("--passes", nargs="+", choices=["train", "infer"], default=["train", "infer"])
    args = p.parse_args(argv)
    sub = subs[args.mode]
    harness.setup(sub, args)
    for name, value in SETTINGS[args.mode][3 if args.tiny else 2].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if hasattr(args, "embed_dim") and args.embed_dim % args.heads:
        sub.error(f"--embed-dim {args.embed_dim} is not divisible by --heads {args.heads}")
    if getattr(args, "dtype", "float32") != "float32" and args.device != "cuda":
        sub.error(f"--dtype {args.dtype} (torch.autocast) is measured on CUDA only")
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.mode == "lm":
        rows = by_length(args, lm_step, power=(0, 1))  # tokens per step fixed: softmax's step grows linearly
    elif args.mode == "encoder":
        rows = by_length(args, encoder_step, power=(1, 2))
    else:
        rows = translation(args) if args.mode == "translation" else chunk(args)
    reference = "softmax" if any(r["model"] == "softmax" for r in rows) else rows[0]["model"]
    if args.mode != "chunk":
        harness.add_ratios(rows, reference, group=("length",) if args.mode != "translation" else ())
        harness.add_ratios(rows, "sdpa", field="ratio_sdpa")
    meta = dict(harness.machine(args.device), bench=f"train-{args.mode}", reference=reference, args=vars(args))
    if args.out:
        harness.write_json(args.out, meta, rows)
    return rows


if __name__ == "__main__":
    main()
