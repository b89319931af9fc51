#!/usr/bin/env python
"""Decoding speed and memory through fairseq's generation: softmax against RFA, side by side.

``synthetic``: random weights, the output length forced, the same sizes for all. ``--task
translation``: ``transformer_wmt_en_de`` (6+6 x 512) against ``rfa_transformer_wmt_en_de`` (``rfa*``:
RFA cross attention, the paper's; ``*_softcross``: fairseq's, the default; ``rfa_enc_*``: a linear
encoder too), beam search over ``--batch`` sources; ``--task lm``: ``transformer_lm`` against
``rfa_transformer_lm`` after a prompt. Per model and length: tokens/s (``--statistic`` of
``--repeats`` runs after a warm-up, the models taking turns run by run), the ``ratio`` to the first
model, the first run's peak memory (bench/harness.py) and the incremental state's bytes. Lengths
predicted over ``--single-run-seconds`` run once, over ``--max-seconds`` are skipped.
``checkpoint``: trained checkpoints on a binarised split, decoded as fairseq-generate does (its
flags after ``--``), each run in a fresh process: generated tokens over the seconds spent in
``task.inference_step``, the ratio to the first model, the peak memory (CUDA: max_memory_allocated;
CPU: the process's peak resident set). ``--profile``: one more run under torch.profiler, with
ranges (self_attn, encoder_attn, ffn, reorder, output, encoder, decoder_other): per range the
operators' CPU milliseconds and calls per decoding step.

    python bench/decode.py synthetic --task translation --lengths 32 512 --out tr.json
    python bench/decode.py checkpoint DATA_BIN --source-lang de --target-lang en \\
        --model softmax=a.pt --model rfa_gate=b.pt --repeats 3 --out real.json -- --beam 4 --batch-size 64
"""
import argparse
import gc
import multiprocessing
import os
import resource
import statistics
import sys
import tempfile
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile, record_function

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402

BASE = ["--decoder-embed-dim", "512", "--decoder-ffn-embed-dim", "2048", "--decoder-layers", "6",
        "--decoder-attention-heads", "8"]
TINY = [f"--{side}-{k}" if i % 2 == 0 else k for side in ("encoder", "decoder")
        for i, k in enumerate(["embed-dim", "32", "ffn-embed-dim", "64", "layers", "2", "attention-heads", "4"])]
RFA_MT = ["--arch", "rfa_transformer_wmt_en_de", "--cross-attention", "rfa"]
MODELS = {
    "translation": {"softmax": ["--arch", "transformer_wmt_en_de"], "rfa": RFA_MT, "rfa_gate": RFA_MT + ["--rfa-gate"],
                    "rfa_softcross": ["--arch", "rfa_transformer_wmt_en_de"],
                    "rfa_gate_softcross": ["--arch", "rfa_transformer_wmt_en_de", "--rfa-gate"],
                    **{f"rfa_enc_{kind}": RFA_MT + ["--encoder-attention", kind] for kind in ("rfa", "favor", "lara")}},
    "lm": {"softmax": ["--arch", "transformer_lm"] + BASE, "rfa": ["--arch", "rfa_transformer_lm"] + BASE,
           "rfa_gate": ["--arch", "rfa_transformer_lm", "--rfa-gate"] + BASE},
}
DEFAULTS = {"translation": dict(lengths=[32, 128, 512, 2048, 4096], batch=2, beam=4),
            "lm": dict(lengths=[128, 512, 2048, 8192], batch=1, beam=1)}
RANGE = "rfa_bench."


def mark(model):
    """Profiler ranges around the parts of a decoding step; returns a one-item list counting the steps."""
    steps = [0]

    def wrap(owner, attr, name, count=False):
        original = getattr(owner, attr)

        def ranged(*a, **kw):
            steps[0] += count
            with record_function(RANGE + name):
                return original(*a, **kw)
        setattr(owner, attr, ranged)

    for layer in model.decoder.layers:
        for attr, name in (("self_attn", "self_attn"), ("encoder_attn", "encoder_attn"), ("fc1", "ffn"), ("fc2", "ffn")):
            if getattr(layer, attr, None) is not None:
                wrap(getattr(layer, attr), "forward", name)
    for owner, attr, name in ((model.decoder, "output_layer", "output"), (model, "get_normalized_probs", "output"),
                              (model.decoder, "reorder_incremental_state_scripting", "reorder")):
        wrap(owner, attr, name)
    wrap(model.decoder, "forward", "decoder_other", count=True)
    if getattr(model, "encoder", None) is not None:
        wrap(model.encoder, "forward_torchscript", "encoder")
    return steps


