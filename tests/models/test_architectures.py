"""Architectures match fairseq's namesakes; flags are validated at start with the flag's name."""
import argparse

import pytest
import torch
from fairseq.models import ARCH_CONFIG_REGISTRY

import rfa_fairseq  # noqa: F401  (registers the architectures)
from rfa_fairseq.config import rfa_config_from

DIMS = ["encoder_embed_dim", "encoder_ffn_embed_dim", "encoder_layers", "encoder_attention_heads",
        "decoder_embed_dim", "decoder_ffn_embed_dim", "decoder_layers", "decoder_attention_heads",
        "dropout", "attention_dropout", "share_decoder_input_output_embed"]
LM_DIMS = ["decoder_embed_dim", "decoder_ffn_embed_dim", "decoder_layers", "decoder_attention_heads", "dropout",
           "adaptive_input", "adaptive_input_cutoff", "adaptive_softmax_cutoff", "tie_adaptive_weights"]


@pytest.mark.parametrize("ours, theirs, dims", [
    ("rfa_transformer", "transformer", DIMS),
    ("rfa_transformer_iwslt_de_en", "transformer_iwslt_de_en", DIMS),
    ("rfa_transformer_wmt_en_de", "transformer_wmt_en_de", DIMS),
    ("rfa_transformer_vaswani_wmt_en_de_big", "transformer_vaswani_wmt_en_de_big", DIMS),
    ("rfa_transformer_vaswani_wmt_en_fr_big", "transformer_vaswani_wmt_en_fr_big", DIMS),
    ("rfa_transformer_lm_wiki103", "transformer_lm_wiki103", LM_DIMS),
])
def test_same_dimensions_as_fairseq(ours, theirs, dims):
    a, b = argparse.Namespace(), argparse.Namespace()
    ARCH_CONFIG_REGISTRY[ours](a)
    ARCH_CONFIG_REGISTRY[theirs](b)
    assert {d: getattr(a, d) for d in dims} == {d: getattr(b, d) for d in dims}
    assert a.rfa_causal_feature_dim == 64 and a.rfa_cross_feature_dim == 128 and a.rfa_kernel == "gaussian"
    assert a.rfa_gate is False


def test_small_wiki103_setting():
    a = argparse.Namespace()
    ARCH_CONFIG_REGISTRY["rfa_transformer_lm_wiki103_small"](a)
    assert (a.decoder_layers, a.decoder_embed_dim, a.decoder_ffn_embed_dim, a.decoder_attention_heads) == (6, 512, 2048, 8)
    assert a.adaptive_input and a.tie_adaptive_weights and a.adaptive_input_cutoff == "20000,60000"


def test_translation_model_structure(translation_model):
    task, model = translation_model("--rfa-gate", "--rfa-kernel", "arccos")
    layer = model.decoder.layers[0]
    assert type(layer.self_attn).__name__ == "CausalRFAttention" and layer.self_attn.gated
    assert type(layer.encoder_attn).__name__ == "CrossRFAttention"
    assert layer.self_attn.feature_map.output_dim == 64  # arccos: D values
    assert layer.encoder_attn.feature_map.output_dim == 96
    assert type(model.encoder.layers[0].self_attn).__name__ == "MultiheadAttention"  # encoder stays softmax


@pytest.mark.parametrize("bad, flag", [
    (["--rfa-causal-feature-dim", "0"], "--rfa-causal-feature-dim"),
    (["--rfa-cross-feature-dim", "-3"], "--rfa-cross-feature-dim"),
    (["--rfa-chunk-size", "0"], "--rfa-chunk-size"),
    (["--rfa-eps", "0"], "--rfa-eps"),
    (["--rfa-init-sigma", "-1"], "--rfa-init-sigma"),
    (["--rfa-gate", "--rfa-gate-bias", "nan"], "--rfa-gate-bias"),
    (["--rfa-gate-form", "decay"], "need --rfa-gate"),
    (["--rfa-gate-bias", "3"], "need --rfa-gate"),
    (["--decoder-attention-heads", "5"], "--decoder-attention-heads"),
])
def test_invalid_flag_values_name_the_flag(lm_model, translation_model, bad, flag):
    for make in (lm_model, translation_model):
        with pytest.raises(ValueError, match=flag):
            make(*bad)


@pytest.mark.parametrize("retired", [dict(rfa_softmax_layers="1"), dict(rfa_local_window=64),
                                     dict(rfa_cross_abs_denominator=True), dict(rfa_cross_norm_rescale=True)])
