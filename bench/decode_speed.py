#!/usr/bin/env python
"""Translation decoding speed: fairseq's softmax transformer vs RFA and RFA-Gate, side by side.

fairseq's SequenceGenerator, beam 4, transformer-base sized models (6+6 layers, 512 dims,
8 heads, FFN 2048, a 32k joined vocabulary, random weights), the target length forced to each
length (min_len = max_len). Prints, per length and model: generated tokens/s (sentences x length
/ time, median over repeats), the ratio to softmax, and the bytes held in the incremental state
at the end. Writes JSON with --out.

    python bench/decode_speed.py --lengths 32 128 512 --batch 2 --repeats 3 --out bench/decode_cpu.json

Measure on a quiet machine: the ratios come from one run, the absolute numbers hold only there.
"""
import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

MODELS = {
    "softmax": ["--arch", "transformer_wmt_en_de"],
    "rfa": ["--arch", "rfa_transformer_wmt_en_de"],
    "rfa_gate": ["--arch", "rfa_transformer_wmt_en_de", "--rfa-gate"],
}


def build(arch_args, data_dir, max_len):
    from fairseq import options, tasks

    parser = options.get_training_parser()
    args = options.parse_args_and_arch(parser, input_args=[
        data_dir, "--user-dir", os.path.join(REPO, "rfa_fairseq"), "--task", "translation",
        "--source-lang", "src", "--target-lang", "tgt", "--share-all-embeddings",
        "--max-target-positions", str(max_len + 16), "--dropout", "0.0"] + arch_args)
    task = tasks.setup_task(args)
    return task, task.build_model(args).eval()


def state_bytes(state):
    return sum(t.numel() * t.element_size() for buf in state.values() for t in buf.values() if t is not None)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", type=int, nargs="+", default=[32, 128, 512])
    p.add_argument("--batch", type=int, default=2, help="source sentences per batch")
    p.add_argument("--src-len", type=int, default=24)
    p.add_argument("--beam", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--models", nargs="+", default=list(MODELS))
    p.add_argument("--out")
    args = p.parse_args()
    from fairseq.sequence_generator import SequenceGenerator

    device = "cuda" if torch.cuda.is_available() else "cpu"
    tmp = tempfile.mkdtemp()
    for lang in ("src", "tgt"):
        with open(os.path.join(tmp, f"dict.{lang}.txt"), "w") as f:
            f.writelines(f"w{i} 1\n" for i in range(32000 - 4))
    torch.manual_seed(0)
    rows = []
    for name in args.models:
        task, model = build(MODELS[name], tmp, max(args.lengths))
        model.to(device)
        d = task.source_dictionary
        src = torch.randint(d.nspecial, len(d), (args.batch, args.src_len))
        src[:, -1] = d.eos()
        sample = {"id": torch.arange(args.batch), "net_input": {
            "src_tokens": src.to(device), "src_lengths": torch.full((args.batch,), args.src_len, device=device)}}
        captured = {}
        original = model.decoder.forward

        def spy(*a, **kw):
            out = original(*a, **kw)
            captured["state"] = kw.get("incremental_state")
            return out

        model.decoder.forward = spy
        for length in args.lengths:
            gen = SequenceGenerator([model], task.target_dictionary, beam_size=args.beam,
                                    max_len_a=0, max_len_b=length, min_len=length)
            times = []
            with torch.inference_mode():
                for _ in range(args.repeats + 1):  # the first run warms up
                    if device == "cuda":
                        torch.cuda.synchronize()
                    t = time.perf_counter()
                    gen.forward(sample)
                    if device == "cuda":
                        torch.cuda.synchronize()
                    times.append(time.perf_counter() - t)
            sec = statistics.median(times[1:])
            rows.append({"model": name, "length": length, "seconds": sec,
                         "tokens_per_s": args.batch * length / sec,
                         "state_bytes": state_bytes(captured["state"])})
            print(f"{name:9s} length {length:5d}: {rows[-1]['tokens_per_s']:8.1f} tokens/s, "
                  f"state {rows[-1]['state_bytes'] / 2**20:8.2f} MiB", flush=True)
    base = {r["length"]: r["tokens_per_s"] for r in rows if r["model"] == "softmax"}
    for r in rows:
        if r["length"] in base:
            r["ratio_to_softmax"] = r["tokens_per_s"] / base[r["length"]]
    print("\nratio to softmax (tokens/s):")
    for r in rows:
        if r["model"] != "softmax" and "ratio_to_softmax" in r:
            print(f"  {r['model']:9s} length {r['length']:5d}: {r['ratio_to_softmax']:.2f}x")
    if args.out:
        meta = {"device": torch.cuda.get_device_name() if device == "cuda" else platform.processor() or "cpu",
                "threads": torch.get_num_threads(), "torch": torch.__version__, "args": vars(args)}
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
