#!/usr/bin/env python
"""The benchmark figure: speed and peak memory against length, softmax vs RFA, from the JSON
files that bench/decode_speed.py and bench/train_speed.py write (any of them may be missing).

    python bench/plot.py --translation bench/results/decode_translation.json \\
        --lm bench/results/decode_lm.json --train bench/results/train_speed.json \\
        --out bench/results/benchmarks.png
"""
import argparse
import json

STYLE = {
    "softmax": dict(color="tab:gray", marker="o", label="softmax (fairseq)"),
    "sdpa": dict(color="black", marker="x", linestyle="--", label="softmax (torch SDPA, causal)"),
    "rfa": dict(color="tab:blue", marker="s", label="RFA"),
    "rfa_gate": dict(color="tab:orange", marker="^", label="RFA-Gate"),
    "rfa_recompute": dict(color="tab:blue", marker="s", linestyle=":", label="RFA, --rfa-recompute"),
    "rfa_gate_recompute": dict(color="tab:orange", marker="^", linestyle=":", label="RFA-Gate, --rfa-recompute"),
}


def load(path):
    with open(path) as f:
        return json.load(f)


def model_of(row):
    return row.get("model", row.get("variant"))


def series(rows, key):
    out = {}
    for r in rows:
        value = r.get(key)
        if value is None:
            continue
        out.setdefault(model_of(r), []).append((r["length"], value))
    return {m: sorted(v) for m, v in out.items()}


def panel(ax, rows, key, ylabel, title, scale=1.0, logy=False):
    for model, points in series(rows, key).items():
        xs, ys = zip(*points)
        ax.plot(xs, [y * scale for y in ys], **STYLE.get(model, {"label": model}))
    ax.set_xscale("log", base=2)
    if logy:
        ax.set_yscale("log")
    ax.set_xlabel("length (tokens)")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--translation")
    p.add_argument("--lm")
    p.add_argument("--train")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    columns = [(name, load(path)) for name, path in
               (("translation decoding (beam search)", args.translation), ("LM decoding", args.lm),
                ("training (decoder stack, fwd+bwd)", args.train)) if path]
    if not columns:
        p.error("give at least one of --translation, --lm, --train")
    fig, axes = plt.subplots(2, len(columns), figsize=(5 * len(columns), 8), squeeze=False)
    for col, (title, data) in enumerate(columns):
        rows = data["rows"]
        panel(axes[0][col], rows, "tokens_per_s", "tokens / s", title, logy=True)
        panel(axes[1][col], rows, "peak_bytes", "peak memory (MiB)", title + ": memory", scale=2**-20, logy=True)
    meta = columns[0][1]["meta"]
    fig.suptitle(f"rfa_fairseq benchmarks: {meta.get('device')}, torch {meta.get('torch')}, "
                 f"{meta.get('torch_threads')} threads, {meta.get('date', '')[:10]}", fontsize=11)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
