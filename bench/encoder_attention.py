#!/usr/bin/env python
"""Encoder self-attention at long source lengths: softmax, SDPA, RFA, FAVOR+ and LARA.

**Layer** (always): one encoder self-attention module, forward and backward, on one source of
``T`` tokens (batch 1, no padding): ``x [T, 1, C]`` (requires grad) -> ``out``,
``loss = (out * R).sum()`` with a fixed random ``R``, ``loss.backward()``. Variants, all with the
same dimensions (``--embed-dim``, ``--heads``; random weights, dropout 0):

- ``softmax``: fairseq's MultiheadAttention(self_attention=True), what the encoder uses by
  default (``build_encoder_self_attention("softmax", ...)``);
- ``sdpa``: the same projections through ``F.scaled_dot_product_attention`` (non-causal): torch's
  fused kernel, the fastest exact softmax attention at hand;
- ``rfa``, ``favor``, ``lara``: ``build_encoder_self_attention(kind, ...)`` with
  ``--feature-dim`` random features and ``--landmarks`` landmarks.

**Translation** (``--documents``): end-to-end decoding of long sources with an
``rfa_transformer`` (``--arch``, random weights) for each ``--encoder-attention``: pseudo-documents
made of consecutive Multi30k test sentences (German, the shipped data), cut to exactly ``L``
tokens, translated with fairseq's SequenceGenerator (beam ``--beam``, exactly ``--target-len``
output tokens, so the decoder's work is the same for every encoder). Reported: the encoder's
forward time and the whole generation time per document.

Reported per (variant, length): median seconds over ``--repeats`` (after one warm-up), the ratio
to softmax's time (same run; < 1 is faster), and the peak memory of one step
(bench.common.PeakMemory: on CPU the larger of the RSS high-water mark and malloc's live bytes
above the start). A softmax (variant, length) whose attention matrices would not fit in
``--max-memory-gb`` (predicted: 4 bytes x heads x T^2 x 4 copies for fairseq's softmax, which
keeps logits, probabilities and their gradients) is skipped and recorded with the reason, as is
any variant whose predicted time (the previous length's, scaled by the length ratio squared for
softmax/sdpa, linearly for the others) exceeds ``--max-seconds``.

    OMP_NUM_THREADS=1 taskset -c 0 python bench/encoder_attention.py --threads 1 \\
        --lengths 512 1024 2048 4096 8192 16384 --documents 512 1024 2048 4096 \\
        --out bench/results/encoder_attention.json
    python bench/encoder_attention.py --tiny      # seconds: the smoke test's setting
"""
import argparse
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

from bench.common import PeakMemory, USER_DIR, machine_info, median, threads, timed, write_json  # noqa: E402
from rfa_fairseq.modules.encoder_attention import build_encoder_self_attention  # noqa: E402

VARIANTS = ("softmax", "sdpa", "rfa", "favor", "lara")
QUADRATIC = ("softmax", "sdpa")
SOFTMAX_COPIES = 4  # T x T tensors per head fairseq's softmax attention keeps for its backward pass


class SDPAEncoderAttention(nn.Module):
    """Non-causal self-attention through ``F.scaled_dot_product_attention``, with a fairseq
    MultiheadAttention's q/k/v/out projections (Time x Batch x Channel; no padding mask)."""

    def __init__(self, mha: nn.Module):
        super().__init__()
        self.num_heads, self.head_dim = mha.num_heads, mha.head_dim
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = mha.q_proj, mha.k_proj, mha.v_proj, mha.out_proj

    def forward(self, query, key=None, value=None, key_padding_mask=None, need_weights=False, attn_mask=None):
        if key_padding_mask is not None or attn_mask is not None:
            raise NotImplementedError("SDPAEncoderAttention: no padding, no mask")
        T, B, C = query.shape

        def heads(x):  # [T, B, C] -> [B, H, T, K]
            return x.view(T, B, self.num_heads, self.head_dim).permute(1, 2, 0, 3)

        o = F.scaled_dot_product_attention(heads(self.q_proj(query)), heads(self.k_proj(query)),
                                           heads(self.v_proj(query)))
        return self.out_proj(o.permute(2, 0, 1, 3).reshape(T, B, C)), None