def test_a_checkpoint_of_a_retired_option_is_refused_by_name(retired):
    name = "--" + next(iter(retired)).replace("_", "-")
    with pytest.raises(ValueError, match=f"{name} .* is no longer supported"):
        rfa_config_from(argparse.Namespace(**retired))
    rfa_config_from(argparse.Namespace(**{k: type(v)() for k, v in retired.items()}))  # off: a checkpoint loads


@pytest.mark.parametrize("flag, value", [("--rfa-kernel", "laplace"), ("--rfa-gate-form", "additive")])
def test_unknown_choices_rejected_by_parser(lm_model, translation_model, capsys, flag, value):
    for make in (lm_model, translation_model):
        with pytest.raises(SystemExit):
            make(flag, value)
        assert flag in capsys.readouterr().err


def test_gate_bias_without_the_gate_is_refused_even_at_the_papers_value(translation_model, lm_model):
    """Without --rfa-gate there is no gate to start: any --rfa-gate-bias but the default is refused."""
    for make in (translation_model, lm_model):
        with pytest.raises(ValueError, match="need --rfa-gate"):
            make("--rfa-gate-bias", "0")


def test_gate_flags_reach_the_modules(translation_model, lm_model):
    """--rfa-gate-bias sets the gate's starting value, --rfa-gate-form its form."""
    import math

    _, model = translation_model("--rfa-gate", "--rfa-gate-form", "decay", "--rfa-gate-bias", "3")
    for layer in model.decoder.layers:
        assert not layer.self_attn.convex
        H = layer.self_attn.num_heads
        assert torch.equal(layer.self_attn.in_proj.bias[-H:], torch.full((H,), 3.0))
        g0 = torch.sigmoid(layer.self_attn.in_proj(torch.zeros(1, layer.self_attn.embed_dim))[:, -H:])
        torch.testing.assert_close(g0, torch.full_like(g0, 1 / (1 + math.exp(-3))))
    # the defaults: the convex form, the gate starting near sigmoid(2); the paper's bias 0 by flag
    for extra, bias in ((), 2.0), (("--rfa-gate-bias", "0"), 0.0):
        _, lm = lm_model("--rfa-gate", *extra)
        for layer in lm.decoder.layers:
            H = layer.self_attn.num_heads
            assert layer.self_attn.convex and torch.equal(layer.self_attn.in_proj.bias[-H:], torch.full((H,), bias))
    # --rfa-gate-bias-last: the heads' biases evenly spaced from --rfa-gate-bias (the first head's) to it
    _, lm = lm_model("--rfa-gate", "--rfa-gate-bias-last", "8", "--decoder-attention-heads", "4")
    for layer in lm.decoder.layers:
        assert torch.equal(layer.self_attn.in_proj.bias[-4:], torch.tensor([2.0, 4.0, 6.0, 8.0]))
    for make in (translation_model, lm_model):
        with pytest.raises(ValueError, match="need --rfa-gate"):
            make("--rfa-gate-bias-last", "8")


def _attention_modules(model):
    return [m for layer in model.decoder.layers for m in (layer.self_attn, layer.encoder_attn) if m is not None]


def _training_grads(task, model):
    """Gradients of a translation loss on a fixed padded batch, in training mode."""
    from rfa_test_utils import random_tokens

    gen = torch.Generator().manual_seed(0)
    d = task.source_dictionary
    src, prev = random_tokens(d, 3, 7, gen), random_tokens(task.target_dictionary, 3, 6, gen)
    src[2, :3] = d.pad()  # left-padded source
    model.train()
    for p in model.parameters():
        p.grad = None
    out, _ = model(src, torch.tensor([7, 7, 4]), prev)
    out.float().square().mean().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("extra", [[], ["--rfa-gate"], ["--checkpoint-activations"]],
                         ids=["rfa", "gate", "checkpoint-activations"])
def test_recompute_flag_gives_the_same_training_gradients(translation_model, extra):
    task, model = translation_model("--rfa-recompute", *extra)
    assert all(m.recompute for m in _attention_modules(model))
    _, stored = translation_model(*extra)
    assert not any(m.recompute for m in _attention_modules(stored))
    stored.load_state_dict(model.state_dict())
    a, b = _training_grads(task, model), _training_grads(task, stored)
    assert a.keys() == b.keys() and any("self_attn.feature_map.sigma" in n for n in a)
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-5, atol=1e-6, msg=name)


def test_language_model_recompute_flag(lm_model):
    _, model = lm_model()
    assert not any(layer.self_attn.recompute for layer in model.decoder.layers)
    _, model = lm_model("--rfa-recompute")
    assert all(layer.self_attn.recompute for layer in model.decoder.layers)

