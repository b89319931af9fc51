#!/usr/bin/env python
"""Markdown tables and a figure (decode-synthetic and train-lm files) from bench/decode.py's and bench/train.py's JSON.

    python bench/report.py bench/results/*.json --out bench/results/report.md --figure bench/results/benchmarks.png
"""
import argparse
import json

TITLES = {"decode-synthetic": "Decoding, random weights, forced length", "decode-checkpoint": "Decoding trained checkpoints",
          "train-lm": "Training the LM decoder stack (forward + backward)", "train-translation": "Training on real batches",
          "train-encoder": "Encoder self-attention module (forward + backward)"}


def mib(x):
    return "-" if x is None else f"{x / 2**20:.1f}"


def table(header, lines):
    return "\n".join(["| " + " | ".join(header) + " |", "|---" * len(header) + "|"]
                     + ["| " + " | ".join(str(c) for c in line) + " |" for line in lines])


def by_length(rows, columns, key=lambda r: r["length"], heading=("length",), shown=lambda k: k):
    """A line per ``key`` value (``shown`` as); per (heading, text of a row) in ``columns``, a column per model."""
    models, cell = list(dict.fromkeys(r["model"] for r in rows)), {(key(r), r["model"]): r for r in rows}
    lines = []
    for k in sorted(dict.fromkeys(key(r) for r in rows)):
        got = [cell.get((k, m)) for _, _ in columns for m in models]
        lines.append(list(shown(k) if isinstance(shown(k), tuple) else (shown(k),)) + [
            "-" if r is None else r.get("skipped") and "skipped" or r.get("error") or text(r)
            for r, text in zip(got, [t for _, t in columns for _ in models])])
    return table(list(heading) + [f"{m} {h}".strip() for h, _ in columns for m in models], lines)


speed = lambda r: f"{r['tokens_per_s']:.1f}" + (f" ({r['ratio']:.2f}x)" if r.get("ratio", 1.0) != 1.0 else "")  # noqa: E731
peak = ("peak MiB", lambda r: mib(r.get("peak_bytes")))


def checkpoint_table(data):
    rows, meta, ref = data["rows"], data["meta"], data["rows"][0]["model"]
    about = (f"Decoding {rows[0]['sentences']:,} {'prompts' if 'length' in rows[0] else 'sentences'}, fairseq-generate "
             f"{' '.join(meta['generate_flags'])}; {meta['args']['statistic']} of {rows[0]['runs']} run(s); memory: "
             f"{meta['memory']}.\n\n")
    columns = [("tokens/s", speed), peak, ("memory vs " + ref, lambda r: f"{r.get('memory_ratio', 0):.2f}x")]
    if any(r.get("decode_bytes") is not None for r in rows):  # what decoding adds above the loaded model
        columns += [("decoding MiB", lambda r: mib(r.get("decode_bytes"))),
                    ("decoding vs " + ref, lambda r: f"{r.get('decode_memory_ratio', 0):.2f}x")]
    if "length" in rows[0]:  # language_modeling: new tokens after each prompt
        return about + by_length(rows, columns + [("same output", lambda r: f"{r.get('same_as_first', 0):.2f}")])
    buckets = [b for r in rows for b in r.get("buckets", ())]
    return about + table(
        ["run", "sentences", "tokens generated", "decoding time (s)", "sentences/s", "tokens/s",
         f"speed vs {ref}", "peak memory (MiB)", f"memory vs {ref}", "BLEU", f"same output as {ref}"],
        [[r["model"], f"{r['sentences']:,}", f"{r['tokens']:,}", f"{r['seconds']:.1f}", f"{r['sentences_per_s']:.2f}",
          f"{r['tokens_per_s']:.1f}", f"{r['ratio']:.2f}x", mib(r.get("peak_bytes")), f"{r.get('memory_ratio', 0):.2f}x",
          f"{r['bleu']:.2f}" if "bleu" in r else "-", f"{r['same_as_first']:.2f}" if "same_as_first" in r else "-"]
         for r in rows]) + ("\n\nBy output tokens per sentence (a batch counts where its longest reference falls):\n\n" + by_length(
            buckets, columns, lambda r: (r["bucket_from"], r["bucket"]), ("output tokens",), lambda k: k[1]) if buckets else "")


