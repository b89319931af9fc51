#!/usr/bin/env python
"""Training cost of the LM decoder stack: softmax (fairseq), softmax (SDPA, causal), RFA, RFA-Gate.

One training step is ``model.decoder.extract_features(tokens)`` -> features ``[B, T, C]``,
``loss = (features.float() * R).sum()`` with a fixed random ``R``, ``loss.backward()`` (gradients
set to None before each step, as an optimizer's ``zero_grad`` does). The vocabulary projection
is left out: it costs the same for every variant and would hide the attention. Every length
trains on the same number of tokens: batch = max(1, --tokens-per-batch // length).

Variants (same dimensions, passed explicitly as --decoder-* flags to every one; dropout 0;
random weights; a fake dictionary of --vocab entries):

- ``softmax``: fairseq's ``transformer_lm``. In training its MultiheadAttention calls torch's
  ``F.multi_head_attention_forward`` with the decoder's float T x T future mask.
- ``sdpa``: the same model, each layer's ``self_attn`` replaced by :class:`SDPASelfAttention`,
  which reuses the layer's q/k/v/out projections and calls
  ``F.scaled_dot_product_attention(q, k, v, is_causal=True)``; the decoder's
  ``buffered_future_mask`` returns None, so no T x T mask is built. ``--check`` verifies that
  its output equals ``softmax``'s for the same weights (:func:`check_sdpa_matches_fairseq`).
- ``rfa``: ``rfa_transformer_lm`` (chunked causal RFA); ``rfa_gate``: the same with --rfa-gate;
  ``rfa_recompute``, ``rfa_gate_recompute``: the same with --rfa-recompute (not run by default).

Reported per (variant, length): median seconds per step over --repeats (after one warm-up
step), tokens/s, the tokens/s ratio to softmax and to sdpa (same run; > 1 means faster), and
the peak memory of the measurement (bench.common.PeakMemory: CUDA max_memory_allocated above
the baseline; CPU the RSS high-water mark above the resident set at the start). Out of memory
is recorded per (variant, length) as ``"error": "out of memory"`` (longer lengths of that
variant are then skipped). A (variant, length) whose predicted time (the previous measured
length's seconds per step x (warm-up + repeats), scaled by the length ratio squared for
softmax/sdpa and linearly for RFA) exceeds --max-seconds is skipped and recorded as such.

    python bench/train_speed.py --lengths 256 512 1024 4096 8192 --repeats 3 --out bench/train_speed.json
    python bench/train_speed.py --tiny            # seconds: 2 layers, 64 dims, lengths 32 64
    python bench/train_speed.py --check-only      # only the sdpa == fairseq softmax check

Measure on a quiet machine: the ratios come from one run, the absolute numbers hold only there.
"""
import argparse
import atexit
import ctypes
import gc
import os
import shutil
import sys
import tempfile
from typing import Dict, List, Optional

import torch
import torch.nn.functional as F
from torch import nn

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from bench.common import PeakMemory, USER_DIR, fake_dictionary, machine_info, median, timed, write_json  # noqa: E402

VARIANTS = ("softmax", "sdpa", "rfa", "rfa_gate", "rfa_recompute", "rfa_gate_recompute")
DEFAULT_VARIANTS = VARIANTS[:4]
ARCH = {
    "softmax": ["--arch", "transformer_lm"],
    "sdpa": ["--arch", "transformer_lm"],
    "rfa": ["--arch", "rfa_transformer_lm"],
    "rfa_gate": ["--arch", "rfa_transformer_lm", "--rfa-gate"],
    "rfa_recompute": ["--arch", "rfa_transformer_lm", "--rfa-recompute"],
    "rfa_gate_recompute": ["--arch", "rfa_transformer_lm", "--rfa-gate", "--rfa-recompute"],
}
QUADRATIC = ("softmax", "sdpa")

# fairseq's transformer_lm dimensions, and a tiny setting for tests.
FULL = dict(layers=6, embed_dim=512, heads=8, ffn_dim=2048, vocab=32000,
            lengths=[256, 512, 1024, 4096, 8192], tokens_per_batch=8192)
TINY = dict(layers=2, embed_dim=64, heads=4, ffn_dim=128, vocab=100,
            lengths=[32, 64], tokens_per_batch=256)
DTYPES = {"float32": None, "fp32": None, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
          "fp16": torch.float16, "float16": torch.float16}


