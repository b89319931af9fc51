#!/usr/bin/env python
"""Markdown tables, and the figure, from the JSON files that bench/decode.py and bench/train.py write.

    python bench/report.py bench/results/*.json --out bench/results/report.md --figure bench/results/benchmarks.png

One table per file, chosen by its ``meta.bench``; a file whose rows carry a ``profile`` also gets
the profile table. The figure plots tokens/s and peak memory against length for every
decode-synthetic and train-lm file given (one column each).
"""
import argparse
import json
import os

NAMES = {"softmax": "softmax", "sdpa": "SDPA", "rfa": "RFA", "rfa_gate": "RFA-Gate", "rfa_recompute": "RFA recompute",
         "rfa_gate_recompute": "RFA-Gate recompute", "rfa_softcross": "RFA softmax-cross",
         "rfa_gate_softcross": "RFA-Gate softmax-cross"}
RANGES = ["self_attn", "encoder_attn", "reorder", "ffn", "output", "encoder", "decoder_other", "rest"]
TITLES = {"decode-synthetic": "Decoding, random weights, forced length", "decode-checkpoint": "Decoding trained checkpoints",
          "train-lm": "Training the LM decoder stack (forward + backward)", "train-translation": "Training on real batches",
          "train-encoder": "Encoder self-attention module (forward + backward)", "train-chunk": "chunk_causal_rfa by chunk size"}


def name(model):
    return NAMES.get(model, model)


def mib(x):
    return "-" if x is None else f"{x / 2**20:.1f}"


def table(header, lines):
    return "\n".join(["| " + " | ".join(header) + " |", "|---" * len(header) + "|"]
                     + ["| " + " | ".join(str(c) for c in line) + " |" for line in lines])


def value(r, text):
    """``text(r)`` for a measured row, else why it was not measured."""
    if r is None:
        return "-"
    if "skipped" in r or "error" in r:
        return "skipped" if "skipped" in r else r["error"]
    return text(r)


def ratio(r, field="ratio"):
    return f" ({r[field]:.2f}x)" if field in r and r[field] != 1.0 else ""


def by_length(rows, columns, first=()):
    """One line per length; for each (heading, text) in ``columns`` one column per model."""
    models = list(dict.fromkeys(r["model"] for r in rows))
    cell = {(r["length"], r["model"]): r for r in rows}
    lengths = sorted({r["length"] for r in rows})
    header = ["length"] + [h for h, _ in first] + [f"{name(m)} {h}" for h, _ in columns for m in models]
    lines = [[n] + [f(next(r for r in rows if r["length"] == n)) for _, f in first]
             + [value(cell.get((n, m)), f) for _, f in columns for m in models] for n in lengths]
    return table(header, lines)


def speed_cell(r):
    return f"{r['tokens_per_s']:.1f}{ratio(r)}"


def step_cell(r):
    both = [f"{r[k]:.2f}x {w}" for k, w in (("ratio", "softmax"), ("ratio_sdpa", "SDPA")) if k in r and r[k] != 1.0]
    return f"{r['seconds']:.3g}" + (f" ({', '.join(both)})" if both else "")


def checkpoint_table(data):
    rows, meta = data["rows"], data["meta"]
    ref = name(rows[0]["model"])
    head = (f"Decoding {rows[0]['sentences']:,} sentences, fairseq-generate {' '.join(meta['generate_flags'])}; "
            f"{meta['device']}, {meta['torch_threads']} threads; {meta['args']['statistic']} of {rows[0]['runs']} run(s); "
            f"memory: {meta['memory']}.\n\n")
    return head + table(
        ["run", "sentences", "tokens generated", "decoding time (s)", "sentences/s", "tokens/s", f"speed vs {ref}",
         "peak memory (MiB)", f"memory vs {ref}"],
        [[r["model"], f"{r['sentences']:,}", f"{r['tokens']:,}", f"{r['seconds']:.1f}", f"{r['sentences_per_s']:.2f}",
          f"{r['tokens_per_s']:.1f}", f"{r['ratio']:.2f}x", f"{r['peak_bytes'] / 2**20:.0f}", f"{r['memory_ratio']:.2f}x"]
         for r in rows])


