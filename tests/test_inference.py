"""The decoding form (rfa_fairseq/inference.py): fused causal projections, the precomputed
gaussian feature map and, with --int8-inference, int8 linear layers."""
import re
from argparse import Namespace

import pytest
import torch
from torch import nn

from rfa_fairseq.modules import CausalRFAttention
from rfa_fairseq.modules import int8_linear
from rfa_fairseq.inference import quantize_linears_
from rfa_fairseq.modules.int8_linear import Int8Linear
from rfa_test_utils import needs_int8_kernel, random_tokens

GENERATE_CFG = Namespace(generation=Namespace(beam=4))  # what prepare_for_inference_ reads of fairseq-generate's


def linears(model):
    return sum(type(m) is nn.Linear for m in model.modules()), sum(type(m) is Int8Linear for m in model.modules())


@needs_int8_kernel
@pytest.mark.parametrize("family", ["lm", "translation"])
def test_prepare_for_inference_quantizes_every_linear_layer_only_when_asked(lm_model, translation_model, family):
    make = lm_model if family == "lm" else translation_model
    _, plain = make("--rfa-gate")
    _, model = make("--rfa-gate", "--int8-inference")
    n = linears(plain)[0]
    assert n > 0 and linears(model) == (n, 0)  # built as usual: training is not affected
    plain.prepare_for_inference_(GENERATE_CFG)
    model.prepare_for_inference_(GENERATE_CFG)
    fused = sum(isinstance(m, CausalRFAttention) for m in model.modules())  # each: in_proj for 4 layers
    assert fused > 0 and linears(plain) == (n - 3 * fused, 0) and linears(model) == (0, n - 3 * fused)
    assert not model.training


@needs_int8_kernel
@pytest.mark.parametrize("window", [[], ["--rfa-local-window", "6"]], ids=["", "window"])
@pytest.mark.parametrize("family", ["lm", "translation"])
def test_prepare_for_inference_fuses_the_causal_projections_and_keeps_the_outputs(lm_model, translation_model, family,
                                                                                   window):
    """Every causal RFA module computes q, k, v and the gate with one layer after
    prepare_for_inference_ (tests/modules: the module's agreement), in float32 and in int8; the
    model's outputs stay those of the separate layers."""
    make = lm_model if family == "lm" else translation_model
    task, ref = make("--rfa-gate", *window)
    _, model = make("--rfa-gate", *window)
    model.load_state_dict(ref.state_dict())
    ref.eval()
    model.prepare_for_inference_(GENERATE_CFG)
    attn = [m for m in model.modules() if isinstance(m, CausalRFAttention)]
    assert attn and all(m.in_proj is not None and m.q_proj is None and m.step_projection is not None for m in attn)
    d = task.target_dictionary
    tokens = random_tokens(d, 2, 30, torch.Generator().manual_seed(3))
    inputs = (tokens,) if family == "lm" else (tokens, torch.full((2,), 30), tokens)
    with torch.no_grad():
        torch.testing.assert_close(model(*inputs)[0], ref(*inputs)[0], rtol=1e-5, atol=1e-5)
        quantize_linears_(ref)
        quantize_linears_(model)
        torch.testing.assert_close(model(*inputs)[0], ref(*inputs)[0], rtol=1e-5, atol=1e-5)
    attn[0].train()  # a converted module does not train: checkpoints are always the training form
    with pytest.raises(RuntimeError, match="converted for inference"):
        attn[0](torch.randn(3, 2, attn[0].embed_dim))


@needs_int8_kernel
def test_int8_logits_follow_float32_and_decode_as_the_full_pass(lm_model):
    """int8 weights (per output row) and inputs (per call) move the logits by a few percent of their
    spread; step by step, each step's input is quantized alone, so incremental decoding agrees with
    the int8 full pass to that precision too, not to 1e-5 as in float32."""
    task, model = lm_model("--rfa-gate")
    model.eval()
    tokens = random_tokens(task.dictionary, 2, 60, torch.Generator().manual_seed(2))
    with torch.no_grad():
        fp32, _ = model(tokens)
        quantize_linears_(model)
        int8, _ = model(tokens)
        state, steps = {}, []
        for t in range(tokens.size(1)):
            steps.append(model.decoder(tokens[:, : t + 1], incremental_state=state)[0][:, -1])
        incr = torch.stack(steps, dim=1)
    spread = fp32.std().item()
    for error in (int8 - fp32, incr - int8):
        assert 0 < error.abs().mean().item() <= 0.05 * spread and error.abs().max().item() <= 0.25 * spread
    assert (fp32.argmax(-1) == int8.argmax(-1)).float().mean() >= 0.9


def test_quantizing_refuses_a_model_in_training_mode(lm_model):
    _, model = lm_model()
    with pytest.raises(ValueError, match="eval"):
        quantize_linears_(model.train())


def test_quantizing_refuses_a_torch_whose_int_mm_takes_no_uint8(lm_model, monkeypatch):
    """torch 2.11's CPU _int_mm takes int8 rows only: there the int8 layers are refused by name."""
    _, model = lm_model()
    monkeypatch.setattr(int8_linear, "int_mm_takes_uint8", lambda: False)  # as torch 2.11's
    with pytest.raises(RuntimeError, match=re.escape(f"torch {torch.__version__} does not") + ".*--int8-inference"):
        quantize_linears_(model.eval())
