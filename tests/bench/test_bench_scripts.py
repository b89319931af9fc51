"""The benchmark scripts run end to end at tiny sizes and record what docs/benchmarks.md reports.

Speed is not asserted here (a timed unit test is noise); what is asserted are the properties
that hold whatever the machine: RFA's incremental state has the same size at every length
while softmax's grows, the rows carry the fields the report and the plot read, the SDPA
baseline computes the same function as fairseq's attention, and the report and figure render.
"""
import json

import pytest
import torch

from bench import chunk_size, decode_speed, encoder_attention, plot, profile_decode, report, side_by_side, state_passes, train_speed
from rfa_test_utils import REPO

TINY_DECODE = ["--tiny", "--vocab", "60", "--repeats", "1", "--batch", "2", "--beam", "2", "--threads", "1"]


@pytest.fixture(scope="module")
def decode_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    results = {}
    for task in ("translation", "lm"):
        path = out / f"decode_{task}.json"
        decode_speed.main(["--task", task, "--lengths", "3", "12", "40", "--out", str(path)] + TINY_DECODE)
        results[task] = path
    return results


@pytest.mark.parametrize("task", ["translation", "lm"])
def test_decode_bench_state_is_constant_for_rfa_and_grows_for_softmax(decode_results, task):
    data = json.loads(decode_results[task].read_text())
    rows = data["rows"]
    assert data["meta"]["args"]["task"] == task
    assert {r["model"] for r in rows} == {"softmax", "rfa", "rfa_gate"}
    state = {(r["model"], r["length"]): r["state_bytes"] for r in rows}
    for model in ("rfa", "rfa_gate"):
        sizes = {state[(model, n)] for n in (3, 12, 40)}
        assert len(sizes) == 1, f"{model}: state bytes change with the length: {sizes}"
    assert state[("softmax", 3)] < state[("softmax", 12)] < state[("softmax", 40)]
    for r in rows:
        assert r["tokens_per_s"] > 0 and r["runs"] == 1
        assert r["speed_ratio_to_softmax"] == pytest.approx(
            r["tokens_per_s"] / next(b["tokens_per_s"] for b in rows
                                     if b["model"] == "softmax" and b["length"] == r["length"]))


def test_decode_bench_skips_runs_predicted_too_long(tmp_path):
    path = tmp_path / "d.json"
    decode_speed.main(["--task", "lm", "--lengths", "4", "400", "--max-seconds", "1e-9", "--models", "rfa",
                       "--out", str(path)] + TINY_DECODE)
    rows = json.loads(path.read_text())["rows"]
    assert "tokens_per_s" in rows[0]
    assert "skipped" in rows[1] and "--max-seconds" in rows[1]["skipped"]


def test_decode_bench_cpu_clock_and_min_statistic(tmp_path, monkeypatch):
    """--clock cpu times runs with the process's CPU time and --statistic min keeps the fastest."""
    calls = []
    real = decode_speed.timed

    def spy(*a, **kw):
        calls.append(kw.get("clock"))
        return real(*a, **kw)

    monkeypatch.setattr(decode_speed, "timed", spy)
    path = tmp_path / "d.json"
    args = ["--task", "lm", "--lengths", "4", "--models", "rfa", "--clock", "cpu", "--statistic", "min",
            "--out", str(path)] + TINY_DECODE
    args[args.index("--repeats") + 1] = "3"
    decode_speed.main(args)
    row = json.loads(path.read_text())["rows"][0]
    assert calls == ["cpu"] * 3
    assert row["runs"] == 3 and row["seconds"] == min(row["all_seconds"])


def test_decode_bench_rejects_bad_arguments():
    with pytest.raises(SystemExit):
        decode_speed.parse_args(["--lengths", "0"])
    with pytest.raises(SystemExit):
        decode_speed.parse_args(["--clock", "cpu", "--device", "cuda"])
    with pytest.raises(ValueError, match="cpu"):
        from bench.common import timed
        timed(lambda: None, "cuda", repeats=1, clock="cpu")