def build_layer(variant: str, args) -> nn.Module:
    torch.manual_seed(0)
    kind = "softmax" if variant == "sdpa" else variant
    module = build_encoder_self_attention(kind, args.embed_dim, args.heads, feature_dim=args.feature_dim,
                                          landmarks=args.landmarks)
    return SDPAEncoderAttention(module) if variant == "sdpa" else module


def check_sdpa_matches_softmax(embed_dim: int = 32, heads: int = 4, length: int = 13) -> float:
    """The largest difference between the sdpa and softmax variants' outputs (same weights)."""
    torch.manual_seed(0)
    mha = build_encoder_self_attention("softmax", embed_dim, heads)
    x = torch.randn(length, 2, embed_dim)
    return (mha(x, x, x)[0] - SDPAEncoderAttention(mha)(x)[0]).abs().max().item()


def softmax_bytes(length: int, heads: int) -> int:
    return SOFTMAX_COPIES * 4 * heads * length * length


def layer_step(module: nn.Module, x: torch.Tensor, r: torch.Tensor):
    def step():
        x.grad = None
        for p in module.parameters():
            p.grad = None
        out, _ = module(x, x, x)
        (out * r).sum().backward()
    return step


def run_layers(args) -> List[Dict]:
    rows: List[Dict] = []
    last: Dict[str, tuple] = {}  # variant -> (length, seconds per step) of the last length measured
    for length in args.lengths:
        base = None
        for variant in args.variants:
            row = {"section": "layer", "variant": variant, "length": length}
            if variant == "softmax" and softmax_bytes(length, args.heads) > args.max_memory_gb * 2**30:
                row["skipped"] = (f"its attention matrices would need about "
                                  f"{softmax_bytes(length, args.heads) / 2**30:.0f} GiB (> --max-memory-gb "
                                  f"{args.max_memory_gb})")
            elif variant in last:
                prev_len, prev_s = last[variant]
                scale = (length / prev_len) ** (2 if variant in QUADRATIC else 1)
                predicted = prev_s * scale * (args.repeats + 1)
                if predicted > args.max_seconds:
                    row["skipped"] = f"predicted {predicted:.0f} s > --max-seconds {args.max_seconds}"
            if "skipped" not in row:
                module = build_layer(variant, args).train()
                g = torch.Generator().manual_seed(length)
                x = torch.randn(length, 1, args.embed_dim, generator=g).requires_grad_()
                r = torch.randn(length, 1, args.embed_dim, generator=g)
                step = layer_step(module, x, r)
                try:
                    with PeakMemory("cpu", watch=[module]) as mem:
                        step()
                    mem.remove()
                    seconds = median(timed(step, "cpu", args.repeats))
                except RuntimeError as e:  # out of memory
                    row["error"] = str(e).splitlines()[0][:200]
                else:
                    row.update(seconds=seconds, peak_mb=None if mem.peak_bytes is None else mem.peak_bytes / 2**20,
                               tokens_per_s=length / seconds)
                    last[variant] = (length, seconds)
                del module, x, r, step
                gc.collect()
            if variant == "softmax" and "seconds" in row:
                base = row["seconds"]
            if base is not None and "seconds" in row:
                row["time_vs_softmax"] = row["seconds"] / base
            rows.append(row)
            print(format_row(row), flush=True)
    return rows


def format_row(row: Dict) -> str:
    head = f"{row['section']:<11} {row['variant']:<8} {row['length']:>6}"
    if "skipped" in row:
        return f"{head}  skipped: {row['skipped']}"
    if "error" in row:
        return f"{head}  error: {row['error']}"
    ratio = f"  x{row['time_vs_softmax']:.3f} softmax" if "time_vs_softmax" in row else "  (softmax not measured)"
    extra = f"  encoder {row['encoder_seconds']:.3f} s" if "encoder_seconds" in row else ""
    peak = f"  peak {row['peak_mb']:.0f} MB" if row.get("peak_mb") is not None else ""
    return f"{head}  {row['seconds']:.4f} s{extra}{peak}{ratio}"


