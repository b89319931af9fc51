#!/usr/bin/env python
"""Decoding speed and memory of trained translation models on a real test set: the measurement
behind the RFA paper's speed comparison, on the recipe's models (recipes/<wmt task>/speed.sh).

    python recipes/tools/decode_speed.py --data DATA_BIN --source-lang en --target-lang de \\
        --model softmax=ckpt_a.pt --model rfa=ckpt_b.pt --out speed.md [--repeats 3] \\
        -- [fairseq-generate flags: --beam 4 --lenpen 0.6 --max-tokens 8000 ...]

Every model decodes the whole test set with the same fairseq-generate flags (beam search and
the lengths the model itself produces, as in evaluation), each run in its own process so that
the peak memory is that model's alone. Speed is fairseq-generate's own count (generated tokens
over the time spent in generation, model loading and data reading excluded); with --repeats the
models take turns and the median run is kept. Memory is the peak of
torch.cuda.max_memory_allocated on a GPU (weights, activations, beams and the decoding state),
else the peak resident memory of the process (ru_maxrss: the whole process, torch included).
Writes a markdown table (speed and memory relative to the first model) and the same data as
JSON beside it.
"""
import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile

TRANSLATED = re.compile(r"Translated ([\d,]+) sentences \(([\d,]+) tokens\) in ([\d.]+)s "
                        r"\(([\d.]+) sentences/s, ([\d.]+) tokens/s\)")
MARK = "DECODE_SPEED_RESULT "


def child(argv):
    """Run fairseq-generate in this process, then print its peak memory on one marked line."""
    import resource

    import torch
    from fairseq_cli import generate

    sys.argv = ["fairseq-generate"] + argv
    generate.cli_main()
    if torch.cuda.is_available() and "--cpu" not in argv:
        peak, kind, device = torch.cuda.max_memory_allocated() / 2**20, "cuda_max_allocated", torch.cuda.get_device_name()
    else:
        peak, kind, device = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "max_rss", platform.processor() or "cpu"
    print(MARK + json.dumps({"peak_mb": peak, "memory": kind, "device": device}), flush=True)


def decode_once(name, checkpoint, common, results_dir):
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--", *common, "--path", checkpoint,
           "--results-path", os.path.join(results_dir, name)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    out = proc.stdout + proc.stderr
    if proc.returncode != 0:
        sys.exit(f"decode_speed.py: decoding with {name} ({checkpoint}) failed:\n{out[-3000:]}")
    counts = TRANSLATED.findall(out)
    marked = [line for line in out.splitlines() if line.startswith(MARK)]
    if not counts or not marked:
        sys.exit(f"decode_speed.py: no timing or memory in the output of {name}:\n{out[-3000:]}")
    sentences, tokens, seconds, sent_s, tok_s = counts[-1]
    result = json.loads(marked[-1][len(MARK):])
    result.update(sentences=int(sentences.replace(",", "")), tokens=int(tokens.replace(",", "")),
                  seconds=float(seconds), sentences_per_s=float(sent_s), tokens_per_s=float(tok_s))
    return result


def table(rows):
    base = rows[0]
    lines = ["| run | sentences | tokens generated | decoding time (s) | sentences/s | tokens/s "
             f"| speed vs {base['run']} | peak memory (MiB) | memory vs {base['run']} |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['run']} | {r['sentences']:,} | {r['tokens']:,} | {r['seconds']:.1f} "
                     f"| {r['sentences_per_s']:.2f} | {r['tokens_per_s']:.1f} "
                     f"| {r['tokens_per_s'] / base['tokens_per_s']:.2f}x | {r['peak_mb']:.0f} "
                     f"| {r['peak_mb'] / base['peak_mb']:.2f}x |")
    return "\n".join(lines)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv[:2] == ["--child", "--"]:
        return child(argv[2:])
    own, generate_flags = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", required=True, help="fairseq data-bin folder holding the test split")
    parser.add_argument("--source-lang", required=True)
    parser.add_argument("--target-lang", required=True)
    parser.add_argument("--model", action="append", required=True, metavar="NAME=CHECKPOINT",
                        help="a run name and its checkpoint; the first is the reference of the ratios")
    parser.add_argument("--user-dir", required=True, help="the rfa_fairseq package folder")
    parser.add_argument("--repeats", type=int, default=1, help="decodes per model; the median is reported")
    parser.add_argument("--out", required=True, help="markdown table to write (JSON beside it, .json)")
    args = parser.parse_args(own)
    models = []
    for spec in args.model:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            parser.error(f"--model wants NAME=CHECKPOINT, got {spec!r}")
        if not os.path.isfile(path):
            parser.error(f"--model {name}: no checkpoint file {path}")
        models.append((name, path))
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1, got {args.repeats}")

    common = [args.data, "--user-dir", args.user_dir, "--task", "translation", "--source-lang", args.source_lang,
              "--target-lang", args.target_lang, "--gen-subset", "test", *generate_flags]
    runs = {name: [] for name, _ in models}
    with tempfile.TemporaryDirectory() as results_dir:
        for repeat in range(args.repeats):
            order = models if repeat % 2 == 0 else models[::-1]
            for name, path in order:
                runs[name].append(decode_once(name, path, common, results_dir))
                r = runs[name][-1]
                print(f"{name}: {r['sentences']} sentences, {r['tokens']} tokens in {r['seconds']:.1f} s "
                      f"({r['tokens_per_s']:.1f} tokens/s), peak {r['peak_mb']:.0f} MiB", file=sys.stderr)
    rows = []
    for name, path in models:
        speed = statistics.median_low([r["tokens_per_s"] for r in runs[name]])
        chosen = next(r for r in runs[name] if r["tokens_per_s"] == speed)
        rows.append(dict(chosen, run=name, checkpoint=path, peak_mb=max(r["peak_mb"] for r in runs[name]),
                         repeats=len(runs[name])))
    text = (f"Decoding {rows[0]['sentences']:,} test sentences, fairseq-generate {' '.join(generate_flags)}; "
            f"{rows[0]['device']}, median of {args.repeats} run(s); memory: {rows[0]['memory']}.\n\n" + table(rows))
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        f.write(text + "\n")
    with open(os.path.splitext(args.out)[0] + ".json", "w", encoding="utf-8") as f:
        json.dump({"generate_flags": generate_flags, "runs": rows}, f, indent=1)
    print(text)


if __name__ == "__main__":
    main()
