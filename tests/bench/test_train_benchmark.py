"""bench/train.py: every mode at tiny sizes, the SDPA baseline computes fairseq's softmax attention, and
--fla-unguard lifts fla's Hopper guard only after its gradient check."""
import json

import pytest
import torch

from bench import train
from rfa_test_utils import multi30k_bin

COMMON = ["--tiny", "--repeats", "1", "--threads", "1"]


def test_sdpa_baseline_equals_fairseq_softmax_in_the_lm():
    args = train.parse_args(["lm"] + COMMON)
    ref, task, _ = train.build_lm(args, "softmax", 32)
    alt, _, _ = train.build_lm(args, "sdpa", 32)
    alt.load_state_dict(ref.state_dict())
    tokens = torch.randint(task.source_dictionary.nspecial, len(task.source_dictionary), (2, 17)).to(args.device)
    with torch.no_grad():
        a, b = ref.decoder.extract_features(tokens, None)[0], alt.decoder.extract_features(tokens, None)[0]
    assert (a - b).abs().max().item() < 1e-5


def test_sdpa_baseline_equals_fairseq_softmax_in_the_encoder():
    args = train.parse_args(["encoder"] + COMMON)
    softmax = train.encoder_module(args, "softmax")
    x = torch.randn(13, 2, args.embed_dim).to(args.device)
    assert (softmax(x, x, x)[0] - train.SDPAAttention(softmax, causal=False)(x)[0]).abs().max().item() < 1e-5


def test_lm_rows_and_ratios():
    rows = train.main(["lm", "--lengths", "16", "32", "--variants", "softmax", "sdpa", "rfa", "rfa_gate_recompute"] + COMMON)
    assert {r["model"] for r in rows} == {"softmax", "sdpa", "rfa", "rfa_gate_recompute"}
    by = {(r["model"], r["length"]): r for r in rows}
    for r in rows:
        assert r["tokens"] == r["batch"] * r["length"] and r["peak_bytes"] >= 0
        assert r["tokens_per_s"] == pytest.approx(r["tokens"] / r["seconds"])
        assert r["ratio"] == pytest.approx(r["tokens_per_s"] / by[("softmax", r["length"])]["tokens_per_s"])
        assert r["ratio_sdpa"] == pytest.approx(r["tokens_per_s"] / by[("sdpa", r["length"])]["tokens_per_s"])


def test_a_variant_that_fails_leaves_the_other_rows(monkeypatch):
    lm_step = train.lm_step

    def failing(args, variant, length):
        if variant == "rfa" and length == 32:
            raise RuntimeError("Triton compile error\nmore lines")
        return lm_step(args, variant, length)
    monkeypatch.setattr(train, "lm_step", failing)
    rows = train.main(["lm", "--lengths", "16", "32", "64", "--variants", "softmax", "rfa"] + COMMON)
    by = {(r["model"], r["length"]): r for r in rows}
    assert all(by[("softmax", n)]["seconds"] > 0 for n in (16, 32, 64)) and by[("rfa", 16)]["seconds"] > 0
    assert by[("rfa", 32)]["error"] == "RuntimeError: Triton compile error"
    assert by[("rfa", 64)]["skipped"] == "failed at length 32" and train.harness.exit_status(rows) == 1


def test_dtype_casts_the_model_and_backend_variants_name_their_kernels():
    args = train.parse_args(["lm", "--dtype", "bf16"] + COMMON)
    model = train.build_lm(args, "rfa_gate_torch", 32)[0]
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert {layer.self_attn.backend for layer in model.decoder.layers} == {"torch"}
    assert {layer.self_attn.backend for layer in train.build_lm(args, "rfa_gate_fla", 32)[0].decoder.layers} == {"fla"}
    rows = train.main(["lm", "--lengths", "16", "--variants", "sdpa", "rfa_gate_torch", "--dtype", "bf16"] + COMMON)
    assert all(r["seconds"] > 0 for r in rows)


def test_recompute_variants_train_with_recompute():
    args = train.parse_args(["lm"] + COMMON)
    for variant, gate, recompute in [("rfa_gate", True, False), ("rfa_recompute", False, True)]:
        model = train.build_lm(args, variant, 32)[0]
        attn = [layer.self_attn for layer in model.decoder.layers]
        assert all(a.recompute == recompute and a.gated == gate for a in attn), variant


