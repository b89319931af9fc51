#!/usr/bin/env python
"""Softmax -> RFA-Gate conversion on Multi30k de-en (T2R-style finetuning) against RFA-Gate trained
from scratch: a resumable queue that appends one JSON line per scored model.

    python results/convert_study.py                      # N = 2000 updates, finetune N/10 and N/5
    python results/convert_study.py --updates 2000 --fractions 0.1 0.2 --seeds 1
    python results/convert_study.py --report

Rows, each scored by sacreBLEU on the detokenised test set (beam 4), same model as
results/quality_study.py's "final" setting (3+3 layers, 256 dims, FFN 1024, 4 heads, shared
embeddings):
  softmax           transformer_iwslt_de_en trained for N updates
  converted         scripts/convert_from_softmax.py --rfa-gate --cross-attention rfa of it, before
                    any finetuning (the paper's model: RFA-Gate self- and cross attention)
  finetuned-f       the converted model finetuned (fairseq-train --finetune-from-model) f*N updates
  converted_softcross, finetuned_softcross-f
                    the same with --cross-attention softmax: the trained cross attention is kept,
                    only the decoder's self-attention becomes RFA-Gate
  scratch-f, scratch_softcross-f
                    rfa_transformer_iwslt_de_en --rfa-gate (with --cross-attention rfa, softmax)
                    trained from scratch for N + f*N updates
Every step keeps its checkpoint under --work and a scored row is skipped when run again.

--from-quality-study DIR starts the softmax and scratch rows from the checkpoints of
results/quality_study.py's final runs of the same seed (DIR/final/softmax-seedS, gate_bias2-seedS,
gate_softcross-seedS): the same model, data, optimiser, schedule and seed, so the softmax model is
that run's, and a scratch row resumes it from update N to N + f*N (inverse_sqrt depends on the
update number only, and fairseq resumes the data order and the random draws exactly). The train
time of such a row is then that of its last f*N updates only.
"""
import argparse
import gzip
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # rfa_fairseq, to read checkpoints (saved_updates)
PY = sys.executable
BIN = Path(PY).parent
RFA_GATE = ["--user-dir", "rfa_fairseq", "--arch", "rfa_transformer_iwslt_de_en", "--rfa-gate"]
# fairseq's own model; the plugin allow-lists the classes fairseq pickles into checkpoints, which
# fairseq-train needs to resume a run (it loads them with weights_only)
SOFTMAX = ["--user-dir", "rfa_fairseq", "--arch", "transformer_iwslt_de_en"]


def run(cmd, log):
    with open(log, "w") as f:
        subprocess.run([str(c) for c in cmd], stdout=f, stderr=subprocess.STDOUT, check=True, cwd=ROOT)
    return Path(log).read_text()


def prepare(work: Path, smoke: bool) -> Path:
    data = work / "data"
    if smoke:  # the first lines of the shipped tokenised text, no subword model
        if not (data / "bin" / "dict.en.txt").exists():
            data.mkdir(parents=True, exist_ok=True)
            for split, n in (("train", 300), ("valid", 30), ("test", 20)):
                for lang in ("de", "en"):
                    with gzip.open(ROOT / f"data/multi30k/{split}.{lang}.gz", "rt", encoding="utf-8") as f:
                        lines = [next(f) for _ in range(n)]
                    (data / f"{split}.{lang}").write_text("".join(lines), encoding="utf-8")
            run([BIN / "fairseq-preprocess", "--source-lang", "de", "--target-lang", "en", "--joined-dictionary",
                 "--workers", "1", "--trainpref", data / "train", "--validpref", data / "valid", "--testpref",
                 data / "test", "--destdir", data / "bin"], work / "preprocess.log")
            (data / "test.ref.en").write_text((data / "test.en").read_text(encoding="utf-8"), encoding="utf-8")
        return data
    subprocess.run(["bash", "scripts/prepare_multi30k.sh", str(data)], check=True, cwd=ROOT,
                   env={**os.environ, "PATH": f"{BIN}:{os.environ.get('PATH', '')}"})
    return data