# --- translation with long sources -------------------------------------------------------------

def multi30k_sentences(split: str = "test") -> List[str]:
    import gzip
    with gzip.open(os.path.join(REPO, "data", "multi30k", f"{split}.de.gz"), "rt", encoding="utf-8") as f:
        return [line.split() for line in f]


def build_translation(encoder: str, args, workdir: str, dictionary_words: List[str]):
    """An ``rfa_transformer`` with ``--encoder-attention encoder`` (random weights) and its task."""
    from fairseq import options, tasks

    for lang in ("de", "en"):
        with open(os.path.join(workdir, f"dict.{lang}.txt"), "w", encoding="utf-8") as f:
            f.writelines(f"{w} 1\n" for w in dictionary_words)
    flags = ["--encoder-attention", encoder, "--cross-attention", "rfa"]  # the decoder linear too
    if encoder in ("rfa", "favor"):
        flags += ["--encoder-feature-dim", str(args.feature_dim)]
    if encoder == "lara":
        flags += ["--lara-landmarks", str(args.landmarks)]
    parser = options.get_training_parser()
    parsed = options.parse_args_and_arch(parser, input_args=[
        workdir, "--user-dir", USER_DIR, "--task", "translation", "--source-lang", "de", "--target-lang", "en",
        "--arch", args.arch, "--share-all-embeddings", "--max-source-positions", str(max(args.documents) + 8),
        "--max-target-positions", str(args.target_len + 8), "--dropout", "0", "--cpu"] + args.model_flags + flags)
    task = tasks.setup_task(parsed)
    torch.manual_seed(0)
    return task, task.build_model(parsed).eval()


def pseudo_document(dictionary, sentences: List[List[str]], length: int) -> torch.Tensor:
    """Consecutive sentences joined until ``length`` tokens (the last one cut), then eos: ``[1, length + 1]``."""
    words: List[str] = []
    for sentence in sentences:
        words.extend(sentence)
        if len(words) >= length:
            break
    if len(words) < length:
        raise ValueError(f"the sentences hold only {len(words)} tokens, fewer than {length}")
    ids = [dictionary.index(w) for w in words[:length]] + [dictionary.eos()]
    return torch.tensor([ids])


def run_translation(args) -> List[Dict]:
    from fairseq.sequence_generator import SequenceGenerator

    sentences = multi30k_sentences()
    counts: Dict[str, int] = {}
    for s in sentences:
        for w in s:
            counts[w] = counts.get(w, 0) + 1
    words = sorted(counts, key=lambda w: (-counts[w], w))
    rows: List[Dict] = []
    workdir = tempfile.mkdtemp(prefix="encoder_attention_")
    try:
        for length in args.documents:
            base = None
            for encoder in args.encoders:
                row = {"section": "translation", "variant": encoder, "length": length, "beam": args.beam,
                       "target_len": args.target_len}
                if encoder == "softmax" and softmax_bytes(length, args.heads) > args.max_memory_gb * 2**30:
                    row["skipped"] = "attention matrices over --max-memory-gb"
                else:
                    task, model = build_translation(encoder, args, workdir, words)
                    src = pseudo_document(task.source_dictionary, sentences, length)
                    sample = {"net_input": {"src_tokens": src, "src_lengths": torch.tensor([src.size(1)])}}
                    generator = SequenceGenerator([model], task.target_dictionary, beam_size=args.beam,
                                                  max_len_a=0, max_len_b=args.target_len, min_len=args.target_len)
                    with torch.no_grad():
                        encode = lambda: model.encoder(src, sample["net_input"]["src_lengths"])  # noqa: E731
                        row["encoder_seconds"] = median(timed(encode, "cpu", args.repeats))
                        hyps = generator.generate([model], sample)
                        row["seconds"] = median(timed(lambda: generator.generate([model], sample), "cpu",
                                                      args.repeats, warmup=0))
                    row["output_tokens"] = int(hyps[0][0]["tokens"].numel())
                    del task, model, generator
                    gc.collect()
                if encoder == "softmax" and "seconds" in row:
                    base = row["seconds"]
                if base is not None and "seconds" in row:
                    row["time_vs_softmax"] = row["seconds"] / base
                rows.append(row)
                print(format_row(row), flush=True)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return rows


