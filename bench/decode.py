#!/usr/bin/env python
"""Decoding speed and memory, softmax against RFA side by side (docs/benchmarks.md): ``synthetic`` (random weights, forced
lengths), ``checkpoint`` (trained checkpoints decoded as fairseq-generate does, its flags after ``--``):
    python bench/decode.py synthetic --task translation --lengths 32 512 --out tr.json
    python bench/decode.py checkpoint DATA_BIN --source-lang de --target-lang en --model softmax=a.pt --model rfa_gate=b.pt \\
        --model rfa_gate_int8=int8:b.pt --model ct2_int8=ct2:a.pt:int8 --repeats 3 --out real.json -- --beam 4 --batch-size 64
"""
import argparse
import gc
import importlib.util
import multiprocessing
import os
import statistics
import sys
import tempfile
import time

import torch

from rfa_fairseq.inference import to_decoding_form_
from rfa_fairseq.modules import CrossRFAttention

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402
from report import mib  # noqa: E402

BASE = ["--decoder-embed-dim", "512", "--decoder-ffn-embed-dim", "2048", "--decoder-layers", "6",
        "--decoder-attention-heads", "8"]
SIZES = {name: [f"--{side}-{k}" if i % 2 == 0 else k for side in ("encoder", "decoder") for i, k in enumerate(
    ["embed-dim", dim, "ffn-embed-dim", ffn, "layers", "2", "attention-heads", "4"])] for name, dim, ffn in
    (("tiny", "32", "64"), ("screen", "256", "512"))}  # screen: results/documents.py's trained models
WORDS = {None: 32000, "tiny": 60, "screen": 6008}  # the dictionary's size (screen: the trained models')
MT, LM = ["--arch", "rfa_transformer_wmt_en_de"], ["--arch", "rfa_transformer_lm"]
RFA_MT = MT + ["--cross-attention", "rfa"]  # the paper's: RFA cross attention (*_softcross: fairseq's, the default)
MODELS = {
    "translation": {"softmax": ["--arch", "transformer_wmt_en_de"], "rfa": RFA_MT, "rfa_gate": RFA_MT + ["--rfa-gate"],
                    "rfa_softcross": MT, "rfa_gate_softcross": MT + ["--rfa-gate"],
                    "softmax_plugin": MT + ["--decoder-attention", "softmax"],  # fairseq's softmax, the plugin's cross attention
                    **{f"rfa_enc_{kind}": RFA_MT + ["--encoder-attention", kind] for kind in ("rfa", "favor", "lara")},
                    "gate_sentidx": MT + ["--rfa-gate", "--sentence-index"],
                    "softmax_sentidx": MT + ["--decoder-attention", "softmax", "--sentence-index"],
                    "gate_sentidx_window1": MT + ["--rfa-gate", "--sentence-index", "--cross-sentence-window", "1"],
                    "rfa_gate_graphs": RFA_MT + ["--rfa-gate", "--cuda-graphs"],
                    "rfa_gate_softcross_graphs": MT + ["--rfa-gate", "--cuda-graphs"]},
    "lm": {"softmax": ["--arch", "transformer_lm"] + BASE, "rfa": LM + BASE, "rfa_gate": LM + ["--rfa-gate"] + BASE,
           "rfa_gate_graphs": LM + ["--rfa-gate", "--cuda-graphs"] + BASE,
           "rfa_gate_conv4": LM + ["--rfa-gate", "--rfa-short-conv", "4"] + BASE},
}
DEFAULTS = {"translation": dict(lengths=[32, 128, 512, 2048, 4096], batch=2, beam=4),
            "lm": dict(lengths=[128, 512, 2048, 8192], batch=1, beam=1)}
PROMPT = 16  # the LM prompt's tokens
CT2_TYPES = ("int8", "int8_float32", "int8_float16", "int8_bfloat16", "int16", "float32", "float16", "bfloat16")


