"""results/runner.py with a stand-in study (no training): the queue skips recorded runs, resumes an
interrupted one in its folder, keeps --updates probes apart, refuses bad input by name, and reports
the mean and range over seeds."""
import os
import sys
from types import SimpleNamespace

import pytest

from rfa_test_utils import REPO

sys.path.insert(0, os.path.join(REPO, "results"))
import runner  # noqa: E402


def stand_in(tmp_path, fail_once=()):
    """A study whose runs record test = 10 * seed + updates, and fail once for the variants in fail_once."""
    calls = []

    def run_one(variant, s, seed, data, out, a):
        calls.append((variant, seed, s["updates"], out))
        (out / "started").touch()  # what an interrupted run leaves behind, like a checkpoint
        if variant in fail_once and len([c for c in calls if c[0] == variant]) == 1:
            raise RuntimeError("interrupted")
        return {"test": 10.0 * seed + s["updates"], "valid": 1.0}

    spec = SimpleNamespace(__doc__="a stand-in", NAME="stand_in", OUT=str(tmp_path / "out.jsonl"),
                           WORK=str(tmp_path / "work"), SETTINGS={"small": {"updates": 5}, "big": {"updates": 50}},
                           VARIANTS={"softmax": [], "rfa": []}, METRICS=[("valid", "valid", 1), ("test", "test", 2)],
                           prepare=lambda a: "data", run_one=run_one)
    return spec, calls


def records(tmp_path):
    return runner.load(tmp_path / "out.jsonl")


def test_a_recorded_run_is_skipped(tmp_path):
    spec, calls = stand_in(tmp_path)
    runner.main(spec, ["--seeds", "1", "2", "--variants", "rfa", "--cpu"])
    runner.main(spec, ["--seeds", "1", "2", "3", "--variants", "rfa", "softmax", "--cpu"])
    assert [(c[0], c[1]) for c in calls] == [("rfa", 1), ("rfa", 2), ("softmax", 1), ("softmax", 2), ("rfa", 3),
                                             ("softmax", 3)]
    got = [(r["setting"], r["variant"], r["seed"], r["updates"], r["test"]) for r in records(tmp_path)]
    assert got[:2] == [("small", "rfa", 1, 5, 15.0), ("small", "rfa", 2, 5, 25.0)] and len(got) == 6


def test_an_interrupted_run_resumes_in_its_folder(tmp_path):
    spec, calls = stand_in(tmp_path, fail_once=("rfa",))
    with pytest.raises(RuntimeError, match="interrupted"):
        runner.main(spec, ["--variants", "softmax", "rfa", "--cpu"])
    assert [r["variant"] for r in records(tmp_path)] == ["softmax"]  # nothing recorded for the interrupted run
    runner.main(spec, ["--variants", "softmax", "rfa", "--cpu"])
    (first, *_), again = [c for c in calls if c[0] == "rfa"], calls[-1]
    assert again[0] == "rfa" and again[3] == first[3] == tmp_path / "work" / "small" / "rfa-seed1"
    assert [r["variant"] for r in records(tmp_path)] == ["softmax", "rfa"]


def test_rescore_adds_fields_to_the_chosen_runs_with_folders_and_trains_nothing(tmp_path):
    spec, calls = stand_in(tmp_path)
    runner.main(spec, ["--seeds", "1", "2", "--variants", "rfa", "softmax", "--cpu"])
    (tmp_path / "work" / "small" / "rfa-seed2" / "started").unlink()
    (tmp_path / "work" / "small" / "rfa-seed2").rmdir()  # a run whose checkpoints are gone
    seen = []

    def rescore(variant, s, seed, data, out, a, record):
        seen.append((variant, seed, out.name, record["test"]))
        return {"again": record["test"] + 1}

    spec.rescore = rescore
    trained = len(calls)
    runner.main(spec, ["--rescore", "--seeds", "1", "2", "--variants", "rfa", "--cpu"])
    assert len(calls) == trained and seen == [("rfa", 1, "rfa-seed1", 15.0)]
    got = {(r["variant"], r["seed"]): r for r in records(tmp_path)}
    assert len(got) == 4 and got["rfa", 1]["again"] == 16.0 and got["rfa", 1]["test"] == 15.0
    assert all("again" not in r for k, r in got.items() if k != ("rfa", 1))


def test_a_probe_is_kept_apart_from_the_full_run(tmp_path):
    spec, calls = stand_in(tmp_path)
    runner.main(spec, ["--updates", "2", "--variants", "rfa", "--cpu"])
    runner.main(spec, ["--variants", "rfa", "--cpu"])  # the full run is not the probe: it runs
    runner.main(spec, ["--updates", "5", "--variants", "rfa", "--cpu"])  # the setting's own count: the full run
    assert [(c[2], c[3].name) for c in calls] == [(2, "rfa-seed1-u2"), (5, "rfa-seed1")]
    table = parse(runner.report(spec, records(tmp_path)))
    assert [(row["setting"], row["test"]) for row in table] == [("small", "15.00"), ("small, 2 updates", "12.00")]


@pytest.mark.parametrize("argv, name", [(["--updates", "0"], "--updates"), (["--variants", "rfa", "linformer"], "linformer"),
                                        (["--setting", "huge"], "huge")])
def test_bad_input_is_refused_by_name(tmp_path, capsys, argv, name):
    spec, calls = stand_in(tmp_path)
    with pytest.raises(SystemExit) as stop:
        runner.main(spec, argv)
    assert stop.value.code == 2 and name in capsys.readouterr().err and not calls


def parse(table: str) -> list:
    head, _, *rows = [[c.strip() for c in line.strip("|").split("|")] for line in table.splitlines()]
    return [dict(zip(head, row)) for row in rows]


def row(variant, seed, test, spu=None, threads=1, peak=None, **kw):
    return {"setting": "small", "variant": variant, "seed": seed, "updates": 5, "test": test, "valid": 1.0,
            "s_per_update": spu, "train_threads": threads, "peak_mb": peak, **kw}


def test_report_gives_mean_and_range_over_seeds_and_times_per_machine(tmp_path):
    spec, _ = stand_in(tmp_path)
    rows = [row("rfa", 1, 30.0, 1.5, peak=600), row("softmax", 1, 33.0, 1.0, peak=500), row("rfa", 2, 31.0),
            row("rfa", 3, 32.5, 2.5, peak=800), row("rfa", 4, 31.5, 3.0, threads=2),
            row("rfa", 5, 40.0, 0.1, device="NVIDIA H100", updates=50, setting="big")]
    table = {(r["setting"], r["variant"]): r for r in parse(runner.report(spec, rows))}
    assert list(table) == [("small", "softmax"), ("small", "rfa"), ("big", "rfa")]  # settings', variants' order
    rfa = table["small", "rfa"]
    assert rfa["seeds"] == "1,2,3,4" and rfa["test"] == "31.25 (30.00-32.50)" and rfa["valid"] == "1.0 (1.0-1.0)"
    # times per update: the mean of the runs that have one, per thread count, x softmax's on the same machine
    assert rfa["s/update"] == "2.00 (2.00x, 1 thr); 3.00 (2 thr)" and rfa["peak MB"] == "700 (1.40x, 1 thr)"
    assert table["small", "softmax"]["test"] == "33.00"
    assert table["big", "rfa"]["s/update"] == "0.100 (NVIDIA H100)" and table["big", "rfa"]["peak MB"] == "-"
