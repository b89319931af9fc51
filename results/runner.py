"""The study runner: a resumable queue of training runs, a JSON line per run, and the table of what is recorded. A spec
module beside it ends with ``main(sys.modules[__name__])`` and defines NAME, OUT, WORK, SETTINGS ({name: dict(updates=N,
...)}), VARIANTS, METRICS ([(column, key, digits)]), ``prepare(a)`` (the data) and ``run_one(variant, s, seed, data, out,
a)`` (a run's fields); optionally DEFAULT_VARIANTS, TIME, ``add_args(parser)``, ``rescore(variant, s, seed, data, out, a,
record)``. A recorded run is skipped, an interrupted one resumes in --work/SETTING/VARIANT-seedS[-uN]. Pin each queue.
"""
import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
ENV = {**os.environ, "PATH": f"{Path(PY).parent}{os.pathsep}{os.environ.get('PATH', '')}", "RFA_USE_CURRENT_ENV": "1",
       "PYTHONWARNINGS": "ignore"}
# fairseq-train in this process (python -m fairseq_cli.train), writing its peak memory to argv[1] on the way out
TRAIN = """
import json, resource, sys
import torch
from fairseq_cli.train import cli_main
peak_file = sys.argv.pop(1)
try:
    cli_main()
finally:
    peak = {"peak_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1), "peak_kind": "max_rss"}
    if torch.cuda.is_available():
        peak = {"peak_mb": round(torch.cuda.max_memory_allocated() / 2 ** 20, 1), "peak_kind": "cuda_allocated",
                "device": torch.cuda.get_device_name()}
    with open(peak_file, "w") as f:
        json.dump(peak, f)
"""


def tool(name: str) -> str:  # the command (fairseq-generate, ...) beside this python first, else on PATH
    found = shutil.which(name, path=ENV["PATH"])
    if found is None:
        raise FileNotFoundError(f"{name} is neither beside {PY} nor on PATH: install fairseq into this environment")
    return found


def run(cmd, log, progress=None):
    """``cmd`` in the repository root, its output to ``log`` (returned); ``progress``: scripts/train_progress.py's lines."""
    cmd = [str(c) for c in cmd]
    if not progress:
        with open(log, "w") as f:
            code = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, env=ENV).returncode
    else:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=ROOT, env=ENV)
        subprocess.run([PY, "scripts/train_progress.py", str(progress), str(log)], stdin=proc.stdout, cwd=ROOT)
        code = proc.wait()
    if code:
        raise RuntimeError(f"{' '.join(cmd[:3])} ... failed (exit {code}); its output: {log}")
    return Path(log).read_text()


def train(flags, out: Path, updates: int, a) -> dict:
    """fairseq-train into ``out`` (resumed) unless done; the seconds, the time per update (fairseq's train_wall; the whole
    run's; a run trained in one go), the peak memory (CUDA allocator's, else the peak resident set), the device."""
    timing = out / "timing.json"  # written once training has finished
    if not timing.exists():
        print(f"[{a.name}]   fairseq-train: {updates} updates, log {out / 'train.log'}", flush=True)
        resumed = (out / "checkpoint_last.pt").exists()
        log = run([PY, "-c", TRAIN, out / "peak.json", *flags, *a.cpu_flag, "--max-update", updates, "--save-dir", out,
                   "--no-epoch-checkpoints", "--log-format", "simple", "--num-workers", "0"], out / "train.log",
                  a.progress and updates)
        done = re.search(r"done training in ([\d.]+) seconds", log)
        wall = sum(int(w) for w in re.findall(r"\| train \| epoch \d+ \|.*?\| train_wall (\d+) \|", log))
        seconds = float(done.group(1)) if done else None
        timing.write_text(json.dumps({"train_s": seconds, "device": "cpu", "s_per_update": None if resumed or not wall else
                                      round(wall / updates, 4), "s_per_update_with_validation": None if resumed or not done else
                                      round(seconds / updates, 4), **json.loads((out / "peak.json").read_text())}))
    return json.loads(timing.read_text())