class Contender:  # one synthetic model (random weights, seed 0), its fixed input, and the incremental state of its last run

    def __init__(self, args, name, data_dir):
        self.name, self.args, self.state, self.last = name, args, None, None
        flags, n, mt = list(MODELS[args.task][name]), max(args.lengths) + PROMPT + 16, args.task == "translation"
        if args.size:
            flags = [f for f in flags if f not in BASE] + SIZES[args.size][8 * (not mt):]
        source = max(args.lengths) if args.documents else args.src_len
        flags += ["--no-sentence-alignment"] * ("--sentence-index" in flags)  # forced outputs, whatever their sentences
        flags += ["--task", "translation", "--source-lang", "src", "--target-lang", "tgt", "--share-all-embeddings",
                  "--max-target-positions", str(n), "--max-source-positions", str(source + 8)] if mt else [
            "--task", "language_modeling", "--share-decoder-input-output-embed", "--tokens-per-sample", str(n)]
        self.model, self.task, _ = harness.build_model([data_dir, "--dropout", "0"] + flags)
        self.model = self.model.eval().to(args.device)
        if hasattr(m := self.model, "compiled_step"):  # the plugin's models: the step engine their flags name
            to_decoding_form_(m, m.int8_inference, m.cuda_graphs, m.int8_min_weights, m.compiled_step)
        forward = self.model.decoder.forward

        def spy(*a, **kw):
            self.state = kw.get("incremental_state")
            return forward(*a, **kw)
        self.model.decoder.forward = spy
        d = self.task.source_dictionary
        src = torch.randint(d.nspecial, len(d), (args.batch, args.src_len if mt else PROMPT),
                            generator=torch.Generator().manual_seed(0))
        if mt:
            src[:, -1] = d.eos()
        self.src = src.to(args.device)

    def state_bytes(self) -> dict:
        """The last run's decoding state: all of it, and the part that cross attention keeps of the source."""
        cross = {m._incremental_state_id for m in self.model.modules()
                 if getattr(m, "encoder_decoder_attention", False) or isinstance(m, CrossRFAttention)}
        sizes = [(name.split(".")[0] in cross, t.numel() * t.element_size())
                 for name, fields in self.state.items() for t in fields.values() if torch.is_tensor(t)]
        return dict(state_bytes=sum(n for _, n in sizes), source_state_bytes=sum(n for source, n in sizes if source))

    def generator(self, length):
        """Generation of exactly ``length`` tokens (LM: after the prompt, forced as a prefix; --documents: of a source
        of ``length`` tokens, the output forced, both with a <sep> every --documents tokens)."""
        from fairseq.sequence_generator import SequenceGenerator
        lm, src, prefix = self.args.task == "lm", self.src, None
        if self.args.documents:
            src, prefix = (self.document(length, seed) for seed in (1, 2))
            src[:, -1] = self.task.source_dictionary.eos()
        n = src.size(1)
        total = length + n * lm
        gen = SequenceGenerator([self.model], self.task.target_dictionary, beam_size=self.args.beam,
                                max_len_a=0, max_len_b=total, min_len=total)
        net_input = {"src_tokens": src[:, :n * (not lm)], "src_lengths": torch.full((self.args.batch,), n * (not lm))}
        sample = {"id": torch.arange(self.args.batch), "net_input": net_input}
        return lambda: gen.generate([self.model], sample, prefix_tokens=src if lm else prefix)

    def document(self, length, seed):  # random words, a <sep> every --documents tokens
        d = self.task.source_dictionary
        tokens = torch.randint(d.nspecial + 1, len(d), (self.args.batch, length), generator=torch.Generator().manual_seed(seed))
        tokens[:, self.args.documents - 1::self.args.documents] = d.index("<sep>")
        return tokens.to(self.args.device)


def attempt(run):  # None, or why ``run()`` failed
    try:
        run()
    except Exception as e:
        return harness.failure(e)


