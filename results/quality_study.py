#!/usr/bin/env python
"""Translation quality of softmax, RFA, RFA-Gate and their options on Multi30k de-en: a
resumable queue of training runs, scored on the valid and test splits.

    python results/quality_study.py --setting screen --variants softmax rfa rfa_gate --seeds 1
    python results/quality_study.py --setting final --variants softmax rfa_gate --seeds 1 2 3
    python results/quality_study.py --report            # the table of what is recorded

Every run trains one model with fairseq-train, decodes valid and test with fairseq-generate
(beam 4), scores them with sacreBLEU and appends one JSON line to --out (default
results/quality_study.jsonl): BLEU, seconds per update, and the diagnostics of
scripts/rfa_diagnostics.py on the valid split. A run already recorded is skipped; an interrupted
one resumes from its checkpoint (its work folder is kept under work/study/). Two training jobs on
the same cores spoil each other's timings: run one queue at a time, or pin each queue to its own
core (``OMP_NUM_THREADS=1 taskset -c N``); each record says how many threads its training had.

Settings choose on the valid split; the test split is reported.
"""
import argparse
import gzip
import json
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
BIN = Path(PY).parent

# model and budget; both use fairseq's transformer_iwslt_de_en optimiser settings scaled down
SETTINGS = {
    # the screening budget: cheap, one seed, ideas against each other
    "screen": dict(layers=2, dim=256, ffn=512, heads=4, updates=600, warmup=150, lr="3e-3"),
    # the final comparison: softmax well trained at this size
    "final": dict(layers=3, dim=256, ffn=1024, heads=4, updates=2000, warmup=400, lr="2e-3"),
    # transformer-base size (6+6 x 512), trained briefly: the decoding-speed benchmark needs its real
    # output lengths, not converged weights (RFA models of this size: scripts/convert_from_softmax.py)
    "base": dict(layers=6, dim=512, ffn=2048, heads=8, updates=400, warmup=200, lr="1e-3"),
}
PLUGIN = ["--user-dir", "rfa_fairseq", "--arch", "rfa_transformer_iwslt_de_en"]
RFA = PLUGIN + ["--cross-attention", "rfa"]  # the paper's model: RFA cross attention too
GATE = RFA + ["--rfa-gate"]
PAPER_GATE = GATE + ["--rfa-gate-bias", "0"]  # the paper's gate (bias 0 was the default until the study)
VARIANTS = {
    # fairseq's own model; --user-dir: the plugin allow-lists the classes fairseq pickles into
    # checkpoints, which fairseq-train needs to resume an interrupted run (weights_only loading)
    "softmax": ["--user-dir", "rfa_fairseq", "--arch", "transformer_iwslt_de_en"],
    "rfa": RFA,
    "rfa_gate": PAPER_GATE,
    # each idea of the quality issue alone
    "gate_bias2": GATE + ["--rfa-gate-bias", "2"],
    "gate_decay": PAPER_GATE + ["--rfa-gate-form", "decay"],
    "gate_decay_bias2": GATE + ["--rfa-gate-form", "decay", "--rfa-gate-bias", "2"],
    "rfa_authors_floor": RFA + ["--rfa-eps", "1.56", "--rfa-cross-abs-denominator"],
    "gate_sigma2": PAPER_GATE + ["--rfa-init-sigma", "2"],
    "rfa_sigma2": RFA + ["--rfa-init-sigma", "2"],
    "rfa_norm_rescale": RFA + ["--rfa-cross-norm-rescale"],
    # the other feature maps
    "favor": RFA + ["--rfa-kernel", "favor"],
    "elu": RFA + ["--rfa-kernel", "elu"],
    "gate_elu": GATE + ["--rfa-kernel", "elu"],  # the default gate on elu features
    # RFA-Gate self-attention behind fairseq's softmax cross attention
    "gate_softcross": PLUGIN + ["--rfa-gate", "--cross-attention", "softmax"],
    "rfa_softcross": PLUGIN + ["--cross-attention", "softmax"],
    # half the causal state (issue "Decoding real sentences"): D = 32 features instead of 64
    "gate_softcross_f32": PLUGIN + ["--rfa-gate", "--rfa-causal-feature-dim", "32"],
    # positive features in the self-attention (no denominator clamping) behind softmax cross attention
    "elu_softcross": PLUGIN + ["--rfa-kernel", "elu"],
    "gate_elu_softcross": PLUGIN + ["--rfa-gate", "--rfa-kernel", "elu"],
    # linear encoders (issue "Linear-time encoder attention"), behind the default RFA-Gate decoder (softmax cross
    # attention) and behind fairseq's softmax decoder; LARA with 8 landmarks (Multi30k sources are 10-40 tokens)
    **{f"{prefix}enc_{kind}": decoder + ["--encoder-attention", kind] + (["--lara-landmarks", "8"] if kind == "lara" else [])
       for prefix, decoder in (("", PLUGIN + ["--rfa-gate"]),
                               ("softdec_", PLUGIN + ["--decoder-attention", "softmax"]))
       for kind in ("rfa", "favor", "lara")},
}