def test_train_bench_sdpa_baseline_is_the_same_function():
    dims = dict(layers=2, embed_dim=32, heads=4, ffn_dim=64, vocab=60)
    assert train_speed.check_sdpa_matches_fairseq(dims, length=17, device="cpu") <= 1e-4


def test_train_bench_recompute_variants():
    assert train_speed.parse_args(["--tiny"]).variants == ["softmax", "sdpa", "rfa", "rfa_gate"]
    for variant, gate, recompute in [("rfa", False, False), ("rfa_gate", True, False),
                                     ("rfa_recompute", False, True), ("rfa_gate_recompute", True, True)]:
        model, _ = train_speed.build(variant, train_speed.TINY, 32)
        attn = [layer.self_attn for layer in model.decoder.layers]
        assert all(a.recompute == recompute and (a.gate_proj is not None) == gate for a in attn), variant


def test_side_by_side_compares_two_trees_and_resumes(tmp_path):
    """Both trees measured, each RFA row relative to its own run's softmax, and a second call with
    the same output file measures nothing again."""
    out = tmp_path / "sbs.json"
    args = ["--baseline", REPO, "--threads", "1", "--plans", "lm", "--rounds", "1", "--tiny", "--out", str(out)]
    rows = side_by_side.main(args)
    assert {(r["tree"], r["model"]) for r in rows} == {(t, m) for t in ("baseline", "new")
                                                        for m in ("softmax", "rfa", "rfa_gate")}
    soft = [r for r in rows if r["model"] == "softmax" and r["length"] == 3]
    assert all(r["vs_softmax"] == 1.0 == r["vs_floor"] for r in soft)
    assert all(r["tokens_per_s"] > 0 and r["vs_softmax"] > 0 for r in rows)
    mtime = out.stat().st_mtime_ns
    assert side_by_side.main(args) == rows and out.stat().st_mtime_ns == mtime
    table = side_by_side.markdown(rows).splitlines()
    assert len(table) == 2 + 4  # header, rule, RFA and RFA-Gate at two lengths
    assert all(line.startswith("| lm | RFA") for line in table[2:])


def test_state_passes_times_the_four_passes(capsys):
    state_passes.main(["--rows", "2", "--heads", "2", "--features", "8", "--head-dim", "4", "--flush-mib", "1",
                       "--repeats", "1"])
    out = capsys.readouterr().out
    assert all(name in out for name in ("gather", "decay", "update", "readout"))


def _dict_dir(tmp_path):
    from bench.common import fake_dictionary

    return fake_dictionary(str(tmp_path), 60)


def test_train_and_chunk_benches_write_rows(tmp_path):
    path = tmp_path / "train.json"
    train_speed.main(["--tiny", "--lengths", "16", "32", "--repeats", "1", "--threads", "1", "--out", str(path)])
    rows = json.loads(path.read_text())["rows"]
    assert {r["variant"] for r in rows} == {"softmax", "sdpa", "rfa", "rfa_gate"}
    assert all(r["seconds"] > 0 and r["tokens"] == r["batch"] * r["length"] for r in rows)
    assert all("ratio_to_softmax" in r and "ratio_to_sdpa" in r for r in rows)

    cpath = tmp_path / "chunk.json"
    chunk_size.main(["--tiny", "--lengths", "32", "--repeats", "1", "--threads", "1", "--out", str(cpath)])
    crows = json.loads(cpath.read_text())["rows"]
    assert {r["mode"] for r in crows} == {"train", "infer"}
    assert all(r["ms"] > 0 for r in crows)


def test_profile_shares_cover_the_whole_step(tmp_path):
    rows = profile_decode.main(["--tiny", "--vocab", "60", "--lengths", "6", "--threads", "1"])
    for r in rows:
        shares = r["share_by_component"]
        assert set(shares) == set(profile_decode.COMPONENTS)
        assert all(s >= 0 for s in shares.values())
        # every component is timed inside the whole generation, so they add up to (at most) 1
        assert sum(shares.values()) == pytest.approx(1.0, abs=0.02)
        assert shares["self-attention"] > 0 and shares["FFN"] > 0 and shares["attention projections"] > 0
        assert r["attention_share"] == pytest.approx(
            shares["self-attention"] + shares["cross-attention"] + shares["state reorder"])


