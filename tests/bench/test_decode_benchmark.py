"""bench/decode.py: both modes at tiny sizes record what the report reads, with honest ratios."""
import json

import pytest

from bench import decode, report
from rfa_test_utils import USER_DIR, multi30k_bin, run_cli

TINY = ["--tiny", "--vocab", "60", "--repeats", "1", "--batch", "2", "--beam", "2", "--threads", "1"]


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    out = tmp_path_factory.mktemp("decode")
    results = {}
    for task in ("translation", "lm"):
        decode.main(["synthetic", "--task", task, "--lengths", "3", "12", "40", "--out", str(out / task)] + TINY)
        results[task] = json.loads((out / task).read_text())
    return results


@pytest.mark.parametrize("task", ["translation", "lm"])
def test_rfa_state_is_constant_and_softmax_cache_grows(synthetic, task):
    rows = synthetic[task]["rows"]
    assert synthetic[task]["meta"]["bench"] == "decode-synthetic" and {r["model"] for r in rows} == {"softmax", "rfa", "rfa_gate"}
    state = {(r["model"], r["length"]): r["state_bytes"] for r in rows}
    for model in ("rfa", "rfa_gate"):
        assert len({state[(model, n)] for n in (3, 12, 40)}) == 1, model
    assert state[("softmax", 3)] < state[("softmax", 12)] < state[("softmax", 40)]


@pytest.mark.parametrize("task", ["translation", "lm"])
def test_speed_ratio_and_memory_fields(synthetic, task):
    rows = synthetic[task]["rows"]
    softmax = {r["length"]: r["tokens_per_s"] for r in rows if r["model"] == "softmax"}
    for r in rows:
        assert r["tokens_per_s"] == pytest.approx(r["batch"] * r["length"] / r["seconds"]) and len(r["times"]) == 1
        assert r["ratio"] == pytest.approx(r["tokens_per_s"] / softmax[r["length"]])
        assert r["peak_bytes"] is None or r["peak_bytes"] >= 0


def test_profile_puts_every_operator_in_one_range(tmp_path):
    rows = decode.main(["synthetic", "--lengths", "5", "--models", "softmax", "rfa_gate", "--profile"] + TINY)
    for r in rows:
        p = r["profile"]
        assert p["steps"] == 5 + 1  # forced length, then end of sentence
        assert sum(p["ms_per_step_by_range"].values()) == pytest.approx(p["ms_per_step"])
        for where in ("self_attn", "encoder_attn", "ffn", "output", "encoder"):
            assert p["calls_per_step_by_range"][where] > 0, where
    rfa_ops = [op for op, *_ in rows[1]["profile"]["top_ops"]["self_attn"]]
    assert "aten::sin" not in [op for op, *_ in rows[0]["profile"]["top_ops"]["self_attn"]]
    assert rfa_ops  # RFA-Gate's self-attention ran operators of its own


def test_runs_predicted_too_long_are_skipped():
    rows = decode.main(["synthetic", "--task", "lm", "--lengths", "4", "400", "--max-seconds", "1e-9",
                        "--models", "rfa"] + TINY)
    assert "tokens_per_s" in rows[0] and "--max-seconds" in rows[1]["skipped"]


@pytest.mark.parametrize("argv", [
    ["synthetic", "--lengths", "0"], ["synthetic", "--models", "softmax", "nope"], ["synthetic", "--task", "lm",
    "--models", "rfa_enc_lara"], ["synthetic", "--repeats", "-1"], ["synthetic", "--", "--beam", "4"],
    ["synthetic", "--device", "cuda", "--clock", "cpu"], ["checkpoint", "/nonexistent", "--model", "a=b.pt",
    "--source-lang", "de", "--target-lang", "en"], ["checkpoint", ".", "--model", "nothing.pt", "--source-lang", "de",
    "--target-lang", "en"], ["nomode"]])
def test_bad_flags_stop_with_an_error(argv, capsys):
    with pytest.raises(SystemExit) as e:
        decode.parse_args(argv)
    assert e.value.code == 2 and "error:" in capsys.readouterr().err


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    d = tmp_path_factory.mktemp("ckpt")
    data = multi30k_bin(d, (("train", 60), ("valid", 8), ("test", 9)))
    tiny = ["--encoder-layers", "1", "--decoder-layers", "2", "--encoder-embed-dim", "32", "--decoder-embed-dim", "32",
            "--encoder-ffn-embed-dim", "64", "--decoder-ffn-embed-dim", "64", "--encoder-attention-heads", "4",
            "--decoder-attention-heads", "4", "--share-all-embeddings", "--optimizer", "adam", "--lr", "1e-3",
            "--max-tokens", "1500", "--no-progress-bar", "--cpu", "--num-workers", "0", "--seed", "3",
            "--max-update", "1", "--no-epoch-checkpoints"]
    paths = {}
    for name, arch in {"softmax": ["--arch", "transformer_iwslt_de_en"],
                       "rfa_gate": ["--user-dir", USER_DIR, "--arch", "rfa_transformer_iwslt_de_en", "--rfa-gate"]}.items():
        run_cli("fairseq-train", data, *arch, *tiny, "--save-dir", d / name)
        paths[name] = d / name / "checkpoint_last.pt"
    return data, paths


@pytest.mark.slow
def test_checkpoint_mode_decodes_the_split_in_fresh_processes(checkpoints, tmp_path):
    data, paths = checkpoints
    out = tmp_path / "real.json"
    rows = decode.main(["checkpoint", str(data), "--source-lang", "de", "--target-lang", "en", "--threads", "1",
                        "--model", f"softmax={paths['softmax']}", "--model", f"rfa_gate={paths['rfa_gate']}",
                        "--repeats", "2", "--profile", "--out", str(out), "--", "--beam", "2", "--batch-size", "4",
                        "--max-len-a", "1.2", "--max-len-b", "5", "--required-batch-size-multiple", "1", "--cpu"])
    meta = json.loads(out.read_text())["meta"]
    assert meta["bench"] == "decode-checkpoint" and "--beam" in meta["generate_flags"]
    assert [r["model"] for r in rows] == ["softmax", "rfa_gate"]
    for r in rows:
        assert r["sentences"] == 9 and r["tokens"] > 0 and r["runs"] == 2 and r["peak_bytes"] > 0
        assert r["tokens_per_s"] == pytest.approx(rows[0]["tokens_per_s"] * r["ratio"])
        assert r["memory_ratio"] == pytest.approx(r["peak_bytes"] / rows[0]["peak_bytes"])
        assert sum(r["profile"]["ms_per_step_by_range"].values()) == pytest.approx(r["profile"]["ms_per_step"])
    # the table recipes/*/speed.sh writes: run, sentences, ..., tokens/s, speed and memory vs the first run
    lines = [line.split(" | ") for line in report.main([str(out)]).splitlines() if line.startswith("| softmax")]
    assert lines[0][1:2] == ["9"] and lines[0][6:7] == ["1.00x"] and "--beam 2" in report.main([str(out)])