def synthetic(args):  # lengths in turn; at each, the models take turns run by run, so a slow spell hits them all
    data_dir = harness.fake_dictionary(WORDS[args.size])
    contenders, rows = [Contender(args, name, data_dir) for name in args.models], []
    with torch.inference_mode():
        for c in contenders:
            c.failed = attempt(c.generator(min(args.lengths)))  # warm-up
        for length in args.lengths:
            plan = []
            for c in contenders:
                rows.append(dict(model=c.name, task=args.task, length=length, batch=args.batch, beam=args.beam, times=[]))
                # one run's seconds, predicted from the last length: linear for RFA, quadratic for softmax
                guess = 0 if c.last is None else c.last[1] * (length / c.last[0]) ** (1 + (c.name == "softmax"))
                if c.failed:
                    rows[-1]["error"] = c.failed
                elif guess > args.max_seconds:
                    rows[-1]["skipped"] = f"predicted {guess:.0f} s per run > --max-seconds {args.max_seconds:g}"
                else:
                    plan.append((c, rows[-1], c.generator(length), 1 if guess * args.repeats > args.single_run_seconds
                                 else args.repeats))
            for rep in range(args.repeats):
                for c, row, fn, repeats in plan:
                    run = lambda: row["times"].extend(harness.timed(fn, args.device, clock=args.clock))  # noqa: E731
                    if c.failed or rep >= repeats:
                        continue
                    if rep == 0:  # memory: the first run, without the previous run's state alive
                        c.state = None
                        gc.collect()
                        with harness.PeakMemory(args.device) as mem:
                            c.failed = attempt(run)
                        row.update(peak_bytes=mem.peak_bytes, **({} if c.failed else c.state_bytes()))
                    else:
                        c.failed = attempt(run)
            for c, row, fn, _ in plan:
                if c.failed:
                    row["error"] = c.failed
                    continue
                row["seconds"] = harness.STATISTICS[args.statistic](row["times"])
                row["tokens_per_s"], c.last = args.batch * length / row["seconds"], (length, row["seconds"])
                print(f"{c.name:18s} {length:6d}: {row['tokens_per_s']:9.1f} tokens/s ({len(row['times'])} runs), "
                      f"peak {mib(row['peak_bytes'])} MiB, state {mib(row['state_bytes'])} MiB (the source's "
                      f"{mib(row['source_state_bytes'])})", flush=True)
    return harness.add_ratios(rows, args.models[0])


def convert_for_ctranslate2(checkpoint, data, out_dir, source_lang=None, target_lang=None, quantization=None,
                            max_positions=None, user_dir=None):
    """A softmax checkpoint (``transformer*``, ``transformer_lm*`` without adaptive softmax) as a CTranslate2 model."""
    from ctranslate2.converters import FairseqConverter
    from fairseq import checkpoint_utils
    from omegaconf import OmegaConf
    state, tmp = checkpoint_utils.load_checkpoint_to_cpu(checkpoint), out_dir.rstrip("/") + ".fairseq.pt"
    args, cfg = state["args"], state.get("cfg")  # the converter wants one namespace, the task's fields with the model's
    args = args or (cfg.model if isinstance(cfg.model, argparse.Namespace) else argparse.Namespace(**{
        **OmegaConf.to_container(cfg.task, resolve=True), **OmegaConf.to_container(cfg.model, resolve=True),
        "task": cfg.task._name, "arch": cfg.model._name}))
    if getattr(args, "adaptive_softmax_cutoff", None) or getattr(args, "adaptive_input", False):
        raise ValueError(f"{checkpoint}: CTranslate2 converts no adaptive softmax or adaptive input")
    args.max_target_positions = max(max_positions or 0, getattr(args, "max_target_positions", None) or 0) or None
    torch.save(dict(state, args=args, cfg=None), tmp)
    try:
        return FairseqConverter(tmp, data, source_lang, target_lang, user_dir=user_dir, unsafe_deserialization=True
                                ).convert(out_dir, quantization=quantization, force=True)
    finally:
        os.remove(tmp)