def model_args(a) -> list:
    return ["--share-all-embeddings", "--encoder-layers", a.layers, "--decoder-layers", a.layers,
            "--encoder-embed-dim", a.dim, "--decoder-embed-dim", a.dim, "--encoder-ffn-embed-dim", 4 * a.dim,
            "--decoder-ffn-embed-dim", 4 * a.dim, "--encoder-attention-heads", a.heads,
            "--decoder-attention-heads", a.heads]


def train(a, data: Path, out: Path, arch: list, updates: int, seed: int, extra=()):
    log = run([BIN / "fairseq-train", data / "bin", *arch, *model_args(a), "--dropout", "0.1", "--optimizer", "adam",
               "--adam-betas", "(0.9, 0.98)", "--clip-norm", "1.0", "--lr", a.lr, "--lr-scheduler", "inverse_sqrt",
               "--warmup-updates", max(1, min(400, updates // 5)), "--criterion", "label_smoothed_cross_entropy",
               "--label-smoothing", "0.1", "--max-tokens", "4000", "--seed", seed, "--max-update", updates,
               "--save-dir", out, "--no-epoch-checkpoints", "--log-format", "simple", "--log-interval", "100",
               "--cpu", "--num-workers", "0", *extra], out / "train.log")
    done = re.search(r"done training in ([\d.]+) seconds", log)
    return float(done.group(1)) if done else None


def bleu(a, data: Path, ckpt: Path, out: Path) -> float:
    gen, log = out / "generate.test.out", out / "generate.test.log"
    post = [] if a.smoke else ["--post-process", "sentencepiece"]
    with open(gen, "w") as o, open(log, "w") as e:
        subprocess.run([BIN / "fairseq-generate", data / "bin", "--user-dir", "rfa_fairseq", "--path", ckpt,
                        "--gen-subset", "test", "--beam", "4", "--batch-size", "64", "--max-len-a", "1.2",
                        "--max-len-b", "10", "--required-batch-size-multiple", "1", "--cpu", *post],
                       stdout=o, stderr=e, check=True, cwd=ROOT)
    score = out / "score.json"
    score.unlink(missing_ok=True)
    subprocess.run([PY, "scripts/score_translation.py", gen, log, data / "test.ref.en", "--json", score], check=True,
                   cwd=ROOT, stdout=subprocess.DEVNULL)
    return json.loads(score.read_text().splitlines()[-1])["bleu"]


def rows(a):
    """(row name, updates in all) in dependency order."""
    n = a.updates
    yield "softmax", n
    for converted in ("converted", "converted_softcross"):
        yield converted, n
        for f in a.fractions:
            yield f"{converted.replace('converted', 'finetuned')}-{f:g}", n + round(f * n)
    for scratch in ("scratch", "scratch_softcross"):
        for f in a.fractions:
            yield f"{scratch}-{f:g}", n + round(f * n)


class NotReady(RuntimeError):
    """A row's starting point (a quality-study run) is missing or still training."""


def saved_updates(checkpoint: Path) -> int:
    import torch

    import rfa_fairseq  # noqa: F401  (allow-lists what fairseq checkpoints pickle, for weights_only)
    return torch.load(checkpoint, map_location="cpu", weights_only=True)["optimizer_history"][-1]["num_updates"]


def start_from(a, seed: int, run_name: str, out: Path) -> bool:
    """Seed ``out`` with the quality study's checkpoint of ``run_name`` (see the module docstring);
    True if ``out`` holds such a copy."""
    marker = out / "from_quality_study.txt"
    if a.from_quality_study is None or (out / "checkpoint_last.pt").exists():
        return marker.exists()
    src = a.from_quality_study / "final" / f"{run_name}-seed{seed}" / "checkpoint_last.pt"
    first = f"(run results/quality_study.py --setting final --variants {run_name} --seeds {seed} first)"
    if not src.exists():
        raise NotReady(f"--from-quality-study: {src} does not exist {first}")
    done = saved_updates(src)
    if done < a.updates:  # still training: a copy would repeat the rest of that run here
        raise NotReady(f"--from-quality-study: {src} is at update {done} of {a.updates} {first}")
    shutil.copy(src, out / "checkpoint_last.pt")
    marker.write_text(f"{src}\n")
    return True


def make(row: str, a, seed: int, data: Path) -> tuple:
    """Train or convert what ``row`` needs (fairseq-train resumes what exists); returns (checkpoint,
    training seconds, the row's folder)."""
    work = a.work / f"u{a.updates}-seed{seed}"
    softmax = work / "softmax"
    out = work / row
    out.mkdir(parents=True, exist_ok=True)
    if row == "softmax":
        # a copy is trained already: fairseq-train would resume it for one more update before it
        # checks --max-update
        seconds = None if start_from(a, seed, "softmax", out) else train(a, data, out, SOFTMAX, a.updates, seed)
        return out / "checkpoint_last.pt", seconds, out
    kind, _, f = row.partition("-")
    softcross = kind.endswith("_softcross")
    cross = ["--cross-attention", "softmax" if softcross else "rfa"]
    converted = work / ("converted_softcross.pt" if softcross else "converted.pt")
    if not converted.exists():
        run([PY, "scripts/convert_from_softmax.py", "--input", softmax / "checkpoint_last.pt", "--output", converted,
             "--seed", seed, "--rfa-gate", *cross], work / f"{converted.stem}.log")
    if not f:
        return converted, None, out
    extra = round(float(f) * a.updates)
    if kind.startswith("finetuned"):
        seconds = train(a, data, out, RFA_GATE + cross, extra, seed, ["--finetune-from-model", converted])
    else:
        start_from(a, seed, "gate_softcross" if softcross else "gate_bias2", out)
        seconds = train(a, data, out, RFA_GATE + cross, a.updates + extra, seed)
    return out / "checkpoint_last.pt", seconds, out


def load(path: Path):
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def report(records):
    print("| model | updates in all | seed | test BLEU | train s |")
    print("|---|---|---|---|---|")
    for r in records:
        print(f"| {r['row']} | {r['total_updates']} | {r['seed']} | {r['test_bleu']:.2f} | {r['train_s']} |")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--updates", type=int, default=2000, help="N: the softmax model's training updates")
    p.add_argument("--fractions", type=float, nargs="+", default=[0.1, 0.2], help="finetuning budgets, times N")
    p.add_argument("--seeds", nargs="+", type=int, default=[1])
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--lr", default="2e-3")
    p.add_argument("--smoke", action="store_true", help="tiny data without a subword model (tests)")
    p.add_argument("--out", type=Path, default=ROOT / "results/convert_study.jsonl")
    p.add_argument("--work", type=Path, default=ROOT / "work/convert_study")
    p.add_argument("--from-quality-study", type=Path, default=None, metavar="DIR",
                   help="start the softmax and scratch rows from results/quality_study.py's final runs in DIR "
                        "(its --work): see above")
    p.add_argument("--report", action="store_true", help="print the recorded results and stop")
    a = p.parse_args(argv)
    if a.report:
        report(load(a.out))
        return
    a.work.mkdir(parents=True, exist_ok=True)
    data = prepare(a.work, a.smoke)
    waiting = []
    for seed in a.seeds:
        for row, total in rows(a):
            if (row, a.updates, seed) in {(r["row"], r["updates"], r["seed"]) for r in load(a.out)}:
                print(f"[convert] {row} seed {seed}: recorded, skipped", flush=True)
                continue
            print(f"[convert] {row} seed {seed}: running", flush=True)
            try:
                ckpt, seconds, out = make(row, a, seed, data)
            except NotReady as e:
                if not row.startswith("scratch"):
                    raise  # every other row needs the softmax model
                print(f"[convert] {row} seed {seed}: not ready, skipped: {e}", flush=True)
                waiting.append(f"{row} seed {seed}")
                continue
            record = {"row": row, "updates": a.updates, "total_updates": total, "seed": seed, "train_s": seconds,
                      "from_quality_study": a.from_quality_study is not None and row.startswith(("softmax", "scratch")),
                      "test_bleu": bleu(a, data, ckpt, out),
                      "model": f"{a.layers}+{a.layers} x {a.dim}, {a.heads} heads",
                      "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                               text=True, cwd=ROOT).stdout.strip()}
            with open(a.out, "a") as f:
                f.write(json.dumps(record) + "\n")
            print(f"[convert] {json.dumps(record)}", flush=True)
    if waiting:
        sys.exit(f"convert_study: not run yet, their quality-study runs not finished: {', '.join(waiting)}")


if __name__ == "__main__":
    main()