def test_encoder_rows_and_softmax_skipped_where_it_would_not_fit():
    rows = train.main(["encoder"] + COMMON)
    assert {(r["model"], r["length"]) for r in rows} == {(v, n) for v in train.ENCODER for n in (64, 128)}
    assert all(r["seconds"] > 0 and r["ratio"] > 0 for r in rows)
    rows = train.main(["encoder", "--variants", "softmax", "rfa", "--lengths", "64", "--max-memory-gb", "1e-6"] + COMMON)
    assert "would need" in rows[0]["skipped"] and rows[1]["seconds"] > 0


@pytest.mark.slow
def test_translation_mode_on_real_batches(tmp_path):
    data = multi30k_bin(tmp_path, (("train", 60), ("valid", 8), ("test", 8)))
    rows = train.main(["translation", str(data), "--max-tokens", "300", "--batches", "2"] + COMMON)
    assert [r["model"] for r in rows] == ["softmax", "rfa", "rfa_gate"]
    assert all(r["seconds"] > 0 and r["tokens"] > 0 and r["ratio"] == pytest.approx(rows[0]["seconds"] / r["seconds"])
               for r in rows)


@pytest.mark.parametrize("argv", [["lm", "--tokens-per-batch", "0"], ["lm", "--embed-dim", "30", "--heads", "4"],
                                  ["encoder", "--lengths", "0"], ["translation", "x", "--batches", "0"], ["lm", "--variants", "x"]])
def test_bad_flags_stop_with_an_error(argv, capsys):
    with pytest.raises(SystemExit) as e:
        train.parse_args(argv)
    assert e.value.code == 2 and "error:" in capsys.readouterr().err


@pytest.fixture
def fla_guard(monkeypatch):
    """fla-core's module of the gated backward, made to see a stack it refuses (Hopper, Triton 3.6)."""
    from rfa_test_utils import fla_on_this_machine

    fla_on_this_machine()
    import fla.ops.common.chunk_o as chunk_o

    for name, value in (("IS_NVIDIA_HOPPER", True), ("TRITON_ABOVE_3_4_0", True), ("TRITON_ABOVE_3_7_1", False)):
        monkeypatch.setattr(chunk_o, name, value)
    return chunk_o


FLA_LM = ["lm", "--lengths", "16", "--tokens-per-batch", "32", "--variants", "sdpa", "rfa_gate_fla"] + COMMON


@pytest.mark.slow  # fla's kernels in Triton's interpreter (about 20 s)
def test_fla_unguard_checks_gradients_then_lifts_the_guard_that_stops_fla(fla_guard, tmp_path):
    from rfa_fairseq.ops.causal_rfa.fla import fla_causal_rfa

    x = [torch.rand(1, 1, 16, 4, requires_grad=True) for _ in range(3)] + [torch.full((1, 1, 16), -0.1, requires_grad=True)]
    with pytest.raises(RuntimeError, match="#640"):  # the guard this flag lifts is the one that stops fla
        fla_causal_rfa(*x)[0].sum().backward()
    with pytest.raises(SystemExit, match="--fla-unguard"):  # without the flag: a clear error, before any row
        train.main(FLA_LM)
    rows = train.main(FLA_LM + ["--fla-unguard", "--out", str(tmp_path / "t.json")])
    assert fla_guard.TRITON_ABOVE_3_7_1 and {r["model"] for r in rows} == {"sdpa", "rfa_gate_fla"}
    assert all(r["seconds"] > 0 for r in rows)
    meta = json.loads((tmp_path / "t.json").read_text())["meta"]["fla_guard"]
    errors = meta["gradient_errors"]["16"]
    assert meta["guard"] == "lifted" and set(errors) == {"q", "k", "v", "log_g"}
    assert 0 < max(errors.values()) < 1e-5  # fp32 here (the interpreter has no bf16): two computations, one result


def test_fla_unguard_keeps_the_guard_where_gradients_differ(fla_guard, monkeypatch, tmp_path):
    monkeypatch.setattr(train, "fla_gradient_errors", lambda args, length: {"q": 0.0, "k": 0.0, "v": 0.0, "log_g": 0.5})
    rows = train.main(FLA_LM + ["--fla-unguard", "--out", str(tmp_path / "t.json")])
    assert not fla_guard.TRITON_ABOVE_3_7_1 and {r["model"] for r in rows} == {"sdpa"}
    meta = json.loads((tmp_path / "t.json").read_text())["meta"]
    assert meta["fla_guard"] == {"guard": "kept", "gradient_errors": {"16": {"q": 0.0, "k": 0.0, "v": 0.0, "log_g": 0.5}}}