def bleu(data_bin: Path, ckpt: Path, split: str, ref: Path, out: Path, a, post=("--post-process", "sentencepiece")):
    """fairseq-generate (beam 4) of ``split``, scored by scripts/score_translation.py (sacreBLEU, tokens/s)."""
    print(f"[{a.name}]   fairseq-generate --beam 4: {split}", flush=True)
    gen, log = out / f"generate.{split}.out", out / f"generate.{split}.log"
    with open(gen, "w") as o, open(log, "w") as e:
        subprocess.run([tool("fairseq-generate"), data_bin, "--user-dir", "rfa_fairseq", "--path", ckpt, "--gen-subset", split,
                        "--task", "rfa_translation", "--beam", "4", "--batch-size", "64", "--max-len-a", "1.2", "--max-len-b", "10",
                        "--required-batch-size-multiple", "1", *post, *a.cpu_flag], stdout=o, stderr=e, check=True, cwd=ROOT, env=ENV)
    (score := out / f"score.{split}.json").unlink(missing_ok=True)
    run([PY, "scripts/score_translation.py", gen, log, ref, "--json", score], out / f"score.{split}.log")
    return json.loads(score.read_text().splitlines()[-1])


def eval_lm(data: Path, ckpt: Path, log: Path, a, *flags) -> float:  # test perplexity from fairseq-eval-lm
    text = run([tool("fairseq-eval-lm"), data, "--user-dir", "rfa_fairseq", "--path", ckpt, "--gen-subset", "test",
                *flags, *a.cpu_flag], log)
    return float(re.search(r"Perplexity: ([\d.]+)", text).group(1))


def valid_scores(log: str, subset="valid") -> list:
    """The metrics of every "valid on SUBSET" line of a fairseq log, as dicts of floats."""
    lines = re.findall(rf"valid on '{subset}' subset (.*)", log)
    return [{k: float(v) for k, v in re.findall(r"\| (\w+) ([\d.]+)", line)} for line in lines]


def folder(a, variant: str, seed: int) -> Path:
    return a.work / a.setting / (f"{variant}-seed{seed}" + (f"-u{a.updates}" if a.probe else ""))


def load(path: Path) -> list:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def label(spec, r) -> str:
    full = spec.SETTINGS.get(r["setting"], {}).get("updates", r["updates"])
    return r["setting"] + ("" if r["updates"] == full else f", {r['updates']} updates")


def spread(values, digits) -> str:
    mean = f"{statistics.mean(values):.{digits}f}" if values else "-"
    return mean if len(values) < 2 else f"{mean} ({min(values):.{digits}f}-{max(values):.{digits}f})"


def per_machine(rs, key, base, fmt) -> str:
    """Mean of ``key`` per device and thread count (only those compare), x the mean of ``base``'s on that machine."""
    def means(runs):
        found = {}
        for r in runs:
            if r.get(key) is not None:
                machine = f"{r.get('train_threads')} thr" if r.get("device", "cpu") == "cpu" else r["device"]
                found.setdefault(machine, []).append(r[key])
        return {m: statistics.mean(v) for m, v in found.items()}
    b = means(base)
    return "; ".join(format(v, fmt) + (f" ({v / b[m]:.2f}x, {m})" if b.get(m) else f" ({m})")
                     for m, v in sorted(means(rs).items())) or "-"