def chunk_table(rows):
    sizes = sorted({r["chunk_size"] for r in rows})
    groups = list(dict.fromkeys((r["pass"], r["gated"], r["length"]) for r in rows))
    lines = []
    for g in groups:
        ms = {r["chunk_size"]: 1e3 * r["seconds"] for r in rows if (r["pass"], r["gated"], r["length"]) == g}
        best = min(ms, key=ms.get)
        lines.append([g[0], "gated" if g[1] else "ungated", g[2]] + [f"{ms[c]:.1f}" if c in ms else "-" for c in sizes] + [best])
    return "milliseconds per call\n\n" + table(["pass", "gate", "length"] + [f"C={c}" for c in sizes] + ["fastest"], lines)


def profile_table(rows):
    rows = [r for r in rows if "profile" in r]
    ranges = [w for w in RANGES if any(w in r["profile"]["ms_per_step_by_range"] for r in rows)]
    lines = [[name(r["model"]), r.get("length", "-"), f"{r['profile']['ms_per_step']:.2f}"]
             + [f"{r['profile']['ms_per_step_by_range'].get(w, 0.0):.2f}" for w in ranges] for r in rows]
    return ("Milliseconds per decoding step (torch.profiler, operators' CPU time, each counted in the innermost "
            "range around it)\n\n" + table(["model", "length", "whole step"] + ranges, lines))


def render(data):
    kind, rows, meta = data["meta"]["bench"], data["rows"], data["meta"]
    if kind == "decode-checkpoint":
        body = checkpoint_table(data) if "sentences" in rows[0] else "(profile only)"
    elif kind == "decode-synthetic":
        body = by_length(rows, [("tokens/s", speed_cell), ("peak MiB", lambda r: mib(r.get("peak_bytes"))),
                                ("state MiB", lambda r: mib(r.get("state_bytes")))])
    elif kind == "train-translation":
        body = table(["model", "s/step", "x softmax speed", "peak MiB"],
                     [[name(r["model"]), f"{r['seconds']:.3f}", f"{r.get('ratio', 1):.2f}", mib(r.get("peak_bytes"))] for r in rows])
    elif kind == "train-chunk":
        body = chunk_table(rows)
    else:
        first = [("batch", lambda r: r.get("batch", 1))] if kind == "train-lm" else []
        body = by_length(rows, [("s/step", step_cell), ("peak MiB", lambda r: mib(r.get("peak_bytes")))], first)
        body += "\n\nIn brackets: speed relative to softmax and to SDPA in the same run (> 1 is faster)."
    about = f"{meta['device']}, torch {meta['torch']}, {meta['torch_threads']} threads, {meta['date'][:10]}: `{meta['command']}`"
    text = f"### {TITLES[kind]}\n\n{about}\n\n{body}\n"
    return text + ("\n" + profile_table(rows) + "\n" if any("profile" in r for r in rows) else "")


def figure(files, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(files), figsize=(5 * len(files), 8), squeeze=False)
    for col, data in enumerate(files):
        title = TITLES[data["meta"]["bench"]] + (f" ({data['meta']['args']['task']})" if "task" in data["meta"]["args"] else "")
        for row, (key, label) in enumerate((("tokens_per_s", "tokens/s"), ("peak_bytes", "peak memory (MiB)"))):
            ax = axes[row][col]
            for model in dict.fromkeys(r["model"] for r in data["rows"]):
                points = sorted((r["length"], r[key] / (2**20 if row else 1)) for r in data["rows"]
                                if r["model"] == model and r.get(key) is not None)
                if points:
                    ax.plot(*zip(*points), marker="o", label=name(model))
            ax.set(xscale="log", yscale="log", xlabel="length (tokens)", ylabel=label)
            ax.set_title(title, fontsize=9)
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=7)
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
            if files[-1]["meta"]["bench"] not in TITLES:
                raise KeyError(files[-1]["meta"]["bench"])
        except (OSError, ValueError, KeyError, TypeError) as e:
            p.error(f"{path}: not a benchmark result of bench/decode.py or bench/train.py ({e!r})")
    text = "\n".join(render(d) for d in files)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            f.write(text)
    else:
        print(text)
    if args.figure:
        plotted = [d for d in files if d["meta"]["bench"] in ("decode-synthetic", "train-lm")]
        if not plotted:
            p.error("--figure plots decode-synthetic and train-lm results; none was given")
        figure(plotted, args.figure)
    return text


if __name__ == "__main__":
    main()