def profiled(fn, steps, top=8):
    """Run ``fn`` under the profiler; every operator is counted in the innermost range around it."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        steps[0] = 0
        fn()
    n, cells = max(steps[0], 1), defaultdict(lambda: defaultdict(lambda: [0.0, 0.0]))
    for e in prof.events():
        p = e.cpu_parent
        while p is not None and not p.name.startswith(RANGE):
            p = p.cpu_parent
        if not e.name.startswith(RANGE):
            cell = cells["rest" if p is None else p.name[len(RANGE):]][e.name]
            cell[0], cell[1] = cell[0] + e.self_cpu_time_total / 1000 / n, cell[1] + 1 / n
    ms = {w: sum(c[0] for c in ops.values()) for w, ops in cells.items()}
    return {"steps": steps[0], "ms_per_step": sum(ms.values()), "ms_per_step_by_range": ms,
            "calls_per_step_by_range": {w: sum(c[1] for c in ops.values()) for w, ops in cells.items()},
            "top_ops": {w: sorted([[op, *c] for op, c in ops.items()], key=lambda x: -x[1])[:top] for w, ops in cells.items()}}


class Contender:
    """One synthetic model (random weights, seed 0), its fixed input, and the incremental state of its last run."""

    def __init__(self, args, name, data_dir):
        from fairseq import options, tasks

        self.name, self.args, self.state, self.last = name, args, None, None
        flags, n = list(MODELS[args.task][name]), max(args.lengths) + args.prefix_len + 16
        if args.tiny:
            flags = [f for f in flags if f not in BASE] + TINY[8 * (args.task == "lm"):]
        if args.task == "translation":
            flags += ["--task", "translation", "--source-lang", "src", "--target-lang", "tgt", "--share-all-embeddings",
                      "--max-target-positions", str(n), "--max-source-positions", str(args.src_len + 8)]
        else:
            flags += ["--task", "language_modeling", "--share-decoder-input-output-embed", "--tokens-per-sample", str(n)]
        parsed = options.parse_args_and_arch(options.get_training_parser(),
                                             [data_dir, "--user-dir", harness.user_dir(), "--dropout", "0"] + flags)
        torch.manual_seed(0)
        self.task = tasks.setup_task(parsed)
        self.model = self.task.build_model(parsed).eval().to(args.device)
        forward = self.model.decoder.forward

        def spy(*a, **kw):
            self.state = kw.get("incremental_state")
            return forward(*a, **kw)
        self.model.decoder.forward = spy
        self.steps = mark(self.model) if args.profile else None
        d = self.task.source_dictionary
        src = torch.randint(d.nspecial, len(d), (args.batch, args.src_len if args.task == "translation" else args.prefix_len),
                            generator=torch.Generator().manual_seed(0))
        if args.task == "translation":
            src[:, -1] = d.eos()
        self.src = src.to(args.device)

    def generator(self, length):
        """Generation of exactly ``length`` tokens (LM: after the prompt, forced as a prefix)."""
        from fairseq.sequence_generator import SequenceGenerator

        lm, n = self.args.task == "lm", self.src.size(1)
        total = length + n * lm
        gen = SequenceGenerator([self.model], self.task.target_dictionary, beam_size=self.args.beam,
                                max_len_a=0, max_len_b=total, min_len=total)
        net_input = {"src_tokens": self.src[:, :n * (not lm)], "src_lengths": torch.full((self.args.batch,), n * (not lm))}
        sample = {"id": torch.arange(self.args.batch), "net_input": net_input}
        return lambda: gen.generate([self.model], sample, prefix_tokens=self.src if lm else None)


def synthetic(args):
    """Lengths in turn; at each, the models take turns run by run, so a slow spell hits them all."""
    data_dir = harness.fake_dictionary(tempfile.mkdtemp(prefix="rfa_bench_"), args.vocab)
    contenders, rows = [Contender(args, name, data_dir) for name in args.models], []
    with torch.inference_mode():
        for c in contenders:
            c.generator(min(args.lengths))()  # warm-up
        for length in args.lengths:
            plan = []
            for c in contenders:
                rows.append(dict(model=c.name, task=args.task, length=length, batch=args.batch, beam=args.beam, times=[]))
                # one run's seconds, predicted from the last length: linear for RFA, quadratic for softmax
                guess = 0 if c.last is None else c.last[1] * (length / c.last[0]) ** (1 + (c.name == "softmax"))
                if guess > args.max_seconds:
                    rows[-1]["skipped"] = f"predicted {guess:.0f} s per run > --max-seconds {args.max_seconds:g}"
                else:
                    plan.append((c, rows[-1], c.generator(length), 1 if guess * args.repeats > args.single_run_seconds
                                 else args.repeats))
            for rep in range(args.repeats):
                for c, row, fn, repeats in plan:
                    if rep == 0:  # memory: the first run, without the previous run's state alive
                        c.state = None
                        gc.collect()
                        with harness.PeakMemory(args.device) as mem:
                            row["times"] += harness.timed(fn, args.device, clock=args.clock)
                        row.update(peak_bytes=mem.peak_bytes, state_bytes=sum(
                            t.numel() * t.element_size() for b in c.state.values() for t in b.values() if torch.is_tensor(t)))
                    elif rep < repeats:
                        row["times"] += harness.timed(fn, args.device, clock=args.clock)
            for c, row, fn, _ in plan:
                row["seconds"] = harness.STATISTICS[args.statistic](row["times"])
                row["tokens_per_s"], c.last = args.batch * length / row["seconds"], (length, row["seconds"])
                if args.profile:
                    row["profile"] = profiled(fn, c.steps)
                print(f"{c.name:18s} {length:6d}: {row['tokens_per_s']:9.1f} tokens/s ({len(row['times'])} runs), "
                      f"peak {harness.mib(row['peak_bytes'])} MiB, state {harness.mib(row['state_bytes'])} MiB", flush=True)
    return harness.add_ratios(rows, args.models[0])


def decode_checkpoint(path, argv, threads, clock, do_profile, max_batches):
    """Decode a split with one checkpoint as fairseq-generate does (run in a fresh process)."""
    from fairseq import checkpoint_utils, options, tasks, utils
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf

    if threads:
        torch.set_num_threads(threads)
    cfg = convert_namespace_to_omegaconf(options.parse_args_and_arch(options.get_generation_parser(), argv + ["--path", path]))
    utils.import_user_module(cfg.common)
    if cfg.dataset.max_tokens is None and cfg.dataset.batch_size is None:
        cfg.dataset.max_tokens = 12000
    cuda = torch.cuda.is_available() and not cfg.common.cpu
    task = tasks.setup_task(cfg.task)
    models, saved = checkpoint_utils.load_model_ensemble([path], arg_overrides=eval(cfg.common_eval.model_overrides), task=task)
    task.load_dataset(cfg.dataset.gen_subset, task_cfg=saved.task)
    model = models[0].cuda() if cuda else models[0]
    model.prepare_for_inference_(cfg)
    generator = task.build_generator([model], cfg.generation)
    batches = list(task.get_batch_iterator(
        dataset=task.dataset(cfg.dataset.gen_subset), max_tokens=cfg.dataset.max_tokens,
        max_sentences=cfg.dataset.batch_size, seed=cfg.common.seed,
        max_positions=utils.resolve_max_positions(task.max_positions(), model.max_positions()),
        ignore_invalid_inputs=cfg.dataset.skip_invalid_size_inputs_valid_test,
        required_batch_size_multiple=cfg.dataset.required_batch_size_multiple).next_epoch_itr(shuffle=False))
    batches = [utils.move_to_cuda(b) if cuda else b for b in batches[:max_batches]]
    row, hypos = dict(sentences=0, tokens=0, seconds=0.0), []
    with torch.no_grad():
        for sample in batches:
            row["seconds"] += harness.timed(lambda: hypos.append(task.inference_step(generator, [model], sample)),
                                            "cuda" if cuda else "cpu", clock=clock)[0]
            row["sentences"] += sample["id"].numel()
            row["tokens"] += sum(len(h[0]["tokens"]) for h in hypos.pop())
        row["peak_bytes"] = torch.cuda.max_memory_allocated() if cuda else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        row["memory"] = "cuda max_memory_allocated" if cuda else "peak resident set of the decoding process"
        if do_profile:
            steps = mark(model)
            row["profile"] = profiled(lambda: [task.inference_step(generator, [model], s) for s in batches], steps)
    return row


def checkpoint(args):
    """Each model decodes in a fresh process per repeat, the models taking turns (order reversed every other repeat)."""
    argv = [args.data, "--user-dir", args.user_dir, "--task", "translation", "--source-lang", args.source_lang,
            "--target-lang", args.target_lang, "--gen-subset", "test"] + args.generate_flags
    runs, spawn = {name: [] for name, _ in args.model}, multiprocessing.get_context("spawn")
    for rep in range(args.repeats):
        for name, path in args.model if rep % 2 == 0 else args.model[::-1]:
            with spawn.Pool(1) as pool:
                r = pool.apply(decode_checkpoint, (path, argv, args.threads, args.clock, args.profile and rep == 0,
                                                   args.max_batches))
            runs[name].append(r)
            print(f"{name}: {r['sentences']} sentences, {r['tokens']} tokens in {r['seconds']:.1f} s, "
                  f"peak {harness.mib(r['peak_bytes'])} MiB", file=sys.stderr)
    rows, pick = [], statistics.median_low if args.statistic == "median" else min
    for name, path in args.model:
        times = [r["seconds"] for r in runs[name]]
        row = dict(next(r for r in runs[name] if r["seconds"] == pick(times)), model=name, checkpoint=path,
                   runs=len(times), times=times, peak_bytes=max(r["peak_bytes"] for r in runs[name]))
        row.update(tokens_per_s=row["tokens"] / row["seconds"], sentences_per_s=row["sentences"] / row["seconds"])
        row.update(next(({"profile": r["profile"]} for r in runs[name] if "profile" in r), {}))
        rows.append(row)
    harness.add_ratios(rows, rows[0]["model"], group=())
    return harness.add_ratios(rows, rows[0]["model"], key="peak_bytes", field="memory_ratio", group=())


def model_spec(text):
    if "=" not in text or not text.split("=", 1)[0] or not os.path.isfile(text.split("=", 1)[1]):
        raise argparse.ArgumentTypeError(f"wants NAME=CHECKPOINT with an existing checkpoint file, got {text!r}")
    return tuple(text.split("=", 1))


def parse_args(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    own, rest = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    modes = p.add_subparsers(dest="mode", required=True)
    s = modes.add_parser("synthetic", help="random weights, forced output lengths")
    s.add_argument("--task", choices=sorted(MODELS), default="translation")
    s.add_argument("--models", nargs="+", help="the first is the reference of the ratios (default: softmax rfa rfa_gate)")
    s.add_argument("--lengths", type=harness.positive, nargs="+", help=f"output tokens (default {DEFAULTS})")
    s.add_argument("--batch", type=harness.positive, help="sources or prompts (default 2 translation, 1 lm)")
    s.add_argument("--beam", type=harness.positive, help="default 4 (translation), 1 (lm: greedy)")
    s.add_argument("--src-len", type=harness.positive, default=24, help="source tokens (translation)")
    s.add_argument("--prefix-len", type=harness.positive, default=16, help="prompt tokens (lm)")
    s.add_argument("--vocab", type=harness.positive, default=32000)
    s.add_argument("--single-run-seconds", type=float, default=120.0, help="one run where the repeats would take longer")
    s.add_argument("--max-seconds", type=float, default=900.0, help="skip a length whose run is predicted longer")
    s.add_argument("--tiny", action="store_true", help="2 layers of 32 dimensions (for tests)")
    c = modes.add_parser("checkpoint", help="trained checkpoints on a binarised split; fairseq-generate flags after --")
    c.add_argument("data", help="fairseq data-bin folder")
    c.add_argument("--model", type=model_spec, action="append", required=True, metavar="NAME=CHECKPOINT",
                   help="repeatable; the first is the reference of the ratios")
    for side in ("--source-lang", "--target-lang"):
        c.add_argument(side, required=True)
    c.add_argument("--user-dir", default=harness.user_dir())
    c.add_argument("--max-batches", type=harness.positive, help="decode only the first N batches")
    for sub in (s, c):
        harness.common_flags(sub, repeats=3 if sub is s else 1)
        sub.add_argument("--profile", action="store_true", help="one more run under torch.profiler, by range")
    args = p.parse_args(own)
    harness.setup(modes.choices[args.mode], args)
    if args.mode == "checkpoint":
        if not os.path.isdir(args.data):
            c.error(f"no data folder {args.data}")
        args.generate_flags = rest + (["--cpu"] if args.device == "cpu" and torch.cuda.is_available() else [])
        return args
    if rest:
        s.error(f"synthetic takes no flags after --: {' '.join(rest)}")
    for name, value in dict(DEFAULTS[args.task], models=["softmax", "rfa", "rfa_gate"]).items():
        setattr(args, name, value if getattr(args, name) is None else getattr(args, name))
    if set(args.models) - set(MODELS[args.task]):
        s.error(f"--models: {args.task} models are {', '.join(MODELS[args.task])}")
    return args


def main(argv=None):
    args = parse_args(argv)
    rows = synthetic(args) if args.mode == "synthetic" else checkpoint(args)
    meta = dict(harness.machine(args.device, ["decode.py"] + (sys.argv[1:] if argv is None else argv)),
                bench=f"decode-{args.mode}", reference=rows[0]["model"], args={k: v for k, v in vars(args).items() if k != "model"})
    if args.mode == "checkpoint":
        meta.update(models=dict(args.model), generate_flags=args.generate_flags, memory=rows[0]["memory"])
    if args.out:
        harness.write_json(args.out, meta, rows)
    return rows


if __name__ == "__main__":
    main()