def render(data):
    kind, rows, meta = data["meta"]["bench"], data["rows"], data["meta"]
    if kind == "decode-checkpoint":
        body = checkpoint_table(data)
    elif kind == "decode-synthetic":
        body = by_length(rows, [("tokens/s", speed), peak, ("state MiB", lambda r: mib(r.get("state_bytes")))])
    elif kind == "train-translation":
        body = table(["model", "s/step", "speed vs softmax", "peak MiB"], [
            [r["model"], f"{r['seconds']:.3f}", f"{r.get('ratio', 1):.2f}x", mib(r.get("peak_bytes"))] for r in rows])
    else:
        both = lambda r: ", ".join(f"{r[k]:.2f}x {w}" for k, w in (("ratio", "softmax"), ("ratio_sdpa", "SDPA"))  # noqa: E731
                                   if r.get(k, 1.0) != 1.0)
        step = lambda r: f"{r['seconds']:.3g}" + (f" ({both(r)})" if both(r) else "")  # noqa: E731
        memory = [(f"{k} MiB", lambda r, k=k: mib(r.get(f"{k}_bytes"))) for k in ("allocated", "resident")]
        body = by_length(rows, [("s/step", step), peak] + memory * any("allocated_bytes" in r for r in rows)) + (
            "\n\nIn brackets: speed relative to softmax and to SDPA in the same run (> 1 is faster).")
    about = f"{meta['device']}, torch {meta['torch']}, {meta['torch_threads']} threads, {meta['date'][:10]}: `{meta['command']}`"
    return f"### {TITLES[kind]}\n\n{about}\n\n{body}\n"


def figure(files, path):
    """Speed and memory against length: a column per file; a checkpoint run's by its output-length buckets (each at the
    bucket's mean output, its memory what decoding adds above the loaded model)."""
    import matplotlib
    import matplotlib.ticker
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(2, len(files), figsize=(5 * len(files), 8), squeeze=False)
    for col, data in enumerate(files):
        buckets = any("buckets" in r for r in data["rows"])  # translation checkpoints (language models: by length)
        rows = [b for r in data["rows"] for b in r.get("buckets", ())] if buckets else data["rows"]
        memory = ("decode_bytes", "decoding's memory (MiB)") if buckets else ("peak_bytes", "peak memory (MiB)")
        for row, (key, label) in enumerate((("tokens_per_s", "tokens/s"), memory)):
            ax = axes[row][col]
            for model in dict.fromkeys(r["model"] for r in rows):
                points = sorted((r["tokens"] / r["sentences"] if buckets else r["length"], r[key] / 2**(20 * row))
                                for r in rows if r["model"] == model and r.get(key))
                if points:
                    ax.plot(*zip(*points), marker="o", label=model)
            ax.set(xscale="log", yscale="log", xlabel="output length (tokens" + (", mean of a bucket)" if buckets else ")"),
                   ylabel=label)
            ax.xaxis.set_major_locator(matplotlib.ticker.LogLocator(subs=(1, 2, 5)))  # 1, 2, 5 x 10^k: no labels overlap
            ax.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
            ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
            flags = data["meta"].get("generate_flags", [])
            batch = f", batch {flags[flags.index('--batch-size') + 1]}" if "--batch-size" in flags else ""
            ax.set_title(TITLES[data["meta"]["bench"]] + f" ({data['meta']['args'].get('task', 'lm')}{batch})", fontsize=9)
            ax.grid(True, alpha=0.3), ax.legend(fontsize=7)
    meta = files[0]["meta"]
    fig.suptitle(f"{meta['device']}, torch {meta['torch']}, {meta['torch_threads']} threads", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("files", nargs="+", help="JSON written by bench/decode.py or bench/train.py")
    p.add_argument("--out", help="write the markdown here (else print it)")
    p.add_argument("--figure", help="write the PNG figure here (needs matplotlib)")
    args = p.parse_args(argv)
    files = []
    for path in args.files:
        try:
            with open(path) as f:
                files.append(json.load(f))
            TITLES[files[-1]["meta"]["bench"]]
        except (OSError, ValueError, KeyError, TypeError) as e:
            p.error(f"{path}: not a benchmark result of bench/decode.py or bench/train.py ({e!r})")
    text = "\n".join(render(d) for d in files)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    else:
        print(text)
    if args.figure:
        plotted = [d for d in files if d["meta"]["bench"] in ("decode-synthetic", "decode-checkpoint", "train-lm")
                   and any("tokens_per_s" in r for r in d["rows"])]
        figure(plotted or p.error("--figure plots decode and train-lm results; none given"), args.figure)
    return text


if __name__ == "__main__":
    main()