def test_profile_timers_count_nested_calls_once_and_honour_unless(monkeypatch):
    clock = iter(range(100))
    monkeypatch.setattr(profile_decode.time, "perf_counter", lambda: next(clock))
    timers = profile_decode.Timers("cpu")

    class Owner:
        def inner(self):
            return "inner"

        def outer(self):
            return self.inner()

    owner = Owner()
    timers.wrap(owner, "inner", "a")
    timers.wrap(owner, "outer", "a")
    assert owner.outer() == "inner"
    # the clock reads 0 as outer enters, 1 as inner enters (nested: its exit adds nothing and
    # reads no clock), 2 as outer leaves: "a" is 2, not 2 + inner's time
    assert timers.total["a"] == 2
    timers.wrap(owner, "inner", "b", unless=("a",))
    owner.outer()  # inner runs while "a" is timed: "b" gets nothing
    assert timers.total["b"] == 0


def test_report_and_figure_render(decode_results, tmp_path):
    md = tmp_path / "report.md"
    report.main(["--translation", str(decode_results["translation"]), "--lm", str(decode_results["lm"]),
                 "--out", str(md)])
    text = md.read_text()
    assert "### Translation decoding" in text and "### LM decoding" in text
    assert text.count("| 40 |") == 2  # one row per length in each table
    png = tmp_path / "fig.png"
    plot.main(["--translation", str(decode_results["translation"]), "--lm", str(decode_results["lm"]),
               "--out", str(png)])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_peak_memory_probe_sees_an_allocation():
    from bench.common import PeakMemory

    with PeakMemory("cpu") as mem:
        x = torch.ones(64 * 2**20 // 4)  # 64 MiB, touched
        del x
    if mem.peak_bytes is None:
        pytest.skip("this kernel does not allow resetting the peak RSS (/proc/self/clear_refs)")
    assert mem.peak_bytes >= 60 * 2**20


def test_decode_defaults_follow_the_task():
    tr = decode_speed.parse_args([])
    assert (tr.batch, tr.beam, max(tr.lengths)) == (2, 4, 4096)
    lm = decode_speed.parse_args(["--task", "lm"])
    assert (lm.batch, lm.beam, max(lm.lengths)) == (1, 1, 8192)
    explicit = decode_speed.parse_args(["--task", "lm", "--beam", "4", "--batch", "3", "--lengths", "64"])
    assert (explicit.batch, explicit.beam, explicit.lengths) == (3, 4, [64])


def test_encoder_attention_bench_writes_rows_and_skips_what_would_not_fit(tmp_path):
    """Every variant at every length, ratios to softmax from the same run, the translation section
    with its fixed output length, and softmax skipped (with the reason) where its attention
    matrices would exceed the memory budget."""
    path = tmp_path / "encoder.json"
    encoder_attention.main(["--tiny", "--repeats", "1", "--threads", "1", "--out", str(path)])
    data = json.loads(path.read_text())
    assert data["meta"]["sdpa_vs_softmax_max_abs_diff"] < 1e-5
    layer = [r for r in data["rows"] if r["section"] == "layer"]
    assert {(r["variant"], r["length"]) for r in layer} == {(v, n) for v in encoder_attention.VARIANTS for n in (64, 128)}
    assert all(r["seconds"] > 0 and r["time_vs_softmax"] > 0 for r in layer)
    assert all(r["time_vs_softmax"] == 1.0 for r in layer if r["variant"] == "softmax")
    translation = [r for r in data["rows"] if r["section"] == "translation"]
    assert [r["variant"] for r in translation] == ["softmax", "rfa", "favor", "lara"]
    assert all(r["output_tokens"] == 4 + 1 and 0 < r["encoder_seconds"] < r["seconds"] for r in translation)

    rows = encoder_attention.main(["--tiny", "--repeats", "1", "--variants", "softmax", "rfa", "--lengths", "64",
                                   "--documents", "--max-memory-gb", "1e-4"])
    skipped = {r["variant"]: r.get("skipped", "") for r in rows if r["section"] == "layer"}
    assert "would need" in skipped["softmax"] and skipped["rfa"] == ""