class SDPASelfAttention(nn.Module):
    """Causal self-attention through ``F.scaled_dot_product_attention(is_causal=True)``.

    Takes over a fairseq MultiheadAttention's q/k/v/out projections (same parameter names, so
    state dicts are interchangeable) and its call signature (Time x Batch x Channel). Training
    only: no incremental state, no padding mask, no attention weights.
    """

    def __init__(self, mha: nn.Module):
        super().__init__()
        if getattr(mha, "bias_k", None) is not None or getattr(mha, "add_zero_attn", False):
            raise ValueError("SDPASelfAttention supports neither add_bias_kv nor add_zero_attn")
        self.embed_dim, self.num_heads, self.head_dim = mha.embed_dim, mha.num_heads, mha.head_dim
        self.dropout = mha.dropout_module.p
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = mha.q_proj, mha.k_proj, mha.v_proj, mha.out_proj

    def forward(self, query, key=None, value=None, key_padding_mask=None, incremental_state=None,
                need_weights=False, static_kv=False, attn_mask=None, before_softmax=False,
                need_head_weights=False):
        if incremental_state is not None or key_padding_mask is not None or static_kv or before_softmax:
            raise NotImplementedError("SDPASelfAttention: training forward without padding only")
        T, B, C = query.shape
        H, K = self.num_heads, self.head_dim

        def heads(x):  # [T, B, C] -> [B, H, T, K]
            return x.view(T, B, H, K).permute(1, 2, 0, 3)

        o = F.scaled_dot_product_attention(
            heads(self.q_proj(query)), heads(self.k_proj(query)), heads(self.v_proj(query)),
            dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        return self.out_proj(o.permute(2, 0, 1, 3).reshape(T, B, C)), None

    # fairseq's decoder layer asks its self_attn for these.
    def _get_input_buffer(self, incremental_state):
        return {}

    def _set_input_buffer(self, incremental_state, buffer):
        raise NotImplementedError("SDPASelfAttention has no incremental state")


def to_sdpa(model):
    """Swap every decoder layer's self_attn for SDPASelfAttention; build no future mask."""
    for layer in model.decoder.layers:
        layer.self_attn = SDPASelfAttention(layer.self_attn)
    model.decoder.buffered_future_mask = lambda tensor: None
    return model


_DATA_DIRS: Dict[int, str] = {}


def data_dir(vocab: int) -> str:
    if vocab not in _DATA_DIRS:
        directory = tempfile.mkdtemp(prefix="train_speed_")
        atexit.register(shutil.rmtree, directory, True)
        _DATA_DIRS[vocab] = fake_dictionary(directory, vocab, names=("dict.txt",))
    return _DATA_DIRS[vocab]


def build(variant: str, dims: Dict, max_len: int, seed: int = 0):
    """The model of ``variant`` (random weights from ``seed``) and its task."""
    from fairseq import options, tasks

    parser = options.get_training_parser()
    args = options.parse_args_and_arch(parser, input_args=[
        data_dir(dims["vocab"]), "--user-dir", USER_DIR, "--task", "language_modeling",
        "--tokens-per-sample", str(max_len), "--max-target-positions", str(max_len),
        "--dropout", "0", "--attention-dropout", "0", "--activation-dropout", "0",
        "--decoder-layers", str(dims["layers"]), "--decoder-embed-dim", str(dims["embed_dim"]),
        "--decoder-input-dim", str(dims["embed_dim"]), "--decoder-output-dim", str(dims["embed_dim"]),
        "--decoder-attention-heads", str(dims["heads"]), "--decoder-ffn-embed-dim", str(dims["ffn_dim"]),
    ] + ARCH[variant])
    task = tasks.setup_task(args)
    torch.manual_seed(seed)
    model = task.build_model(args)
    if variant == "sdpa":
        to_sdpa(model)
    return model, task


def check_sdpa_matches_fairseq(dims: Optional[Dict] = None, length: int = 64, batch: int = 2,
                               device: str = "cpu", tol: float = 1e-4) -> float:
    """Build ``softmax`` and ``sdpa`` with the same weights, compare ``extract_features`` on the
    same tokens (training mode, dropout 0). Returns the max abs difference; raises if > tol."""
    dims = dict(TINY if dims is None else dims)
    ref, task = build("softmax", dims, length)
    alt, _ = build("sdpa", dims, length, seed=1)
    alt.load_state_dict(ref.state_dict())
    ref.to(device).train()
    alt.to(device).train()
    d = task.source_dictionary
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(d.nspecial, len(d), (batch, length), generator=gen).to(device)
    with torch.no_grad():
        a = ref.decoder.extract_features(tokens, None)[0].float()
        b = alt.decoder.extract_features(tokens, None)[0].float()
    diff = (a - b).abs().max().item()
    if not diff <= tol:
        raise AssertionError(f"sdpa variant differs from fairseq softmax: max abs diff {diff:.3g} > {tol}")
    return diff


def is_oom(e: BaseException) -> bool:
    if isinstance(e, getattr(torch, "OutOfMemoryError", ())):
        return True
    msg = str(e)
    return isinstance(e, RuntimeError) and ("out of memory" in msg or "can't allocate memory" in msg)


def release_memory(device: str):
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    else:
        try:  # hand freed heap pages back, so the next RSS peak starts from a low baseline
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except (OSError, AttributeError):
            pass


def predicted_seconds(variant: str, last, length: int, steps: int) -> Optional[float]:
    """Predicted wall time of ``steps`` steps at ``length`` from the last measured (length, s/step).

    A step holds a fixed number of tokens, so softmax's attention cost per step grows linearly
    with the length (tokens x length) and RFA's does not grow; the prediction takes the
    softmax variants as linear and RFA as constant (an estimate, used only to skip runs)."""
    if last is None:
        return None
    prev_len, prev_sec = last
    power = 1 if variant in QUADRATIC else 0
    return prev_sec * (length / prev_len) ** power * steps


def measure(model, tokens, target, device, autocast_dtype, repeats):
    params = [p for p in model.parameters()]

    def step():
        for p in params:
            p.grad = None
        if autocast_dtype is not None:
            with torch.autocast(device_type=device, dtype=autocast_dtype):
                feats = model.decoder.extract_features(tokens, None)[0]
        else:
            feats = model.decoder.extract_features(tokens, None)[0]
        (feats.float() * target).sum().backward()

    release_memory(device)
    with PeakMemory(device, watch=[model]) as mem:
        times = timed(step, device, repeats, warmup=1)
    mem.remove()
    for p in params:
        p.grad = None
    return times, mem.peak_bytes


def fmt_ratio(x):
    return f"{x:6.2f}x" if x is not None else "      -"


def run(args) -> List[Dict]:
    device = args.device
    dims = dict(layers=args.layers, embed_dim=args.embed_dim, heads=args.heads, ffn_dim=args.ffn_dim,
                vocab=args.vocab)
    autocast_dtype = DTYPES[args.dtype]
    rows: List[Dict] = []
    tokens_per_s: Dict = {}  # (variant, length) -> tokens/s
    print(f"{'variant':9s} {'length':>6s} {'batch':>5s} {'s/step':>9s} {'tokens/s':>10s} "
          f"{'vs softmax':>10s} {'vs sdpa':>8s} {'peak MiB':>9s}", flush=True)
    for variant in args.variants:
        model, task = build(variant, dims, max(args.lengths), seed=args.seed)
        model.to(device).train()
        d = task.source_dictionary
        n_params = sum(p.numel() for n, p in model.named_parameters() if "output_projection" not in n)
        last = None  # (length, seconds per step) of the last measured length
        failed_at = None
        for length in args.lengths:
            batch = max(1, args.tokens_per_batch // length)
            row = {"variant": variant, "length": length, "batch": batch, "tokens": batch * length,
                   "params_without_output_projection": n_params}
            rows.append(row)
            pred = predicted_seconds(variant, last, length, args.repeats + 1)
            if failed_at is not None:
                row["skipped"] = f"out of memory at length {failed_at}"
            elif pred is not None and pred > args.max_seconds:
                row["skipped"] = f"predicted {pred:.3g} s > --max-seconds {args.max_seconds:g}"
            if "skipped" in row:
                print(f"{variant:9s} {length:6d} {batch:5d}  skipped: {row['skipped']}", flush=True)
                continue
            gen = torch.Generator().manual_seed(args.seed + length)
            tokens = torch.randint(d.nspecial, len(d), (batch, length), generator=gen).to(device)
            target = torch.randn(batch, length, dims["embed_dim"], generator=gen).to(device)
            oom = False
            try:
                times, peak = measure(model, tokens, target, device, autocast_dtype, args.repeats)
            except (RuntimeError, MemoryError) as e:
                if not (is_oom(e) or isinstance(e, MemoryError)):
                    raise
                oom = True  # handled below, once the exception (and the frames it holds) is gone
            del tokens, target
            if oom:
                for p in model.parameters():
                    p.grad = None
                release_memory(device)
                row["error"] = "out of memory"
                failed_at = length
                print(f"{variant:9s} {length:6d} {batch:5d}  out of memory", flush=True)
                continue
            sec = median(times)
            last = (length, sec)
            row.update(seconds=sec, times=times, tokens_per_s=batch * length / sec, peak_bytes=peak)
            tokens_per_s[(variant, length)] = row["tokens_per_s"]
            for base in QUADRATIC:
                if (base, length) in tokens_per_s:
                    row[f"ratio_to_{base}"] = row["tokens_per_s"] / tokens_per_s[(base, length)]
            peak_s = f"{peak / 2**20:9.1f}" if peak is not None else f"{'-':>9s}"
            print(f"{variant:9s} {length:6d} {batch:5d} {sec:9.4f} {row['tokens_per_s']:10.1f} "
                  f"{fmt_ratio(row.get('ratio_to_softmax')):>10s} {fmt_ratio(row.get('ratio_to_sdpa')):>8s} "
                  f"{peak_s}", flush=True)
        del model
        release_memory(device)
    # Ratios against a baseline measured later in the run (e.g. --variants rfa softmax).
    for row in rows:
        for base in QUADRATIC:
            key = (base, row["length"])
            if "tokens_per_s" in row and key in tokens_per_s:
                row[f"ratio_to_{base}"] = row["tokens_per_s"] / tokens_per_s[key]
    return rows


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", type=int, nargs="+", help=f"default {FULL['lengths']} (--tiny: {TINY['lengths']})")
    p.add_argument("--tokens-per-batch", type=int, help="tokens per step; batch = max(1, this // length) "
                   f"(default {FULL['tokens_per_batch']}, --tiny {TINY['tokens_per_batch']})")
    p.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(DEFAULT_VARIANTS),
                   help=f"default {' '.join(DEFAULT_VARIANTS)}; the *_recompute variants train with --rfa-recompute")
    p.add_argument("--repeats", type=int, default=3, help="timed steps (median) after one warm-up step")
    p.add_argument("--max-seconds", type=float, default=600.0,
                   help="skip a (variant, length) whose predicted time (warm-up + repeats) exceeds this")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--dtype", choices=tuple(DTYPES), default="float32",
                   help="float32, or bf16/fp16 through torch.autocast (CUDA only)")
    p.add_argument("--tiny", action="store_true",
                   help="2 layers, 64 dims, 4 heads, FFN 128, vocab 100, lengths 32 64, 256 tokens/step")
    p.add_argument("--layers", type=int)
    p.add_argument("--embed-dim", type=int)
    p.add_argument("--heads", type=int)
    p.add_argument("--ffn-dim", type=int)
    p.add_argument("--vocab", type=int)
    p.add_argument("--threads", type=int, help="torch intra-op threads (CPU)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--check", action="store_true", help="first check that sdpa == fairseq softmax (raises if not)")
    p.add_argument("--check-only", action="store_true", help="run the check and exit")
    p.add_argument("--out", help="JSON output path")
    args = p.parse_args(argv)
    profile = TINY if args.tiny else FULL
    for name in ("lengths", "tokens_per_batch", "layers", "embed_dim", "heads", "ffn_dim", "vocab"):
        if getattr(args, name) is None:
            setattr(args, name, profile[name])
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: CUDA is not available")
    if DTYPES[args.dtype] is not None and args.device != "cuda":
        p.error(f"--dtype {args.dtype} (torch.autocast) is supported on CUDA only; use float32 on CPU")
    if args.repeats < 1 or args.tokens_per_batch < 1 or min(args.lengths) < 1:
        p.error("--repeats, --tokens-per-batch and --lengths must be positive")
    if args.embed_dim % args.heads:
        p.error(f"--embed-dim {args.embed_dim} is not divisible by --heads {args.heads}")
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    dims = dict(layers=args.layers, embed_dim=args.embed_dim, heads=args.heads, ffn_dim=args.ffn_dim,
                vocab=args.vocab)
    if args.check or args.check_only:
        diff = check_sdpa_matches_fairseq(dims, length=min(64, max(args.lengths)), device=args.device)
        print(f"check: sdpa matches fairseq softmax (max abs diff {diff:.2e})", flush=True)
        if args.check_only:
            return []
    print(f"device {args.device}, dtype {args.dtype}, {args.layers} layers, {args.embed_dim} dims, "
          f"{args.heads} heads, FFN {args.ffn_dim}, vocab {args.vocab}, {args.tokens_per_batch} tokens/step, "
          f"threads {torch.get_num_threads()}", flush=True)
    rows = run(args)
    if args.out:
        meta = dict(machine_info(args.device), args=vars(args),
                    step="decoder.extract_features + (features.float() * R).sum() + backward; "
                         "no vocabulary projection")
        write_json(args.out, meta, rows)
    return rows


if __name__ == "__main__":
    main()