def report(spec, records) -> str:
    """A row per (setting, variant): METRICS as mean (min-max) over seeds, time and memory per machine (x softmax's)."""
    groups = {}
    for r in records:
        groups.setdefault((label(spec, r), r["variant"]), []).append(r)
    order = list(spec.SETTINGS), list(spec.VARIANTS)
    index = lambda names, x: names.index(x) if x in names else len(names)  # noqa: E731
    head = ["setting", "variant", "seeds", *(m[0] for m in spec.METRICS), "s/update", "peak MB"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for (name, variant), rs in sorted(groups.items(), key=lambda kv: (index(order[0], kv[1][0]["setting"]), kv[0][0],
                                                                      index(order[1], kv[0][1]))):
        base = groups.get((name, "softmax"), [])
        cells = [name, variant, ",".join(str(r["seed"]) for r in rs)]
        cells += [spread([r[k] for r in rs if r.get(k) is not None], d) for _, k, d in spec.METRICS]
        cells += [per_machine(rs, getattr(spec, "TIME", "s_per_update"), base, "#.3g"),
                  per_machine(rs, "peak_mb", base, ".0f")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(spec, argv=None):
    p = argparse.ArgumentParser(description=spec.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--setting", choices=list(spec.SETTINGS), default=next(iter(spec.SETTINGS)))
    p.add_argument("--variants", nargs="+", default=getattr(spec, "DEFAULT_VARIANTS", list(spec.VARIANTS)))
    p.add_argument("--seeds", nargs="+", type=int, default=[1])
    p.add_argument("--updates", type=int, help="train this many updates instead of the setting's (a probe, reported apart)")
    p.add_argument("--work", type=Path, default=ROOT / spec.WORK, help="data and run folders (default %(default)s)")
    p.add_argument("--out", type=Path, default=ROOT / spec.OUT, help="the JSONL of the runs (default %(default)s)")
    p.add_argument("--cpu", action="store_true", help="run on the CPU where a GPU is seen")
    p.add_argument("--progress", action="store_true", help="print a line per training log entry")
    p.add_argument("--report", action="store_true", help="print the table of the recorded runs and stop")
    if hasattr(spec, "rescore"):
        p.add_argument("--rescore", action="store_true", help="score the recorded runs again instead of training (alone on --out)")
    getattr(spec, "add_args", lambda parser: None)(p)
    a = p.parse_args(argv)
    if unknown := [v for v in a.variants if v not in spec.VARIANTS]:
        p.error(f"unknown variant(s) {', '.join(unknown)}; known: {', '.join(spec.VARIANTS)}")
    if a.updates is not None and a.updates < 1:
        p.error(f"--updates must be at least 1, got {a.updates}")
    if a.report:
        return print(report(spec, load(a.out)))
    s = dict(spec.SETTINGS[a.setting])
    a.probe = a.updates is not None and a.updates != s["updates"]
    a.updates = s["updates"] = a.updates or s["updates"]
    import torch
    a.name, a.gpu = spec.NAME, torch.cuda.is_available() and not a.cpu
    a.cpu_flag = [] if a.gpu else ["--cpu"]
    a.work.mkdir(parents=True, exist_ok=True)
    data, records = spec.prepare(a), load(a.out)
    if getattr(a, "rescore", False):  # the chosen recorded runs whose folder is still there, --out rewritten after each
        for r in (r for r in records if (r["setting"], r["updates"]) == (a.setting, a.updates) and r["variant"] in a.variants
                  and r["seed"] in a.seeds):
            out = folder(a, r["variant"], r["seed"])
            if not out.is_dir():
                print(f"[{spec.NAME}] {r['variant']} seed {r['seed']}: no folder {out}, left as recorded", flush=True)
                continue
            print(f"[{spec.NAME}] {a.setting} {r['variant']} seed {r['seed']}: rescoring", flush=True)
            r.update(spec.rescore(r["variant"], s, r["seed"], data, out, a, r))
            a.out.with_suffix(".tmp").write_text("".join(json.dumps(x) + "\n" for x in records))
            a.out.with_suffix(".tmp").replace(a.out)
        return
    for seed in a.seeds:
        for variant in a.variants:
            what = f"[{spec.NAME}] {a.setting} {variant} seed {seed}" + (f", {a.updates} updates" if a.probe else "")
            if (a.setting, variant, seed, a.updates) in {(r["setting"], r["variant"], r["seed"], r["updates"]) for r in load(a.out)}:
                print(f"{what}: recorded, skipped", flush=True)
                continue
            print(f"{what}: running", flush=True)
            (out := folder(a, variant, seed)).mkdir(parents=True, exist_ok=True)
            record = {"setting": a.setting, "variant": variant, "seed": seed, "updates": a.updates,
                      "train_threads": int(os.environ.get("OMP_NUM_THREADS") or len(os.sched_getaffinity(0))),
                      **spec.run_one(variant, s, seed, data, out, a)}
            with open(a.out, "a") as f:
                f.write(json.dumps(record) + "\n")
            print(f"{what}: {json.dumps({k: v for k, v in record.items() if k in [m[1] for m in spec.METRICS]})}", flush=True)
