"""bench/decode.py: both modes at tiny sizes record what the report reads, with honest ratios."""
import importlib.util
import json

import pytest

from bench import decode, report
from rfa_test_utils import USER_DIR, multi30k_bin, multi30k_lm_bin, run_cli

TINY = ["--size", "tiny", "--repeats", "1", "--batch", "2", "--beam", "2", "--threads", "1"]


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
    rows = decode.main(["checkpoint", str(data), "--task", "rfa_translation", "--source-lang", "de", "--target-lang", "en",
                        "--threads", "1", "--model", f"softmax={paths['softmax']}", "--model", f"rfa_gate={paths['rfa_gate']}",
                        "--model", f"rfa_gate_fairseq=fairseq:{paths['rfa_gate']}", "--repeats", "2", "--out", str(out), "--", "--beam", "2", "--batch-size", "4",
                        "--max-len-a", "1.2", "--max-len-b", "5", "--required-batch-size-multiple", "1", "--cpu"])
    meta = json.loads(out.read_text())["meta"]
    assert meta["bench"] == "decode-checkpoint" and "--beam" in meta["generate_flags"]
    assert [r["model"] for r in rows] == ["softmax", "rfa_gate", "rfa_gate_fairseq"]
    assert rows[2]["engine"] == "fairseq fairseq" and (rows[1]["bleu"], rows[1]["tokens"]) == (rows[2]["bleu"], rows[2]["tokens"])
    for r in rows:
        assert r["sentences"] == 9 and r["tokens"] > 0 and r["runs"] == 2 and r["peak_bytes"] > 0
        assert r["tokens_per_s"] == pytest.approx(rows[0]["tokens_per_s"] * r["ratio"])
        assert r["memory_ratio"] == pytest.approx(r["peak_bytes"] / rows[0]["peak_bytes"])
        assert 0 <= r["decode_bytes"] <= r["peak_bytes"]  # what decoding adds is part of the peak
        if rows[0]["decode_bytes"]:
            assert r["decode_memory_ratio"] == pytest.approx(r["decode_bytes"] / rows[0]["decode_bytes"])
    # the table recipes/*/speed.sh writes: run, sentences, ..., tokens/s, speed and memory vs the first run
    lines = [line.split(" | ") for line in report.main([str(out)]).splitlines() if line.startswith("| softmax")]
    assert lines[0][1:2] == ["9"] and lines[0][6:7] == ["1.00x"] and "--beam 2" in report.main([str(out)])


@pytest.mark.parametrize("argv", [
    ["--model", f"a=ct2:{__file__}:int9"], ["--model", f"a={__file__}", "--task", "translation"],
    ["--model", f"a=int8:{__file__}.missing"],
    ["--model", f"a={__file__}", "--source-lang", "de", "--target-lang", "en", "--bucket-edges", "8", "4"],
    ["--model", f"a={__file__}", "--task", "lm"]])
def test_bad_checkpoint_flags_stop_with_an_error(argv, capsys):
    with pytest.raises(SystemExit) as e:
        decode.parse_args(["checkpoint", "."] + argv)
    assert e.value.code == 2 and "error:" in capsys.readouterr().err


CT2 = importlib.util.find_spec("ctranslate2") is not None  # optional (setup.py's bench extra): its cases skip without it
GENERATE = ["--beam", "4", "--batch-size", "2", "--max-len-a", "1.2", "--max-len-b", "5", "--required-batch-size-multiple",
            "1", "--cpu"]


@pytest.fixture(scope="module")
def documents(checkpoints, tmp_path_factory):
    """softmax and RFA-Gate in fairseq, the softmax checkpoint in CTranslate2 (float32, int8), by output length."""
    data, paths = checkpoints
    out = tmp_path_factory.mktemp("buckets") / "buckets.json"
    ct2 = ["--model", f"ct2_fp32=ct2:{paths['softmax']}:float32", "--model", f"ct2_int8=ct2:{paths['softmax']}:int8"]
    decode.main(["checkpoint", str(data), "--source-lang", "de", "--target-lang", "en", "--threads", "1", "--bucket-edges",
                 "8", "16", "--model", f"softmax={paths['softmax']}", "--model", f"rfa_gate={paths['rfa_gate']}",
                 "--out", str(out)] + ct2 * CT2 + ["--"] + GENERATE)
    return json.loads(out.read_text()), out