def decode_checkpoint(model, argv, args):
    """One model's run (in a fresh process): translation as fairseq-generate does; LMs, ``--lengths`` tokens a prompt."""
    from fairseq import checkpoint_utils, options, sequence_generator, tasks, utils
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf
    (path, ct2, forms), lm = model, args.task == "language_modeling"
    cfg = convert_namespace_to_omegaconf(options.parse_args_and_arch(options.get_generation_parser(), argv + ["--path", path]))
    utils.import_user_module(cfg.common)
    utils.set_torch_seed(cfg.common.seed)
    if cfg.dataset.max_tokens is None and cfg.dataset.batch_size is None:
        cfg.dataset.max_tokens, cfg.dataset.batch_size = (None, 1) if lm else (12000, None)
    cuda, g, split = torch.cuda.is_available() and not cfg.common.cpu, cfg.generation, cfg.dataset.gen_subset
    src, tgt = (task := tasks.setup_task(cfg.task)).source_dictionary, task.target_dictionary
    if args.threads:
        torch.set_num_threads(args.threads)
    if ct2:
        (ctranslate2 := importlib.import_module("ctranslate2")).set_random_seed(cfg.common.seed)
        loading = time.perf_counter()  # the converted model's load, as the compiled step's (setup_seconds)
        engine = (ctranslate2.Generator if lm else ctranslate2.Translator)(
            path, device="cuda" if cuda else "cpu", compute_type=ct2, intra_threads=args.threads or 0)
        loading = time.perf_counter() - loading
        task.load_dataset(split)
        limit = task.max_positions()
        translate = lambda s: [[tgt.index(t) for t in r.hypotheses[0]] for r in engine.translate_batch(  # noqa: E731
            [[src[t] for t in utils.strip_pad(x, src.pad()).tolist()[:-1]] for x in s["net_input"]["src_tokens"]],
            beam_size=g.beam, length_penalty=g.lenpen, max_input_length=0, min_decoding_length=g.min_len,
            max_decoding_length=min(int(g.max_len_a * s["net_input"]["src_tokens"].size(1) + g.max_len_b), limit[1] - 1))]
        generate = lambda p, n: [r.sequences_ids[0] for r in engine.generate_batch(  # noqa: E731
            [[tgt[tgt.eos()]] + [tgt[t] for t in x.tolist()] for x in p], max_length=n, min_length=n,
            include_prompt_in_result=False, beam_size=g.beam, sampling_temperature=g.temperature,
            sampling_topk=max(g.sampling_topk, 0) if g.sampling else 1, sampling_topp=max(g.sampling_topp, 0) or 1)]
    else:
        overrides = dict(eval(cfg.common_eval.model_overrides), **({"max_target_positions": args.positions} if lm else {}))
        models, saved = checkpoint_utils.load_model_ensemble([path], arg_overrides=overrides, task=task)
        task.load_dataset(split, task_cfg=saved.task)
        net = models[0].cuda() if cuda else models[0]
        net.prepare_for_inference_(cfg)
        to_decoding_form_(net, int8="int8" in forms, cuda_graphs=False, compiled_step="compiled" in forms)
        limit = utils.resolve_max_positions(task.max_positions(), net.max_positions())
        generator, generators = task.build_generator([net], g, sequence_generator.SequenceGenerator if "fairseq" in forms else None), {}
        for n in args.lengths if lm else ():
            g.min_len, g.max_len_a, g.max_len_b = args.prompt_tokens + n, 0, args.prompt_tokens + n
            generators[n] = task.build_generator([net], g)
        translate = lambda s: [h[0]["tokens"][:-1].tolist() for h in task.inference_step(generator, [net], s)]  # noqa: E731
        generate = lambda p, n: [h[0]["tokens"][p.size(1):-1].tolist() for h in generators[n].generate(  # noqa: E731
            [net], {"net_input": {"src_tokens": p[:, :0], "src_lengths": torch.zeros(len(p))}}, prefix_tokens=p)]
    if lm:  # prompts: the first tokens of the first blocks, </s> left out (a forced </s> would end the output)
        blocks = [task.dataset(split)[i]["source"] for i in range(min(args.prompts, len(task.dataset(split))))]
        prompts = [b[b.ne(tgt.eos())][:args.prompt_tokens] for b in blocks]
        if len(prompts) < args.prompts or min(map(len, prompts)) < args.prompt_tokens:
            raise ValueError(f"--prompts {args.prompts} --prompt-tokens {args.prompt_tokens}: the {split} split has {len(prompts)} "
                             f"blocks, the shortest {min(map(len, prompts))} tokens other than </s>")
        batches = [torch.stack(prompts[i:i + cfg.dataset.batch_size]) for i in range(0, args.prompts, cfg.dataset.batch_size)]
    else:
        batches = list(task.get_batch_iterator(
            dataset=task.dataset(split), max_tokens=cfg.dataset.max_tokens, max_sentences=cfg.dataset.batch_size,
            seed=cfg.common.seed, max_positions=limit, ignore_invalid_inputs=cfg.dataset.skip_invalid_size_inputs_valid_test,
            required_batch_size_multiple=cfg.dataset.required_batch_size_multiple).next_epoch_itr(shuffle=False))
    batches = [utils.move_to_cuda(b) if cuda else b for b in batches[:args.max_batches]]
    parts, device = [], "cuda" if cuda else "cpu"  # (length or None, seconds, peak, outputs by id, growth)
    with torch.no_grad():
        if not lm:  # an untimed warm-up batch, lest one-time costs land in the first bucket; the engines' loads
            translate(batches[0])  # are reported beside the batches' times (engine_setup_s), in none of them
        setup = loading if ct2 else 0.0 if lm else getattr(getattr(net.decoder, "step_engine", None), "setup_seconds", 0.0)
        for n in sorted(args.lengths) if lm else [None]:
            for i, b in enumerate(batches):
                out, start = [], harness.reset_peak(device)  # the peak (CUDA: torch's, blind to CTranslate2) above the start
                seconds = harness.timed(lambda: out.extend(generate(b, n) if lm else translate(b)), device, clock=args.clock)[0]
                peak = (None if ct2 else torch.cuda.max_memory_allocated()) if cuda else harness.status_bytes("VmHWM")
                ids = range(i * cfg.dataset.batch_size, i * cfg.dataset.batch_size + len(b)) if lm else b["id"].tolist()
                parts.append((n, seconds, peak, dict(zip(ids, out)), None if peak is None else max(peak - start, 0)))
    rows = []
    for n in sorted(args.lengths) if lm else [None]:
        row = summary([p for p in parts if p[0] == n], not lm)
        if lm:
            row.update(length=n, prompts=args.prompts, generated=sorted({len(o) for o in row["_out"]}))
        else:
            edges, reference = [0] + args.bucket_edges + [None], lambda i: len(task.dataset(split)[i]["target"])
            row["buckets"] = [dict(summary(got, True), bucket=f"{lo + 1}-{hi}" if hi else f"{lo + 1}+", bucket_from=lo + 1)
                              for lo, hi in zip(edges, edges[1:]) if (got := [p for p in parts if lo < max(
                                  map(reference, p[3])) <= (hi or float("inf"))])]  # every engine's the same batches
            refs = [tgt.string(task.dataset(split)[i]["target"], cfg.common_eval.post_process, escape_unk=True) for i in row["_ids"]]
            hyps = [tgt.string(torch.tensor(o, dtype=torch.long), cfg.common_eval.post_process) for o in row["_out"]]
            row["bleu"] = __import__("sacrebleu").corpus_bleu(hyps, [refs]).score
        rows.append(dict(row, memory="cuda max_memory_allocated" if cuda else "peak resident set of the decoding process",
                         engine_setup_s=round(setup, 3)))
    return rows


