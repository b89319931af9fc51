#!/usr/bin/env python
"""Markdown tables from the benchmark JSON files (the tables in docs/benchmarks.md).

    python bench/report.py --translation bench/results/decode_translation.json \\
        --lm bench/results/decode_lm.json --train bench/results/train_speed.json \\
        --profile bench/results/profile_decode.json --out bench/results/report.md
"""
import argparse
import json

NAMES = {"softmax": "softmax", "sdpa": "SDPA", "rfa": "RFA", "rfa_gate": "RFA-Gate",
         "rfa_recompute": "RFA (--rfa-recompute)", "rfa_gate_recompute": "RFA-Gate (--rfa-recompute)"}


def load(path):
    with open(path) as f:
        return json.load(f)


def mib(x):
    return "-" if x is None else f"{x / 2**20:.1f}"


def model_of(row):
    return row.get("model", row.get("variant"))


def by_length(rows):
    table = {}
    for r in rows:
        table.setdefault(r["length"], {})[model_of(r)] = r
    return dict(sorted(table.items()))


def header(meta):
    a = meta.get("args", {})
    return (f"Machine: {meta.get('device')}; torch {meta.get('torch')}, {meta.get('torch_threads')} threads; "
            f"{meta.get('date')}.  \nArguments: " + ", ".join(f"{k}={v}" for k, v in a.items()
                                                             if k not in ("out",) and v not in (None, False)))


def cell_speed(r, base):
    if r is None:
        return "-"
    if "tokens_per_s" not in r:
        return r.get("skipped") and "skipped" or r.get("error", "-")
    text = f"{r['tokens_per_s']:.1f}"
    if base is not None and "tokens_per_s" in base and r is not base:
        text += f" ({r['tokens_per_s'] / base['tokens_per_s']:.2f}x)"
    return text


def decode_table(data):
    rows = data["rows"]
    models = [m for m in NAMES if any(model_of(r) == m for r in rows)]
    out = [header(data["meta"]), ""]
    out.append("| length | " + " | ".join(f"{NAMES[m]} tokens/s" for m in models) + " | "
               + " | ".join(f"{NAMES[m]} peak MiB" for m in models) + " | "
               + " | ".join(f"{NAMES[m]} state MiB" for m in models) + " |")
    out.append("|---" * (1 + 3 * len(models)) + "|")
    for length, per in by_length(rows).items():
        base = per.get("softmax")
        speed = [cell_speed(per.get(m), base) for m in models]
        peak = [mib(per.get(m, {}).get("peak_bytes")) for m in models]
        state = [mib(per.get(m, {}).get("state_bytes")) for m in models]
        out.append(f"| {length} | " + " | ".join(speed + peak + state) + " |")
    out.append("")
    out.append("Ratios in brackets: tokens/s relative to softmax in the same run. Per-token cost at the "
               "longest length relative to the shortest: "
               + ", ".join(f"{NAMES[m]} {per_token_growth(rows, m)}" for m in models) + ".")
    return "\n".join(out)


def per_token_growth(rows, model):
    pts = sorted((r["length"], r["tokens_per_s"]) for r in rows if model_of(r) == model and "tokens_per_s" in r)
    if len(pts) < 2:
        return "-"
    (l0, s0), (l1, s1) = pts[0], pts[-1]
    return f"{s0 / s1:.2f}x ({l0} -> {l1})"


def train_table(data):
    rows = data["rows"]
    models = [m for m in NAMES if any(model_of(r) == m for r in rows)]
    out = [header(data["meta"]), ""]
    out.append("| length | batch | " + " | ".join(f"{NAMES[m]} s/step" for m in models) + " | "
               + " | ".join(f"{NAMES[m]} peak MiB" for m in models) + " |")
    out.append("|---" * (2 + 2 * len(models)) + "|")
    for length, per in by_length(rows).items():
        batch = next(iter(per.values())).get("batch", "-")
        cells = []
        for m in models:
            r = per.get(m)
            if r is None:
                cells.append("-")
            elif "seconds" not in r:
                cells.append(r.get("error") or "skipped")
            else:
                text = f"{r['seconds']:.3f}"
                ratios = [f"{r[k]:.2f}x vs {NAMES[b]}" for b in ("softmax", "sdpa")
                          if m != b and (k := f"ratio_to_{b}") in r]
                cells.append(text + (f" ({', '.join(ratios)})" if ratios else ""))
        peaks = [mib(per.get(m, {}).get("peak_bytes")) for m in models]
        out.append(f"| {length} | {batch} | " + " | ".join(cells + peaks) + " |")
    out.append("")
    out.append("Ratios in brackets: speed (tokens/s) relative to the softmax baselines in the same run; > 1 is faster.")
    return "\n".join(out)


def profile_table(data):
    rows = data["rows"]
    comps = list(rows[0]["share_by_component"])
    out = [header(data["meta"]), ""]
    extra = "attention_share" in rows[0]  # results from before the projections were split out lack it
    out.append("| model | length | ms/step | " + " | ".join(comps) + (" | attention computation |" if extra else " |"))
    out.append("|---" * (3 + len(comps) + extra) + "|")
    for r in rows:
        cells = [f"{100 * r['share_by_component'][c]:.1f}%" for c in comps]
        if extra:
            cells.append(f"**{100 * r['attention_share']:.1f}%**")
        out.append(f"| {NAMES[r['model']]} | {r['length']} | {r['ms_per_step']:.2f} | " + " | ".join(cells) + " |")
    if extra:
        out += ["", "Attention computation: self-attention + cross-attention + state reorder, without the "
                    "q/k/v/out projections (those are in 'attention projections')."]
    return "\n".join(out)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--translation")
    p.add_argument("--lm")
    p.add_argument("--train")
    p.add_argument("--profile")
    p.add_argument("--out")
    args = p.parse_args(argv)
    parts = []
    if args.translation:
        parts += ["### Translation decoding", "", decode_table(load(args.translation)), ""]
    if args.lm:
        parts += ["### LM decoding", "", decode_table(load(args.lm)), ""]
    if args.train:
        parts += ["### Training (decoder stack, forward + backward)", "", train_table(load(args.train)), ""]
    if args.profile:
        parts += ["### Where a decoding step's time goes", "", profile_table(load(args.profile)), ""]
    if not parts:
        p.error("give at least one input")
    text = "\n".join(parts)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    print(text)


if __name__ == "__main__":
    main()