@pytest.mark.slow
def test_buckets_add_up_to_the_totals_with_ratios_per_bucket(documents):
    rows = documents[0]["rows"]
    assert [r["engine"] for r in rows] == ["fairseq", "fairseq"] + ["ctranslate2 float32", "ctranslate2 int8"] * CT2
    first = {b["bucket"]: b for b in rows[0]["buckets"]}
    assert len(first) >= 2 and set(first) <= {"1-8", "9-16", "17+"}
    for r in rows:
        assert r["sentences"] == 9 and sum(b["sentences"] for b in r["buckets"]) == 9
        assert [(b["bucket"], b["sentences"]) for b in r["buckets"]] == [(b, first[b]["sentences"]) for b in first]
        assert sum(b["tokens"] for b in r["buckets"]) == r["tokens"]
        assert sum(b["seconds"] for b in r["buckets"]) == pytest.approx(r["seconds"])
        for b in r["buckets"]:
            assert b["model"] == r["model"] and b["tokens_per_s"] == pytest.approx(b["tokens"] / b["seconds"])
            assert b["peak_bytes"] <= r["peak_bytes"] and b["decode_bytes"] <= r["decode_bytes"]
            if b["bucket"] in first:
                assert b["ratio"] == pytest.approx(b["tokens_per_s"] / first[b["bucket"]]["tokens_per_s"])
                assert b["memory_ratio"] == pytest.approx(b["peak_bytes"] / first[b["bucket"]]["peak_bytes"])
    text = report.main([str(documents[1])])
    assert "By output tokens per sentence" in text and f"| {rows[0]['buckets'][0]['bucket']} |" in text
    assert "rfa_gate tokens/s" in text


@pytest.mark.slow
def test_ctranslate2_float32_translates_as_fairseq_does(documents):
    """The converted softmax model, beam 4 and the same batches: the same hypotheses, so the same BLEU."""
    pytest.importorskip("ctranslate2")
    softmax, _, fp32, int8 = documents[0]["rows"]
    assert fp32["same_as_first"] == 1.0 and fp32["bleu"] == softmax["bleu"] and fp32["tokens"] == softmax["tokens"]
    assert int8["sentences"] == 9 and 0 <= int8["same_as_first"] <= 1 and "bleu" in int8


@pytest.mark.slow
def test_only_softmax_checkpoints_convert(checkpoints, tmp_path):
    pytest.importorskip("ctranslate2")
    with pytest.raises(ValueError, match="rfa_transformer.*not supported"):
        decode.convert_for_ctranslate2(str(checkpoints[1]["rfa_gate"]), str(checkpoints[0]), str(tmp_path / "ct2"), "de", "en",
                                       user_dir=USER_DIR)


@pytest.fixture(scope="module")
def lms(tmp_path_factory):
    """Tiny transformer_lm and rfa_transformer_lm (RFA-Gate) trained on Multi30k's English side, blocks of 32 tokens."""
    d = tmp_path_factory.mktemp("lm")
    multi30k_lm_bin(d, (("train", 200), ("valid", 8), ("test", 12)))
    tiny = ["--task", "language_modeling", "--tokens-per-sample", "32", "--decoder-layers", "2", "--decoder-embed-dim", "32",
            "--decoder-ffn-embed-dim", "64", "--decoder-attention-heads", "4", "--share-decoder-input-output-embed",
            "--optimizer", "adam", "--lr", "5e-3", "--batch-size", "8", "--no-progress-bar", "--cpu", "--num-workers", "0",
            "--seed", "3", "--max-update", "30", "--no-epoch-checkpoints", "--required-batch-size-multiple", "1"]
    paths = {}
    for name, arch in {"softmax": ["--arch", "transformer_lm"],
                       "rfa_gate": ["--user-dir", USER_DIR, "--arch", "rfa_transformer_lm", "--rfa-gate"]}.items():
        run_cli("fairseq-train", d / "bin", *arch, *tiny, "--save-dir", d / name)
        paths[name] = d / name / "checkpoint_last.pt"
    return d / "bin", paths