def has_rfa_modules(variant: str) -> bool:
    """Whether the model has RFA attention modules for scripts/rfa_diagnostics.py to read: an RFA
    decoder, or an rfa / favor encoder."""
    flags = VARIANTS[variant]
    rfa_decoder = flags[:len(PLUGIN)] == PLUGIN and "--decoder-attention" not in flags
    return rfa_decoder or any(flags[i + 1] in ("rfa", "favor") for i, f in enumerate(flags) if f == "--encoder-attention")


def run(cmd, log, **kw):
    with open(log, "w") as f:
        subprocess.run([str(c) for c in cmd], stdout=f, stderr=subprocess.STDOUT, check=True, cwd=ROOT, **kw)


def prepare(work: Path) -> Path:
    data = work / "data"
    subprocess.run(["bash", "scripts/prepare_multi30k.sh", str(data)], check=True, cwd=ROOT,
                   env={**os.environ, "PATH": f"{BIN}:{os.environ.get('PATH', '')}"})
    ref = data / "valid.ref.en"
    if not ref.exists():
        with gzip.open(ROOT / "data/multi30k/valid.en.gz", "rt", encoding="utf-8") as f:
            ref.write_text(f.read(), encoding="utf-8")
    return data


def score(data: Path, ckpt: Path, split: str, out: Path) -> dict:
    gen, log = out / f"generate.{split}.out", out / f"generate.{split}.log"
    with open(gen, "w") as o, open(log, "w") as e:
        subprocess.run([BIN / "fairseq-generate", data / "bin", "--user-dir", "rfa_fairseq", "--path", ckpt,
                        "--gen-subset", split, "--beam", "4", "--batch-size", "64", "--max-len-a", "1.2",
                        "--max-len-b", "10", "--post-process", "sentencepiece", "--required-batch-size-multiple", "1",
                        "--cpu"],
                       stdout=o, stderr=e, check=True, cwd=ROOT)
    ref = data / ("test.ref.en" if split == "test" else f"{split}.ref.en")
    record_file = out / f"score.{split}.json"
    record_file.unlink(missing_ok=True)
    subprocess.run([PY, "scripts/score_translation.py", gen, log, ref, "--json", record_file], check=True,
                   cwd=ROOT, stdout=subprocess.DEVNULL)
    return json.loads(record_file.read_text().splitlines()[-1])


def feature_noise(data: Path, ckpt: Path, out: Path, draws: int) -> dict:
    """Valid BLEU of the trained model decoded with ``draws`` other random-matrix draws, and with
    one draw of four times the features (scripts/redraw_features.py)."""
    found = {"valid_bleu_other_draws": [], "valid_bleu_4x_features": None}
    for i in range(draws + 1):
        redrawn = out / "redrawn.pt"
        extra = ["--feature-scale", 4] if i == draws else []
        run([PY, "scripts/redraw_features.py", ckpt, redrawn, "--seed", 1000 + i, *extra], out / "redraw.log")
        bleu = score(data, redrawn, "valid", out)["bleu"]
        if i == draws:
            found["valid_bleu_4x_features"] = bleu
        else:
            found["valid_bleu_other_draws"].append(bleu)
        redrawn.unlink()
    return found


def train(variant: str, s: dict, seed: int, data: Path, out: Path):
    model = ["--encoder-layers", s["layers"], "--decoder-layers", s["layers"],
             "--encoder-embed-dim", s["dim"], "--decoder-embed-dim", s["dim"],
             "--encoder-ffn-embed-dim", s["ffn"], "--decoder-ffn-embed-dim", s["ffn"],
             "--encoder-attention-heads", s["heads"], "--decoder-attention-heads", s["heads"]]
    run([BIN / "fairseq-train", data / "bin", *VARIANTS[variant], "--share-all-embeddings", *model,
         "--dropout", "0.1", "--optimizer", "adam", "--adam-betas", "(0.9, 0.98)", "--clip-norm", "1.0",
         "--lr", s["lr"], "--lr-scheduler", "inverse_sqrt", "--warmup-updates", s["warmup"],
         "--criterion", "label_smoothed_cross_entropy", "--label-smoothing", "0.1",
         "--max-tokens", "4000", "--seed", seed, "--max-update", s["updates"],
         "--save-dir", out, "--no-epoch-checkpoints", "--log-format", "simple", "--log-interval", "100", "--cpu"],
        out / "train.log")


def train_threads() -> int:
    """The CPU threads fairseq-train gets: OMP_NUM_THREADS if set, else the cores this process may use."""
    return int(os.environ.get("OMP_NUM_THREADS") or len(os.sched_getaffinity(0)))


