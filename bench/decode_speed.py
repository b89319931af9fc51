#!/usr/bin/env python
"""Decoding speed and memory: fairseq's softmax transformer vs RFA and RFA-Gate, side by side.

fairseq's SequenceGenerator with the output length forced (min_len = max_len), random weights
(speed does not depend on them), the same dimensions for every model:

- ``--task translation``: ``transformer_wmt_en_de`` vs ``rfa_transformer_wmt_en_de`` with and
  without ``--rfa-gate`` (6+6 layers, 512 dims, 8 heads, FFN 2048, a 32k joined vocabulary,
  shared embeddings), a batch of ``--batch`` source sentences of ``--src-len`` tokens, beam 4.
- ``--task lm``: ``transformer_lm`` vs ``rfa_transformer_lm`` (same 6 x 512 decoder, 32k
  vocabulary, shared input/output embedding), continuing a ``--prefix-len`` token prompt.

Per model and length: generated tokens/s (sentences x length / seconds, the median over
``--repeats``, the models taking turns run by run; one warm-up run per model), the ratio to
softmax, the peak memory of the first run above what was resident before it (bench/common.py),
and the bytes held in the incremental state at the end. On a shared CPU machine, short lengths
compare best with ``--threads 1 --clock cpu --statistic min``: the fastest run by the process's
own CPU time, which other tenants can slow down only through the caches and memory. Runs that would take too long are measured once (``--single-run-seconds``) or
skipped (``--max-seconds``), predicted from the previous length; both are recorded.

    python bench/decode_speed.py --task translation --out bench/results/decode_translation.json
    python bench/decode_speed.py --task lm --lengths 128 512 2048 8192 --batch 1 --beam 1 \\
        --out bench/results/decode_lm.json

Measure on a quiet machine: the ratios come from one run, the absolute numbers hold only there.
"""
import argparse
import gc
import os
import sys
import tempfile

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from bench.common import CLOCKS, USER_DIR, PeakMemory, fake_dictionary, machine_info, median, timed, write_json  # noqa: E402

BASE_DIMS = ["--decoder-embed-dim", "512", "--decoder-ffn-embed-dim", "2048", "--decoder-layers", "6",
             "--decoder-attention-heads", "8"]
TINY_DIMS = ["--decoder-embed-dim", "32", "--decoder-ffn-embed-dim", "64", "--decoder-layers", "2",
             "--decoder-attention-heads", "4"]
TINY_ENCODER = ["--encoder-embed-dim", "32", "--encoder-ffn-embed-dim", "64", "--encoder-layers", "2",
                "--encoder-attention-heads", "4"]

MODELS = {
    "translation": {
        "softmax": ["--arch", "transformer_wmt_en_de"],
        # the paper's model: RFA cross attention too, whose cost per step does not grow with the source
        "rfa": ["--arch", "rfa_transformer_wmt_en_de", "--cross-attention", "rfa"],
        "rfa_gate": ["--arch", "rfa_transformer_wmt_en_de", "--cross-attention", "rfa", "--rfa-gate"],
    },
    "lm": {
        "softmax": ["--arch", "transformer_lm"] + BASE_DIMS,
        "rfa": ["--arch", "rfa_transformer_lm"] + BASE_DIMS,
        "rfa_gate": ["--arch", "rfa_transformer_lm", "--rfa-gate"] + BASE_DIMS,
    },
}


def build(task_name, arch_args, data_dir, max_len, tiny=False):
    from fairseq import options, tasks

    parser = options.get_training_parser()
    common = [data_dir, "--user-dir", USER_DIR, "--dropout", "0.0"]
    if task_name == "translation":
        extra = ["--task", "translation", "--source-lang", "src", "--target-lang", "tgt",
                 "--share-all-embeddings", "--max-target-positions", str(max_len + 16)]
        if tiny:
            extra += TINY_DIMS + TINY_ENCODER
    else:
        extra = ["--task", "language_modeling", "--share-decoder-input-output-embed",
                 "--tokens-per-sample", str(max_len + 16)]
        if tiny:
            arch_args = [a for a in arch_args if a not in BASE_DIMS[1::2] and a not in BASE_DIMS[::2]]
            arch_args = arch_args + TINY_DIMS
    args = options.parse_args_and_arch(parser, input_args=common + extra + arch_args)
    task = tasks.setup_task(args)
    return task, task.build_model(args).eval()


def make_sample(task_name, task, batch, src_len, prefix_len, device):
    if task_name == "translation":
        d = task.source_dictionary
        src = torch.randint(d.nspecial, len(d), (batch, src_len))
        src[:, -1] = d.eos()
        lengths = torch.full((batch,), src_len)
    else:
        d = task.target_dictionary
        src = torch.randint(d.nspecial, len(d), (batch, prefix_len))
        lengths = torch.full((batch,), prefix_len)
    return {"id": torch.arange(batch), "net_input": {"src_tokens": src.to(device), "src_lengths": lengths.to(device)}}