def summary(parts, eos):
    out = dict(sorted((k, v) for p in parts for k, v in p[3].items()))
    peaks, growth = [p[2] for p in parts if p[2] is not None], [p[4] for p in parts if p[4] is not None]
    return dict(sentences=len(out), tokens=sum(len(o) + eos for o in out.values()), seconds=sum(p[1] for p in parts), _ids=list(out),
                peak_bytes=max(peaks) if peaks else None, decode_bytes=max(growth) if growth else None, _out=list(out.values()))


def checkpoint(args):
    """Each model decodes in a fresh process per repeat, the models taking turns (order reversed every other repeat)."""
    mt = [] if args.task == "language_modeling" else ["--source-lang", args.source_lang, "--target-lang", args.target_lang]
    argv = [args.data, "--user-dir", args.user_dir, "--task", args.task, "--gen-subset", "test"] + mt + args.generate_flags
    runs, spawn, converted = {m[0]: [] for m in args.model}, multiprocessing.get_context("spawn"), {}
    with tempfile.TemporaryDirectory(ignore_cleanup_errors=True) as tmp:
        for path in {path for _, path, ct2, _ in args.model if ct2 and os.path.isfile(path)}:  # checkpoints for CTranslate2
            converted[path] = convert_for_ctranslate2(path, args.data, os.path.join(tmp, str(len(converted))), args.source_lang,
                                                      args.target_lang, max_positions=args.positions, user_dir=args.user_dir)
        for rep in range(args.repeats):
            for name, path, ct2, forms in args.model if rep % 2 == 0 else args.model[::-1]:
                with spawn.Pool(1) as pool:
                    got = pool.apply(decode_checkpoint, ((converted.get(path, path) if ct2 else path, ct2, forms), argv, args))
                runs[name].append(got)
                for r in got:
                    print(f"{name} {r.get('length', '')}: {r['sentences']} sentences, {r['tokens']} tokens in {r['seconds']:.1f} s, "
                          f"peak {mib(r['peak_bytes'])} MiB", file=sys.stderr)
    rows, pick = [], statistics.median_low if args.statistic == "median" else min
    for name, path, ct2, forms in args.model:
        for j, same in enumerate(zip(*runs[name])):
            times = [r["seconds"] for r in same]
            most = {k: max((r[k] for r in same if r[k] is not None), default=None) for k in ("peak_bytes", "decode_bytes")}
            row = dict(next(r for r in same if r["seconds"] == pick(times)), model=name, checkpoint=path, runs=len(times),
                       times=times, **most, engine=f"ctranslate2 {ct2}" if ct2 else " ".join(("fairseq",) + forms))
            row.update(tokens_per_s=row["tokens"] / row["seconds"], sentences_per_s=row["sentences"] / row["seconds"])
            first = runs[args.model[0][0]][0][j]  # outputs identical to the first model's (its first run), sentence by sentence
            row["same_as_first"] = sum(a == b for a, b in zip(first["_out"], same[0]["_out"])) / max(len(first["_out"]), 1)
            for b in row.get("buckets", ()):
                b.update(model=name, tokens_per_s=b["tokens"] / b["seconds"]), b.pop("_ids"), b.pop("_out")
            rows.append({k: v for k, v in row.items() if not k.startswith("_")})
    buckets = [b for r in rows for b in r.get("buckets", ())]
    for items, group in ((rows, ("length",)), (buckets, ("bucket",))):
        for key, field in (("tokens_per_s", "ratio"), ("peak_bytes", "memory_ratio"), ("decode_bytes", "decode_memory_ratio")):
            harness.add_ratios(items, rows[0]["model"], key=key, field=field, group=group)
    return rows