@pytest.mark.slow
@pytest.mark.parametrize("search", [["--beam", "1"], ["--beam", "1", "--sampling", "--sampling-topk", "5"]])
def test_lm_generation_continues_every_prompt_by_exactly_each_length(lms, search, tmp_path):
    """Lengths past the 32 positions trained; CTranslate2 on the converted softmax LM, its positions widened too."""
    data, paths = lms
    rows = decode.main(["checkpoint", str(data), "--task", "language_modeling", "--lengths", "40", "5", "--prompts", "3",
                        "--prompt-tokens", "6", "--threads", "1", "--model", f"softmax={paths['softmax']}",
                        "--model", f"rfa_gate={paths['rfa_gate']}"]
                       + ["--model", f"rfa_gate_compiled=compiled:{paths['rfa_gate']}", "--model",
                          f"rfa_gate_int8=int8:{paths['rfa_gate']}"]
                       + ["--model", f"ct2=ct2:{paths['softmax']}:float32"] * CT2
                       + ["--", "--tokens-per-sample", "16", "--batch-size", "2", "--cpu"] + search)
    models = ["softmax", "rfa_gate", "rfa_gate_compiled", "rfa_gate_int8"] + ["ct2"] * CT2
    assert [(r["model"], r["length"]) for r in rows] == [(m, n) for m in models for n in (5, 40)]
    by = {(r["model"], r["length"]): r for r in rows}
    for r in rows:
        assert r["generated"] == [r["length"]] and r["tokens"] == 3 * r["length"] and r["sentences"] == 3
        assert r["ratio"] == pytest.approx(r["tokens_per_s"] / by[("softmax", r["length"])]["tokens_per_s"])
        assert r["peak_bytes"] > 0
    assert [by[(m, 5)]["engine"] for m in models[:4]] == ["fairseq"] * 2 + ["fairseq compiled", "fairseq int8"]
    if CT2 and "--sampling" not in search:  # greedy: CTranslate2 continues the prompts as fairseq does
        assert by[("ct2", 5)]["same_as_first"] == by[("ct2", 40)]["same_as_first"] == 1.0


def test_graphed_variant_decodes_the_same_state(tmp_path):
    """``*_graphs`` (--cuda-graphs) is the same model and state; on the CPU its steps run eagerly."""
    rows = decode.main(["synthetic", "--task", "lm", "--lengths", "6", "--models", "rfa_gate", "rfa_gate_graphs"] + TINY)
    assert [r["model"] for r in rows] == ["rfa_gate", "rfa_gate_graphs"]
    assert rows[0]["state_bytes"] == rows[1]["state_bytes"] > 0


def test_a_model_that_fails_leaves_the_other_rows(monkeypatch):
    """One model's error (a failed capture, say) is its rows' error; the others are still measured."""
    generator = decode.Contender.generator

    def failing(self, length):
        run = generator(self, length)
        return run if self.name != "rfa" or length < 12 else lambda: (_ for _ in ()).throw(RuntimeError("no capture"))
    monkeypatch.setattr(decode.Contender, "generator", failing)
    rows = decode.main(["synthetic", "--task", "lm", "--lengths", "3", "12", "40", "--models", "softmax", "rfa"] + TINY)
    by = {(r["model"], r["length"]): r for r in rows}
    assert all(by[("softmax", n)]["tokens_per_s"] > 0 for n in (3, 12, 40)) and by[("rfa", 3)]["tokens_per_s"] > 0
    assert by[("rfa", 12)]["error"] == by[("rfa", 40)]["error"] == "RuntimeError: no capture"
    assert "tokens_per_s" not in by[("rfa", 40)] and decode.harness.exit_status(rows) == 1
    assert decode.harness.exit_status([r for r in rows if r["model"] == "softmax"]) == 0


def test_documents_mode_reads_documents_whose_source_grows_with_the_output():
    """--documents: a source as long as each output; the window's state grows by the source's cache alone, softmax's
    by its own cache of the output too."""
    rows = decode.main(["synthetic", "--lengths", "10", "40", "--documents", "5", "--models", "softmax_sentidx",
                        "gate_sentidx_window1"] + TINY)
    state = {(r["model"], r["length"]): (r["state_bytes"], r["source_state_bytes"]) for r in rows}
    assert all(r["tokens_per_s"] > 0 for r in rows)
    (all_10, source_10), (all_40, source_40) = state[("gate_sentidx_window1", 10)], state[("gate_sentidx_window1", 40)]
    assert all_40 - source_40 == all_10 - source_10 > 0 and source_40 > source_10 > 0  # the rest: the RFA state
    (all_10, source_10), (all_40, source_40) = state[("softmax_sentidx", 10)], state[("softmax_sentidx", 40)]
    assert all_40 - source_40 > all_10 - source_10 > 0  # softmax's own cache grows


def test_a_checkpoint_specs_forms_are_read_in_any_order():
    assert decode.model_spec(f"a=int8:compiled:{__file__}") == ("a", __file__, None, ("int8", "compiled"))
    assert decode.model_spec(f"a=compiled:{__file__}")[3] == ("compiled",) and decode.model_spec(f"a={__file__}")[3] == ()
    assert decode.model_spec(f"a=fairseq:compiled:{__file__}")[3] == ("fairseq", "compiled")