def state_bytes(state):
    total = 0
    for buf in state.values():
        for t in buf.values():
            if isinstance(t, torch.Tensor):
                total += t.numel() * t.element_size()
    return total


class StateSpy:
    """Keeps a reference to the incremental state the generator passes to the decoder."""

    def __init__(self, model):
        self.state = None
        original = model.decoder.forward

        def spy(*a, **kw):
            self.state = kw.get("incremental_state")
            return original(*a, **kw)

        model.decoder.forward = spy


def generate_fn(task_name, task, model, sample, beam, length, prefix_len):
    from fairseq.sequence_generator import SequenceGenerator

    if task_name == "translation":
        gen = SequenceGenerator([model], task.target_dictionary, beam_size=beam,
                                max_len_a=0, max_len_b=length, min_len=length)
        return lambda: gen.generate([model], sample)
    # LM: the prompt is forced as a prefix, then `length` new tokens are generated.
    total = prefix_len + length
    gen = SequenceGenerator([model], task.target_dictionary, beam_size=beam,
                            max_len_a=0, max_len_b=total, min_len=total)
    prefix = sample["net_input"]["src_tokens"]
    empty = {"id": sample["id"], "net_input": {
        "src_tokens": prefix[:, :0], "src_lengths": torch.zeros_like(sample["net_input"]["src_lengths"])}}
    return lambda: gen.generate([model], empty, prefix_tokens=prefix)


def predict(measured, length, model):
    """Seconds of one run at `length` from the runs measured so far [(length, seconds)].

    RFA: linear in the length. Softmax: a step costs a + b * t at position t, so a run costs
    a L + b L^2 / 2; fitted through the last two points (with one point, all quadratic: an
    upper bound)."""
    if not measured:
        return 0.0
    (l1, s1) = measured[-1]
    if model != "softmax":
        return s1 * length / l1
    if len(measured) == 1:
        return s1 * (length / l1) ** 2
    (l0, s0) = measured[-2]
    # s = a l + c l^2 through (l0, s0), (l1, s1)
    c = (s1 / l1 - s0 / l0) / (l1 - l0)
    a = s1 / l1 - c * l1
    if c <= 0 or a <= 0:
        return s1 * (length / l1) ** 2
    return a * length + c * length ** 2


class Contender:
    """One model under test, with what its runs need."""

    def __init__(self, name, args, data_dir, device):
        torch.manual_seed(0)
        self.name = name
        self.task, self.model = build(args.task, MODELS[args.task][name], data_dir,
                                      max(args.lengths) + args.prefix_len, tiny=args.tiny)
        self.model.to(device)
        self.spy = StateSpy(self.model)
        self.sample = make_sample(args.task, self.task, args.batch, args.src_len, args.prefix_len, device)
        self.measured = []  # (length, median seconds)

    def generator(self, args, length):
        return generate_fn(args.task, self.task, self.model, self.sample, args.beam, length, args.prefix_len)


def run(args):
    """Lengths in order; at each length the models take turns run by run (softmax, rfa, rfa_gate,
    softmax, ...), so a slow spell of a shared machine hits every model rather than one."""
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.threads:
        torch.set_num_threads(args.threads)
    tmp = fake_dictionary(tempfile.mkdtemp(), args.vocab)
    contenders = [Contender(name, args, tmp, device) for name in args.models]
    rows = []
    with torch.inference_mode():
        for c in contenders:
            c.generator(args, min(args.lengths))()  # warm-up
        for length in args.lengths:
            plan = {}
            for c in contenders:
                row = {"task": args.task, "model": c.name, "length": length, "batch": args.batch, "beam": args.beam}
                rows.append(row)
                guess = predict(c.measured, length, c.name)
                if guess > args.max_seconds:
                    row["skipped"] = f"predicted {guess:.0f} s per run > --max-seconds {args.max_seconds:g}"
                    print(f"{c.name:9s} length {length:5d}: skipped ({row['skipped']})", flush=True)
                    continue
                repeats = args.repeats if guess * args.repeats <= args.single_run_seconds else 1
                plan[c.name] = dict(c=c, row=row, fn=c.generator(args, length), repeats=repeats, times=[])
            for rep in range(max([p["repeats"] for p in plan.values()], default=0)):
                for name, p in plan.items():
                    if rep >= p["repeats"]:
                        continue
                    if rep == 0:
                        # The first run also measures memory: without the previous run's state
                        # alive, and without per-module sampling hooks (they cost ~8% of a step).
                        p["c"].spy.state = None
                        gc.collect()
                        with PeakMemory(device) as mem:
                            p["times"] += timed(p["fn"], device, repeats=1, warmup=0, clock=args.clock)
                        p["mem"] = mem
                    else:
                        p["times"] += timed(p["fn"], device, repeats=1, warmup=0, clock=args.clock)
            for name, p in plan.items():
                c, row, times, mem = p["c"], p["row"], p["times"], p["mem"]
                sec = STATISTICS[args.statistic](times)
                c.measured.append((length, sec))
                row.update(seconds=sec, runs=len(times), all_seconds=times,
                           tokens_per_s=args.batch * length / sec,
                           ms_per_step=1000 * sec / length,
                           peak_bytes=mem.peak_bytes, peak_rss_bytes=mem.peak_rss_bytes,
                           peak_live_bytes=mem.peak_live_bytes, state_bytes=state_bytes(c.spy.state))
                peak = "n/a" if mem.peak_bytes is None else f"{mem.peak_bytes / 2**20:8.1f} MiB"
                print(f"{name:9s} length {length:5d}: {row['tokens_per_s']:8.1f} tokens/s ({len(times)} runs), "
                      f"peak {peak}, state {row['state_bytes'] / 2**20:8.2f} MiB", flush=True)
    add_ratios(rows)
    return {"meta": dict(machine_info(device), args=vars(args)), "rows": rows}