def model_spec(text):
    name, _, where = text.partition("=")
    forms = ()  # int8: --int8-inference; compiled: --compiled-step; fairseq: fairseq's SequenceGenerator
    while not where.startswith("ct2:") and where.partition(":")[0] in ("int8", "compiled", "fairseq"):
        form, _, where = where.partition(":")
        forms += (form,)
    path, ct2 = where[4:].rpartition(":")[::2] if where.startswith("ct2:") else (where, None)
    if not name or ct2 not in (None,) + CT2_TYPES or not (os.path.isfile(path) or ct2 and os.path.isfile(f"{path}/model.bin")):
        raise argparse.ArgumentTypeError(f"wants NAME=CHECKPOINT (an existing fairseq checkpoint), NAME=[int8:|compiled:]CHECKPOINT or "
                                         f"NAME=ct2:PATH:COMPUTE_TYPE (PATH: a CTranslate2 model folder or a softmax checkpoint; "
                                         f"COMPUTE_TYPE: {', '.join(CT2_TYPES)}), got {text!r}")
    return name, path, ct2, forms


def parse_args(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    own, rest = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    modes = p.add_subparsers(dest="mode", required=True)
    s = modes.add_parser("synthetic", help="random weights, forced output lengths")
    s.add_argument("--task", choices=sorted(MODELS), default="translation")
    s.add_argument("--models", nargs="+", help="the first is the reference of the ratios (default: softmax rfa rfa_gate)")
    for flag, text in (("lengths", "output tokens"), ("batch", "sources or prompts"), ("beam", "1: greedy")):
        s.add_argument("--" + flag, type=harness.positive, nargs="+" if flag == "lengths" else None,
                       help=f"{text} (default: " + ", ".join(f"{task} {d[flag]}" for task, d in DEFAULTS.items()) + ")")
    s.add_argument("--src-len", type=harness.positive, default=24, help="source tokens (translation)")
    s.add_argument("--single-run-seconds", type=float, default=120.0, help="one run where the repeats would take longer")
    s.add_argument("--max-seconds", type=float, default=900.0, help="skip a length whose run is predicted longer")
    s.add_argument("--size", choices=sorted(SIZES), help="2+2 layers: tiny, 32 dimensions and 60 words (tests); screen, "
                   "256 dimensions and 6,008 words (results/documents.py's models). Default: the architecture's, 32,000 words")
    s.add_argument("--documents", type=harness.positive, metavar="N", help="translation: a source as long as the output "
                   "(each length), the output forced, both with a <sep> every N tokens")
    c = modes.add_parser("checkpoint", help="trained checkpoints on a binarised split; fairseq-generate flags after --")
    c.add_argument("data", help="fairseq data-bin folder")
    c.add_argument("--model", type=model_spec, action="append", required=True, metavar="NAME=[int8:|compiled:]CHECKPOINT|NAME=ct2:PATH:TYPE",
                   help="repeatable; the first is the reference of the ratios")
    c.add_argument("--task", choices=["translation", "rfa_translation", "language_modeling"], default="translation")
    c.add_argument("--source-lang"), c.add_argument("--target-lang")
    for flag, default, text in (("--bucket-edges", [128, 256, 512], "translation: buckets by the batch's longest reference (tokens with </s>)"),
                                ("--lengths", [1024, 4096, 8192], "language_modeling: new tokens after each prompt"),
                                ("--prompts", 4, "language_modeling: from the first blocks"),
                                ("--prompt-tokens", 64, "language_modeling: tokens a prompt")):
        c.add_argument(flag, type=harness.positive, nargs="+" if isinstance(default, list) else None, default=default,
                       help=f"{text} (default {default})")
    c.add_argument("--user-dir", default=harness.USER_DIR)
    c.add_argument("--max-batches", type=harness.positive, help="decode only the first N batches")
    for sub in (s, c):
        harness.common_flags(sub, repeats=3 if sub is s else 1)
    args = p.parse_args(own)
    harness.setup(modes.choices[args.mode], args)
    if args.mode == "checkpoint":
        if not os.path.isdir(args.data):
            c.error(f"no data folder {args.data}")
        if args.task != "language_modeling" and not (args.source_lang and args.target_lang):
            c.error("--task translation needs --source-lang and --target-lang")
        if args.bucket_edges != sorted(set(args.bucket_edges)):
            c.error(f"--bucket-edges must increase, got {args.bucket_edges}")
        if any(ct2 for _, _, ct2, _ in args.model) and importlib.util.find_spec("ctranslate2") is None:
            c.error("ct2 models need the optional dependency ctranslate2: pip install -e '.[bench]'")
        args.positions = args.prompt_tokens + max(args.lengths) + 2 if args.task == "language_modeling" else None  # </s> twice
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
    meta = dict(reference=rows[0]["model"], args={k: v for k, v in vars(args).items() if k != "model"})
    if args.mode == "checkpoint":
        meta.update(models={n: f"ct2:{p}:{t}" if t else "".join(f + ":" for f in q) + p for n, p, t, q in args.model},
                    generate_flags=args.generate_flags, memory=rows[0]["memory"])
    return harness.save(args, argv, f"decode-{args.mode}", rows, **meta)


if __name__ == "__main__":
    sys.exit(harness.exit_status(main()))
