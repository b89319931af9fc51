"""bench/report.py renders every kept result and new runs; bench/harness.py measures what it says."""
import glob
import json
import os
import time

import pytest
import torch

from bench import harness, report
from rfa_test_utils import REPO


def result(bench, rows, **meta):
    return {"meta": dict(device="cpu", torch="2", torch_threads=1, date="2026-01-01", command="x", bench=bench,
                         args={}, **meta), "rows": rows}


def test_report_has_one_line_per_length_and_writes_a_png(tmp_path):
    rows = [dict(model=m, length=n, tokens_per_s=s, seconds=1 / s, peak_bytes=2**20, state_bytes=2**19)
            for n in (32, 512) for m, s in (("softmax", 10.0), ("rfa", 20.0))]
    harness.add_ratios(rows, "softmax")
    path = tmp_path / "d.json"
    path.write_text(json.dumps(result("decode-synthetic", rows)))
    text = report.main([str(path), "--figure", str(tmp_path / "f.png")])
    lines = [line for line in text.splitlines() if line.startswith("| ")]
    assert [line.split(" | ")[0] for line in lines[1:]] == ["| 32", "| 512"]
    assert "20.0 (2.00x)" in lines[1]
    assert (tmp_path / "f.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_figure_plots_a_checkpoint_runs_buckets_at_their_mean_output(tmp_path, monkeypatch):
    path = os.path.join(REPO, "bench", "results", "decode_documents_b8_1thr.json")
    with open(path) as f:
        rows = json.load(f)["rows"]
    drawn = []
    monkeypatch.setattr("matplotlib.axes.Axes.plot", lambda ax, x, y, **kw: drawn.append((kw["label"], x, y)))
    report.main([path, "--figure", str(tmp_path / "f.png")])
    speed = [(r["model"], *zip(*sorted((b["tokens"] / b["sentences"], b["tokens_per_s"]) for b in r["buckets"])))
             for r in rows]
    assert len(speed) > 1 and drawn[:len(speed)] == speed and [m for m, _, _ in drawn[len(speed):]] == [r["model"] for r in rows]


def test_every_kept_result_renders():
    files = sorted(glob.glob(os.path.join(REPO, "bench", "results", "*.json")))
    assert files
    text = report.main(files)
    assert text.count("### ") >= len(files)


def test_report_rejects_what_is_not_a_result(tmp_path, capsys):
    bad = tmp_path / "x.json"
    bad.write_text("{}")
    with pytest.raises(SystemExit):
        report.main([str(bad)])
    assert "not a benchmark result" in capsys.readouterr().err


def test_peak_memory_sees_an_allocation():
    with harness.PeakMemory("cpu") as mem:
        x = torch.ones(64 * 2**20 // 4)  # 64 MiB, touched
        del x
    if mem.peak_bytes is None:
        pytest.skip("neither /proc/self/clear_refs nor mallinfo2 is available")
    assert mem.peak_bytes >= 60 * 2**20


def test_allocated_bytes_see_what_an_op_holds_between_module_calls():
    """The sampling thread sees a tensor that lives and dies inside one call (no module hook fires),
    and each figure is kept apart with the peak their larger."""
    if harness._LIBC is None:
        pytest.skip("mallinfo2 is not available")

    def held():
        x = torch.ones(64 * 2**20 // 4)  # 64 MiB, live for a while
        time.sleep(0.05)
        return float(x[0])
    with harness.PeakMemory("cpu") as mem:
        held()
    assert mem.allocated_bytes >= 60 * 2**20
    assert mem.peak_bytes == max(b for b in (mem.allocated_bytes, mem.resident_bytes) if b is not None)


def test_timing_and_ratios():
    assert len(harness.timed(lambda: None, "cpu", repeats=3, clock="cpu")) == 3
    with pytest.raises(ValueError, match="cpu"):
        harness.timed(lambda: None, "cuda", clock="cpu")
    rows = harness.add_ratios([dict(model="a", length=1, tokens_per_s=4.0), dict(model="b", length=1, tokens_per_s=2.0),
                               dict(model="b", length=2, skipped="x")], "a")
    assert [r.get("ratio") for r in rows] == [1.0, 0.5, None]