def add_ratios(rows):
    base = {r["length"]: r for r in rows if r["model"] == "softmax" and "tokens_per_s" in r}
    for r in rows:
        b = base.get(r["length"])
        if b is not None and "tokens_per_s" in r:
            r["speed_ratio_to_softmax"] = r["tokens_per_s"] / b["tokens_per_s"]
            if r.get("peak_bytes") is not None and b.get("peak_bytes"):
                r["peak_ratio_to_softmax"] = r["peak_bytes"] / b["peak_bytes"]
    by_model = {}
    for r in rows:
        if "tokens_per_s" in r:
            by_model.setdefault(r["model"], {})[r["length"]] = r
    for model, per_len in by_model.items():
        first = per_len[min(per_len)]
        for r in per_len.values():
            # cost per generated token relative to the shortest length measured
            r["step_cost_vs_shortest"] = first["tokens_per_s"] / r["tokens_per_s"]


STATISTICS = {"median": median, "min": min}

# What docs/benchmarks.md reports: translation with beam 4 over 2 sentences; LM continuation of
# one prompt, greedy.
TASK_DEFAULTS = {
    "translation": {"lengths": [32, 128, 512, 2048, 4096], "batch": 2, "beam": 4},
    "lm": {"lengths": [128, 512, 2048, 8192], "batch": 1, "beam": 1},
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--task", choices=["translation", "lm"], default="translation")
    p.add_argument("--lengths", type=int, nargs="+",
                   help=f"default: {TASK_DEFAULTS['translation']['lengths']} (translation), "
                        f"{TASK_DEFAULTS['lm']['lengths']} (lm)")
    p.add_argument("--batch", type=int, help="source sentences (translation, default 2) or prompts (lm, default 1)")
    p.add_argument("--beam", type=int, help="default 4 (translation), 1 (lm: greedy continuation)")
    p.add_argument("--src-len", type=int, default=24, help="source tokens per sentence (translation)")
    p.add_argument("--prefix-len", type=int, default=16, help="prompt tokens (lm)")
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--single-run-seconds", type=float, default=120.0,
                   help="measure a length only once if its repeats would take longer than this")
    p.add_argument("--max-seconds", type=float, default=900.0,
                   help="skip a length whose single run is predicted to take longer than this")
    p.add_argument("--models", nargs="+", default=["softmax", "rfa", "rfa_gate"], choices=list(MODELS["translation"]))
    p.add_argument("--device", choices=["cpu", "cuda"])
    p.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                   help="wall: elapsed time (default); cpu: this process's CPU time, CPU only, best "
                        "with --threads 1 (idle threads spinning would count), for comparing short "
                        "lengths on a shared machine")
    p.add_argument("--statistic", choices=sorted(STATISTICS), default="median",
                   help="how runs combine into one time: median (default) or min (the least "
                        "disturbed run, with --clock cpu)")
    p.add_argument("--tiny", action="store_true", help="tiny models (for tests of this script)")
    p.add_argument("--out", help="write the results as JSON here")
    args = p.parse_args(argv)
    for name, value in TASK_DEFAULTS[args.task].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.task == "lm" and args.prefix_len < 1:
        p.error("--prefix-len must be at least 1 for --task lm")
    if min(args.lengths) < 1 or args.batch < 1 or args.beam < 1 or args.repeats < 1:
        p.error("--lengths, --batch, --beam and --repeats must be positive")
    if args.clock == "cpu" and (args.device or ("cuda" if torch.cuda.is_available() else "cpu")) != "cpu":
        p.error("--clock cpu measures CPU work only; use the wall clock on a GPU")
    return args


def main(argv=None):
    args = parse_args(argv)
    result = run(args)
    print("\nratio to softmax (tokens/s), peak memory ratio:")
    for r in result["rows"]:
        if r["model"] != "softmax" and "speed_ratio_to_softmax" in r:
            peak = r.get("peak_ratio_to_softmax")
            print(f"  {r['model']:9s} length {r['length']:5d}: {r['speed_ratio_to_softmax']:.2f}x"
                  + ("" if peak is None else f", peak memory {100 * peak:.1f}% of softmax"))
    if args.out:
        write_json(args.out, result["meta"], result["rows"])
    return result


if __name__ == "__main__":
    main()
