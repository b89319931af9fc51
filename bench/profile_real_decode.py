#!/usr/bin/env python
"""Where a decoding step of trained translation models goes, on a real test set (torch profiler).

Loads each checkpoint, decodes the first ``--batches`` batches of a binarised split with
fairseq's SequenceGenerator (the settings of fairseq-generate: beam search, the lengths the
model produces) under ``torch.profiler``, the first batch once beforehand as a warm-up. Every
decoder layer's ``self_attn``, ``encoder_attn`` and FFN, the beam reorder of the attention
states, the output projection and the encoder are marked as ranges, so each operator is counted
in the range that called it. Printed per model: milliseconds per decoding step (one
``decoder.forward`` call) by range and by operator inside the attention ranges, and the number
of operator calls per step, and the minor page faults per step (memory the operating system
maps afresh: every new large tensor on a CPU); with ``--out``, the same as JSON.

    python bench/profile_real_decode.py work/study/data/bin --source-lang de --target-lang en \\
        --model softmax=work/study/screen/softmax-seed1/checkpoint_best.pt \\
        --model rfa_gate=work/study/screen/gate_bias2-seed1/checkpoint_best.pt \\
        --threads 1 --out bench/results/profile_real_decode.json

Times are the profiler's CPU times (``self_cpu_time_total``), which include its own overhead of
a few microseconds per operator: compare models within one run, not with other benchmarks.
"""
import argparse
import os
import resource
import sys
from collections import defaultdict
from typing import Dict

import torch
from torch.profiler import ProfilerActivity, profile, record_function

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from bench.common import USER_DIR, machine_info, write_json  # noqa: E402

RANGE_PREFIX = "rfa_bench."


class Ranges:
    """Profiler ranges around modules (forward hooks) and methods (wrappers)."""

    def __init__(self):
        self._open = []

    def hook_module(self, module, name):
        def enter(mod, inputs):
            r = record_function(RANGE_PREFIX + name)
            r.__enter__()
            self._open.append(r)

        def leave(mod, inputs, output):
            self._open.pop().__exit__(None, None, None)

        module.register_forward_pre_hook(enter)
        module.register_forward_hook(leave)

    @staticmethod
    def wrap(owner, attr, name):
        original = getattr(owner, attr)

        def ranged(*a, **kw):
            with record_function(RANGE_PREFIX + name):
                return original(*a, **kw)

        setattr(owner, attr, ranged)


def mark(model, ranges: Ranges, steps: Dict[str, int]):
    dec = model.decoder
    for i, layer in enumerate(dec.layers):
        for attr in ("self_attn", "encoder_attn"):
            if getattr(layer, attr, None) is not None:
                ranges.hook_module(getattr(layer, attr), f"{attr}")
        ranges.hook_module(layer.fc1, "ffn")
        ranges.hook_module(layer.fc2, "ffn")
    original_forward = dec.forward

    def counted(*a, **kw):
        steps["steps"] += 1
        return original_forward(*a, **kw)

    dec.forward = counted
    ranges.wrap(dec, "output_layer", "output projection")
    ranges.wrap(model, "get_normalized_probs", "log-softmax")
    ranges.wrap(dec, "reorder_incremental_state_scripting", "state reorder")
    ranges.wrap(model.encoder, "forward_torchscript", "encoder")


def by_range(events, layers: int, steps: int):
    """Self CPU time (ms per step) and calls per step of every operator, by enclosing range."""
    table = defaultdict(lambda: defaultdict(lambda: [0.0, 0]))
    for e in events:
        if e.name.startswith(RANGE_PREFIX):
            continue
        parent, where = e.cpu_parent, "outside the marked ranges"
        while parent is not None:
            if parent.name.startswith(RANGE_PREFIX):
                where = parent.name[len(RANGE_PREFIX):]
                break
            parent = parent.cpu_parent
        cell = table[where][e.name]
        cell[0] += e.self_cpu_time_total / 1000.0
        cell[1] += 1
    return {where: {op: {"ms_per_step": ms / steps, "calls_per_step": calls / steps,
                         "calls_per_step_and_layer": calls / steps / layers}
                    for op, (ms, calls) in sorted(ops.items(), key=lambda kv: -kv[1][0])}
            for where, ops in table.items()}


