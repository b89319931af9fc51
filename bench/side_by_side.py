#!/usr/bin/env python
"""Decoding speed of two versions of this repository, side by side, in one run.

Runs ``bench/decode_speed.py`` (softmax, RFA and RFA-Gate at the same dimensions) from each tree
in turn, round after round, so that a slow spell of a shared machine hits both; each run's RFA
speeds are taken relative to the softmax of the same run. A tree is a checkout of this
repository (for example ``git worktree add ../baseline main``); its own ``rfa_fairseq`` is
imported in its runs.

    python bench/side_by_side.py --baseline ../baseline --threads 1 2 \\
        --out bench/results/side_by_side.json

Per tree, task, thread count, model and length: tokens/s (the median over rounds), the ratio to
softmax at that length, the ratio to softmax at the shortest length measured (the floor: RFA's
cost per token does not grow with the length, softmax's does), and the new tree against the
baseline (``--markdown``: through their ratios to softmax, which cancel a machine that is faster
or slower in one run than in the other).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# (task, lengths, decode_speed.py arguments): translation with beam 4 over 2 sentences, LM
# continuation of one prompt, greedy (decode_speed.py's defaults). Every plan starts at 32
# tokens, the floor of its run.
LONG = ["--repeats", "1", "--max-seconds", "1e9"]  # never skip softmax at 2048
PLANS = {
    "translation-short": ("translation", [32, 128, 512], ["--repeats", "5"]),
    "translation-long": ("translation", [32, 2048], LONG),
    "lm": ("lm", [32, 2048], LONG),
}


def run_once(tree, task, lengths, extra, threads):
    if threads == 1:
        # one thread: the process's CPU time, fastest run, which other tenants of a shared
        # machine slow down least (decode_speed.py --help)
        extra = extra + ["--clock", "cpu", "--statistic", "min"]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "r.json")
        cmd = [sys.executable, os.path.join(tree, "bench", "decode_speed.py"), "--task", task,
               "--lengths", *map(str, lengths), "--threads", str(threads), "--out", out, *extra]
        env = dict(os.environ, PYTHONWARNINGS="ignore", PYTHONPATH=tree)
        subprocess.run(cmd, cwd=tree, env=env, check=True, stdout=subprocess.DEVNULL)
        with open(out) as f:
            return json.load(f)


def summarise(runs):
    """Rows of several decode_speed runs of one tree -> {(model, length): summary}."""
    speeds = {}
    for result in runs:
        rows = [r for r in result["rows"] if "tokens_per_s" in r]
        softmax = {r["length"]: r["tokens_per_s"] for r in rows if r["model"] == "softmax"}
        floor = softmax[min(softmax)]
        for r in rows:
            s = speeds.setdefault((r["model"], r["length"]), {"tokens_per_s": [], "vs_softmax": [], "vs_floor": []})
            s["tokens_per_s"].append(r["tokens_per_s"])
            s["vs_softmax"].append(r["tokens_per_s"] / softmax[r["length"]])
            s["vs_floor"].append(r["tokens_per_s"] / floor)
    return {key: {name: statistics.median(v) for name, v in s.items()} | {"runs": len(s["tokens_per_s"])}
            for key, s in speeds.items()}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--baseline", required=True, help="the other checkout")
    p.add_argument("--tree", default=REPO, help="the checkout under test (default: this one)")
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--plans", nargs="+", default=list(PLANS), choices=list(PLANS))
    p.add_argument("--rounds", type=int, default=2, help="runs per tree, alternating")
    p.add_argument("--out", required=True)
    p.add_argument("--tiny", action="store_true", help="tiny models and lengths (for tests of this script)")
    p.add_argument("--markdown", action="store_true", help="print the table of --out as markdown, measure nothing")
    args = p.parse_args(argv)
    if args.markdown:
        with open(args.out) as f:
            print(markdown(json.load(f)["rows"]))
        return None
    trees = {"baseline": os.path.abspath(args.baseline), "new": os.path.abspath(args.tree)}
    results = []
    if os.path.exists(args.out):  # resume: keep what an interrupted run measured
        with open(args.out) as f:
            results = json.load(f)["rows"]
    done = {(r["plan"], r["threads"], r["tree"]) for r in results}
    for plan in args.plans:
        task, lengths, extra = PLANS[plan]
        if args.tiny:
            lengths, extra = [3, 5], extra + ["--tiny"]
        for threads in args.threads:
            if all((plan, threads, name) in done for name in trees):
                continue
            runs = {name: [] for name in trees}
            for _ in range(args.rounds):
                for name, tree in trees.items():
                    runs[name].append(run_once(tree, task, lengths, extra, threads))
            for name in trees:
                for (model, length), s in sorted(summarise(runs[name]).items()):
                    results.append(dict(plan=plan, task=task, threads=threads, tree=name, model=model,
                                        length=length, **s))
            with open(args.out, "w") as f:
                json.dump({"trees": trees, "rows": results}, f, indent=1)
            print_table(results, plan, threads)
    return results


def print_table(rows, plan, threads):
    sel = [r for r in rows if r["plan"] == plan and r["threads"] == threads]
    base = {(r["model"], r["length"]): r for r in sel if r["tree"] == "baseline"}
    print(f"\n{plan}, {threads} thread(s): model length | tokens/s baseline new | x softmax baseline new | "
          f"x floor baseline new | new / baseline")
    for r in sel:
        if r["tree"] != "new":
            continue
        b = base[r["model"], r["length"]]
        print(f"  {r['model']:8s} {r['length']:5d} | {b['tokens_per_s']:7.1f} {r['tokens_per_s']:7.1f} | "
              f"{b['vs_softmax']:.2f} {r['vs_softmax']:.2f} | {b['vs_floor']:.2f} {r['vs_floor']:.2f} | "
              f"{r['tokens_per_s'] / b['tokens_per_s']:.2f}", flush=True)


NAMES = {"rfa": "RFA", "rfa_gate": "RFA-Gate"}


def markdown(rows):
    """One row per task, model, length and thread count: the new tree's ratios first; the last
    column compares the trees through their ratios to softmax, which cancel the machine's speed at
    the time of each run."""
    base = {(r["plan"], r["threads"], r["model"], r["length"]): r for r in rows if r["tree"] == "baseline"}
    lines = ["| task | model | length | threads | new: x softmax | baseline: x softmax | "
                          "new: x softmax at 32 | baseline: x softmax at 32 | new / baseline |",
                          "|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (r["task"] != "translation", r["model"], r["length"], r["threads"])):
        key = (r["plan"], r["threads"], r["model"], r["length"])
        if r["tree"] != "new" or r["model"] == "softmax" or key not in base:
            continue
        if r["length"] == 32 and r["plan"] == "translation-long":
            continue  # 32 tokens is measured with 5 repeats in the short plan
        b = base[key]
        lines.append(f"| {r['task']} | {NAMES[r['model']]} | {r['length']} | {r['threads']} | {r['vs_softmax']:.2f} | "
                     f"{b['vs_softmax']:.2f} | {r['vs_floor']:.2f} | {b['vs_floor']:.2f} | "
                     f"{r['vs_softmax'] / b['vs_softmax']:.2f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
