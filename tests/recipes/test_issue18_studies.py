"""The two study scripts of the stateful LM and conversion results, in tiny configurations: every
row is recorded once, a second run skips what is recorded, and --report prints the table."""
import gzip
import json
import os
import shutil
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from rfa_test_utils import REPO, load_script

ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")


def study(script, *args):
    proc = subprocess.run([sys.executable, os.path.join(REPO, "results", script), *map(str, args)], env=ENV,
                          capture_output=True, text=True, timeout=600, cwd=REPO)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return proc.stdout


def test_stateful_lm_study_smoke(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    with gzip.open(os.path.join(REPO, "data/multi30k/train.en.gz"), "rt", encoding="utf-8") as f:
        lines = [next(f) for _ in range(1200)]
    for name, off in (("wiki.valid.tokens", 0), ("wiki.test.tokens", 600)):
        text = "".join(f" = Article {a} = \n" + "".join(f" {s}" for s in lines[off + 30 * a:off + 30 * a + 30])
                       for a in range(20))
        (src / name).write_text(text, encoding="utf-8")
    out = tmp_path / "out.jsonl"
    args = ["--source", src, "--work", tmp_path / "work", "--out", out, "--updates", 3, "--warmup", 1, "--block", 32, "--layers", 1,
            "--dim", 32, "--cutoffs", "200,400", "--variants", "rfa_gate_stateful"]
    study("stateful_lm_study.py", *args)
    (record,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert record["train_task"] == "rfa_stateful_lm" and record["updates"] == 3
    assert 1 < record["test_ppl_stateful"] < 1e4 and 1 < record["test_ppl_blocks"] < 1e4
    assert 1 <= record["best_update"] <= 3 and record["valid_ppl_best"] > 1  # the scored checkpoint: the best on valid
    assert "recorded, skipped" in study("stateful_lm_study.py", *args)
    assert "| rfa_gate_stateful | rfa_stateful_lm | 3 |" in study("stateful_lm_study.py", "--report", "--out", out)


def test_convert_study_smoke(tmp_path):
    out = tmp_path / "out.jsonl"
    args = ["--smoke", "--work", tmp_path / "work", "--out", out, "--updates", 5, "--fractions", 0.4, "--layers", 1,
            "--dim", 32]
    study("convert_study.py", *args)
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["row"], r["total_updates"]) for r in records] == [
        ("softmax", 5), ("converted", 5), ("finetuned-0.4", 7), ("converted_softcross", 5),
        ("finetuned_softcross-0.4", 7), ("scratch-0.4", 7), ("scratch_softcross-0.4", 7)]
    assert all(r["test_bleu"] >= 0 for r in records)
    assert "recorded, skipped" in study("convert_study.py", *args)
    assert "| finetuned-0.4 | 7 | 1 |" in study("convert_study.py", "--report", "--out", out)


def test_convert_study_starts_from_the_quality_study(tmp_path):
    """--from-quality-study: the softmax row is the quality study's model (not trained again) and
    a scratch row resumes the quality study's RFA-Gate run; a missing softmax run stops the queue
    with its name, a missing RFA-Gate run only the scratch rows that need it."""
    args = ["--smoke", "--updates", 4, "--fractions", 0.5, "--layers", 1, "--dim", 32]
    study("convert_study.py", *args, "--work", tmp_path / "a", "--out", tmp_path / "a.jsonl")
    quality = tmp_path / "quality" / "final"

    def stand_in(run_name, row):
        (quality / f"{run_name}-seed1").mkdir(parents=True)
        shutil.copy(tmp_path / "a" / "u4-seed1" / row / "checkpoint_last.pt", quality / f"{run_name}-seed1")

    def queue(source):
        return subprocess.run([sys.executable, os.path.join(REPO, "results", "convert_study.py"), *map(str, args),
                               "--work", tmp_path / "b", "--out", tmp_path / "b.jsonl", "--from-quality-study",
                               source], env=ENV, capture_output=True, text=True, cwd=REPO)

    proc = queue(tmp_path / "missing")
    assert proc.returncode != 0 and "missing/final/softmax-seed1/checkpoint_last.pt does not exist" in proc.stderr
    stand_in("softmax", "softmax")
    stand_in("gate_bias2", "scratch-0.5")
    proc = queue(tmp_path / "quality")
    assert proc.returncode != 0 and "not run yet" in proc.stderr and "scratch_softcross-0.5 seed 1" in proc.stderr
    stand_in("gate_softcross", "scratch_softcross-0.5")
    assert queue(tmp_path / "quality").returncode == 0
    records = {r["row"]: r for r in map(json.loads, (tmp_path / "b.jsonl").read_text().splitlines())}
    assert len(records) == 7
    first = {r["row"]: r for r in map(json.loads, (tmp_path / "a.jsonl").read_text().splitlines())}
    assert records["softmax"]["from_quality_study"] and not records["finetuned-0.5"]["from_quality_study"]
    # the softmax stand-in is the first queue's softmax model, scored as it is
    assert records["softmax"]["test_bleu"] == first["softmax"]["test_bleu"]
    for row in ("scratch-0.5", "scratch_softcross-0.5"):
        assert records[row]["from_quality_study"]
        assert "Loaded checkpoint" in (tmp_path / "b" / "u4-seed1" / row / "train.log").read_text()

def test_convert_study_does_not_start_from_an_unfinished_quality_run(tmp_path):
    """A quality-study run still training (fewer updates saved than --updates) is not copied: the
    copy would repeat the rest of that run."""
    convert_study = load_script("results", "convert_study.py")
    run = tmp_path / "quality" / "final" / "gate_bias2-seed1"
    run.mkdir(parents=True)
    torch.save({"optimizer_history": [{"num_updates": 3}]}, run / "checkpoint_last.pt")
    out = tmp_path / "scratch"
    out.mkdir()
    a = SimpleNamespace(from_quality_study=tmp_path / "quality", updates=4)
    with pytest.raises(convert_study.NotReady, match="gate_bias2-seed1/checkpoint_last.pt is at update 3 of 4"):
        convert_study.start_from(a, 1, "gate_bias2", out)
    assert not (out / "checkpoint_last.pt").exists()
    a.updates = 3
    assert convert_study.start_from(a, 1, "gate_bias2", out) and (out / "checkpoint_last.pt").exists()