TINY = dict(embed_dim=32, heads=4, feature_dim=8, landmarks=4, lengths=[64, 128], documents=[40],
            arch="rfa_transformer", target_len=4, beam=2,
            model_flags=["--encoder-layers", "1", "--decoder-layers", "1", "--encoder-embed-dim", "32",
                         "--decoder-embed-dim", "32", "--encoder-ffn-embed-dim", "64", "--decoder-ffn-embed-dim", "64",
                         "--encoder-attention-heads", "4", "--decoder-attention-heads", "4"])


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    p.add_argument("--lengths", nargs="+", type=int, default=None,
                   help="source lengths of the layer section (default 512 .. 16384; --tiny: 64 128)")
    p.add_argument("--embed-dim", type=int, default=512, help="model dimension (transformer-base: 512)")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--feature-dim", type=int, default=64, help="random features of rfa and favor")
    p.add_argument("--landmarks", type=int, default=16, help="landmarks of lara")
    p.add_argument("--documents", nargs="*", type=int, default=None,
                   help="pseudo-document lengths (source tokens) of the translation section (default none: "
                        "skipped; --tiny: 40)")
    p.add_argument("--encoders", nargs="+", default=["softmax", "rfa", "favor", "lara"],
                   choices=["softmax", "rfa", "favor", "lara"])
    p.add_argument("--arch", default="rfa_transformer_iwslt_de_en", help="translation section's architecture")
    p.add_argument("--target-len", type=int, default=32, help="output tokens per document (translation)")
    p.add_argument("--beam", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--max-memory-gb", type=float, default=10.0,
                   help="skip softmax where its attention matrices would need more")
    p.add_argument("--max-seconds", type=float, default=300.0,
                   help="skip a (variant, length) predicted to take longer (all repeats)")
    p.add_argument("--tiny", action="store_true", help="tiny dimensions and lengths (smoke test)")
    p.add_argument("--out", default=None, help="JSON results (meta + rows)")
    args = p.parse_args(argv)
    args.model_flags = []
    if args.tiny:
        for name, value in TINY.items():
            if getattr(args, name, None) is None or name not in ("lengths", "documents"):
                setattr(args, name, value)
    if args.lengths is None:
        args.lengths = [512, 1024, 2048, 4096, 8192, 16384]
    if args.documents is None:
        args.documents = []
    for name in ("embed_dim", "heads", "feature_dim", "landmarks", "repeats"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be positive")
    if args.embed_dim % args.heads:
        p.error(f"--embed-dim {args.embed_dim} is not divisible by --heads {args.heads}")
    return args


def main(argv=None):
    args = parse_args(argv)
    with threads(args.threads):
        meta = machine_info("cpu")
        meta.update({name: getattr(args, name) for name in (
            "embed_dim", "heads", "feature_dim", "landmarks", "repeats", "max_memory_gb", "max_seconds")})
        meta["sdpa_vs_softmax_max_abs_diff"] = check_sdpa_matches_softmax()
        meta["command"] = " ".join(["python", "bench/encoder_attention.py"] + (argv if argv is not None else sys.argv[1:]))
        rows = run_layers(args)
        if args.documents:
            meta.update(arch=args.arch, beam=args.beam, target_len=args.target_len)
            rows += run_translation(args)
    if args.out:
        write_json(args.out, meta, rows)
    return rows


if __name__ == "__main__":
    main()