def load(path, data, source_lang, target_lang):
    from fairseq import checkpoint_utils, utils

    utils.import_user_module(argparse.Namespace(user_dir=USER_DIR))
    overrides = {"data": data, "source_lang": source_lang, "target_lang": target_lang}
    models, cfg, task = checkpoint_utils.load_model_ensemble_and_task([path], arg_overrides=overrides)
    model = models[0].eval()
    return model, cfg, task


def batches(task, cfg, split, batch_size, limit):
    task.load_dataset(split)
    itr = task.get_batch_iterator(dataset=task.dataset(split), max_sentences=batch_size,
                                  max_positions=(1024, 1024), ignore_invalid_inputs=True, seed=1,
                                  num_workers=0).next_epoch_itr(shuffle=False)
    out = []
    for sample in itr:
        out.append(sample)
        if len(out) == limit + 1:
            break
    return out


def run_model(name, path, args):
    from fairseq.dataclass.configs import GenerationConfig

    model, cfg, task = load(path, args.data, args.source_lang, args.target_lang)
    gen_cfg = GenerationConfig(beam=args.beam, max_len_a=1.2, max_len_b=10)
    generator = task.build_generator([model], gen_cfg)
    samples = batches(task, cfg, args.subset, args.batch, args.batches)
    steps = {"steps": 0}
    ranges = Ranges()
    mark(model, ranges, steps)
    with torch.inference_mode():
        task.inference_step(generator, [model], samples[0])  # warm-up
        steps["steps"] = 0
        tokens = 0
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for sample in samples[1:]:
                hypos = task.inference_step(generator, [model], sample)
                tokens += sum(len(h[0]["tokens"]) for h in hypos)
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
    events = prof.events()
    total_ms = sum(e.self_cpu_time_total for e in events if not e.name.startswith(RANGE_PREFIX)) / 1000.0
    n = steps["steps"]
    layers = len(model.decoder.layers)
    ops = by_range(events, layers, n)
    row = {"model": name, "checkpoint": path, "decoder_layers": layers, "steps": n, "tokens": tokens,
           "ms_per_step": total_ms / n, "page_faults_per_step": faults / n,
           "ms_per_step_by_range": {w: sum(o["ms_per_step"] for o in v.values()) for w, v in ops.items()},
           "ops_per_step_by_range": {w: sum(o["calls_per_step"] for o in v.values()) for w, v in ops.items()},
           "ops": ops}
    return row


def report(rows, top):
    base = rows[0]
    for r in rows:
        print(f"\n{r['model']}: {r['ms_per_step']:.2f} ms per step ({r['steps']} steps, {r['tokens']} tokens; "
              f"x{r['ms_per_step'] / base['ms_per_step']:.2f} of {base['model']}'s time; "
              f"{r['page_faults_per_step']:.0f} minor page faults per step)")
        for where, ms in sorted(r["ms_per_step_by_range"].items(), key=lambda kv: -kv[1]):
            print(f"  {where:28s} {ms:7.3f} ms/step  {r['ops_per_step_by_range'][where]:6.1f} ops/step")
        for where in ("self_attn", "encoder_attn", "state reorder"):
            if where not in r["ops"]:
                continue
            print(f"  -- {where}, per layer and step: op, ms, calls")
            for op, v in list(r["ops"][where].items())[:top]:
                print(f"     {op:36s} {v['ms_per_step'] / r['decoder_layers']:7.4f} {v['calls_per_step_and_layer']:5.1f}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("data")
    p.add_argument("--source-lang", required=True)
    p.add_argument("--target-lang", required=True)
    p.add_argument("--model", action="append", required=True, metavar="NAME=CHECKPOINT")
    p.add_argument("--subset", default="test")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--beam", type=int, default=4)
    p.add_argument("--batches", type=int, default=3, help="batches profiled (after one warm-up batch)")
    p.add_argument("--threads", type=int)
    p.add_argument("--top", type=int, default=12)
    p.add_argument("--out")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    models = []
    for spec in args.model:
        name, sep, path = spec.partition("=")
        if not sep or not name or not os.path.exists(path):
            p.error(f"--model expects NAME=CHECKPOINT with an existing file, got {spec!r}")
        models.append((name, path))
    rows = [run_model(name, path, args) for name, path in models]
    report(rows, args.top)
    if args.out:
        write_json(args.out, dict(machine_info("cpu"), args=vars(args)), rows)
    return rows


if __name__ == "__main__":
    main()