def one_run(variant: str, setting: str, seed: int, data: Path, work: Path, draws: int = 0) -> dict:
    s = SETTINGS[setting]
    out = work / setting / f"{variant}-seed{seed}"
    out.mkdir(parents=True, exist_ok=True)
    timing = out / "timing.json"  # written once training has finished
    if not timing.exists():
        resumed = (out / "checkpoint_last.pt").exists()
        train(variant, s, seed, data, out)
        done = re.search(r"done training in ([\d.]+) seconds", (out / "train.log").read_text())
        timing.write_text(json.dumps({"train_s": float(done.group(1)) if done else None, "resumed": resumed,
                                      "threads": train_threads()}))
    t = json.loads(timing.read_text())
    ckpt = out / "checkpoint_last.pt"
    record = {"variant": variant, "setting": setting, "seed": seed, "flags": " ".join(map(str, VARIANTS[variant])),
              "updates": s["updates"], "train_s": t["train_s"],
              # only a run trained in one go has a meaningful time per update
              "s_per_update": None if t["resumed"] or not t["train_s"] else round(t["train_s"] / s["updates"], 3),
              "train_threads": t.get("threads"),
              "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                       cwd=ROOT).stdout.strip()}
    for split in ("valid", "test"):
        r = score(data, ckpt, split, out)
        record[f"{split}_bleu"] = r["bleu"]
        record[f"{split}_tokens_per_s"] = r.get("tokens_per_s")
    if has_rfa_modules(variant):
        run([PY, "scripts/rfa_diagnostics.py", data / "bin", "--path", ckpt, "--json", out / "diagnostics.json"],
            out / "diagnostics.log")
        mods = json.loads((out / "diagnostics.json").read_text())["modules"]
        record["diagnostics"] = {m["module"].replace("decoder.layers.", ""): {
            k: (round(m[k], 4) if isinstance(m[k], float) else m[k])
            for k in ("sigma_mean", "mean_gate", "clamped_pct", "negative_pct")} for m in mods}
        if draws:
            record.update(feature_noise(data, ckpt, out, draws))
    return record


def load(path: Path):
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def report(records):
    groups = {}
    for r in records:
        groups.setdefault((r["setting"], r["variant"]), []).append(r)
    print("| setting | variant | seeds | valid BLEU | test BLEU (mean, min-max) | s/update |")
    print("|---|---|---|---|---|---|")
    for (setting, variant), rs in sorted(groups.items(), key=lambda kv: (kv[0][0], list(VARIANTS).index(kv[0][1])
                                                                          if kv[0][1] in VARIANTS else 99)):
        v = [r["valid_bleu"] for r in rs]
        t = [r["test_bleu"] for r in rs]
        spu = {}  # times per update are comparable only at the same number of threads
        for r in rs:
            if r.get("s_per_update"):
                spu.setdefault(r.get("train_threads"), []).append(r["s_per_update"])
        spread = f" ({min(t):.2f}-{max(t):.2f})" if len(t) > 1 else ""
        seeds = ",".join(str(r["seed"]) for r in rs)
        speed = "; ".join(f"{statistics.mean(v):.2f}" + (f" ({t} thr)" if t else "")
                          for t, v in sorted(spu.items(), key=lambda kv: kv[0] or 0)) or "-"
        print(f"| {setting} | {variant} | {seeds} | {statistics.mean(v):.2f} | {statistics.mean(t):.2f}{spread} "
              f"| {speed} |")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--setting", choices=list(SETTINGS), default="screen")
    p.add_argument("--variants", nargs="+", default=["softmax", "rfa", "rfa_gate"])
    p.add_argument("--seeds", nargs="+", type=int, default=[1])
    p.add_argument("--out", type=Path, default=ROOT / "results/quality_study.jsonl")
    p.add_argument("--work", type=Path, default=ROOT / "work/study")
    p.add_argument("--eval-draws", type=int, default=0,
                   help="RFA variants: also decode valid with this many other random-matrix draws and with "
                        "four times the random features (the feature noise's share of the BLEU)")
    p.add_argument("--report", action="store_true", help="print the recorded results and stop")
    args = p.parse_args(argv)
    unknown = [v for v in args.variants if v not in VARIANTS]
    if unknown:
        p.error(f"unknown variant(s) {unknown}; known: {', '.join(VARIANTS)}")
    if args.report:
        report(load(args.out))
        return
    data = prepare(args.work)
    for seed in args.seeds:
        for variant in args.variants:
            done = {(r["variant"], r["setting"], r["seed"]) for r in load(args.out)}
            if (variant, args.setting, seed) in done:
                print(f"[study] {args.setting} {variant} seed {seed}: recorded, skipped", flush=True)
                continue
            print(f"[study] {args.setting} {variant} seed {seed}: running", flush=True)
            record = one_run(variant, args.setting, seed, data, args.work, args.eval_draws)
            with open(args.out, "a") as f:
                f.write(json.dumps(record) + "\n")
            print(f"[study] {args.setting} {variant} seed {seed}: valid {record['valid_bleu']}, "
                  f"test {record['test_bleu']}, {record['train_s']} s", flush=True)


if __name__ == "__main__":
    main()
