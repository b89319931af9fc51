"""results/lra_study.py: the table it reports from recorded runs (ratios to softmax per setting,
device and thread count), and its refusals."""
import json

import pytest

from rfa_test_utils import load_script


def study():
    return load_script("results", "lra_study.py")


def record(attention, seed, acc, spu, peak, threads=1):
    return {"attention": attention, "setting": "tiny", "seed": seed, "test_accuracy": acc, "valid_accuracy": acc + 1,
            "s_per_update": spu, "peak_mb": peak, "train_threads": threads, "device": "cpu"}


def test_report_gives_ratios_to_softmax(tmp_path, capsys):
    out = tmp_path / "study.jsonl"
    rows = [record("lara", 1, 30.0, 0.3, 600), record("softmax", 1, 40.0, 0.2, 500),
            record("lara", 2, 34.0, 0.5, 700), record("rfa", 1, 20.0, None, 550),
            record("softmax", 1, 10.0, 1.0, 900, threads=2)]
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    study().main(["--report", "--out", str(out)])
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| tiny")]
    # softmax first; LARA over two seeds (median time 0.4 s = 2x softmax's, peak 650 MB = 1.3x);
    # a run without a time per update (resumed) shows none; two threads are a group of their own
    assert lines == ["| tiny | cpu, 1 | softmax | 1 | 40.0 | 41.0 | 0.200 (1.00x) | 500 (1.00x) |",
                     "| tiny | cpu, 1 | rfa | 1 | 20.0 | 21.0 | - | 550 (1.10x) |",
                     "| tiny | cpu, 1 | lara | 1,2 | 32.0 (30.0-34.0) | 33.0 | 0.400 (2.00x) | 650 (1.30x) |",
                     "| tiny | cpu, 2 | softmax | 1 | 10.0 | 11.0 | 1.000 (1.00x) | 900 (1.00x) |"]


def test_unknown_attention_is_refused_by_name(capsys):
    with pytest.raises(SystemExit):
        study().main(["--attentions", "rfa", "linformer"])
    assert "linformer" in capsys.readouterr().err


def test_a_shortened_run_is_reported_apart(tmp_path, capsys):
    out = tmp_path / "study.jsonl"
    probe = dict(record("softmax", 1, 17.0, 9.0, 900), updates=20)
    rows = [dict(record("softmax", 1, 40.0, 0.2, 500), updates=400), probe, dict(probe, attention="lara", s_per_update=3.0)]
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    study().main(["--report", "--out", str(out)])
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| tiny")]
    assert lines == ["| tiny | cpu, 1 | softmax | 1 | 40.0 | 41.0 | 0.200 (1.00x) | 500 (1.00x) |",
                     "| tiny, 20 updates | cpu, 1 | softmax | 1 | 17.0 | 18.0 | 9.000 (1.00x) | 900 (1.00x) |",
                     "| tiny, 20 updates | cpu, 1 | lara | 1 | 17.0 | 18.0 | 3.000 (0.33x) | 900 (1.00x) |"]


def test_updates_below_one_are_refused(tmp_path, capsys):
    with pytest.raises(SystemExit):
        study().main(["--updates", "0", "--work", str(tmp_path), "--out", str(tmp_path / "s.jsonl")])
    assert "--updates must be at least 1" in capsys.readouterr().err
