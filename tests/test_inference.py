"""The inference form (rfa_fairseq/inference.py): with --int8-inference, int8 linear layers."""
import re
from argparse import Namespace

import pytest
import torch
from torch import nn

from rfa_fairseq import inference
from rfa_fairseq.inference import quantize_linears_
from rfa_fairseq.modules.int8_linear import Int8Linear
from rfa_test_utils import needs_int8_kernel, random_tokens

GENERATE_CFG = Namespace(generation=Namespace(beam=4))  # what prepare_for_inference_ reads of fairseq-generate's


def linears(model):
    return sum(type(m) is nn.Linear for m in model.modules()), sum(type(m) is Int8Linear for m in model.modules())


@needs_int8_kernel
@pytest.mark.parametrize("family", ["lm", "translation"])
def test_prepare_for_inference_quantizes_every_linear_layer_only_when_asked(lm_model, translation_model, family):
    """--int8-inference --int8-min-weights 0: every linear layer of the decoder int8 after prepare_for_inference_
    (the encoder's stay float32; training is not affected), and the model's outputs close to float32's; without
    the flag the model is as it was."""
    make = lm_model if family == "lm" else translation_model
    task, plain = make("--rfa-gate")
    _, model = make("--rfa-gate", "--int8-inference", "--int8-min-weights", "0")
    model.load_state_dict(plain.state_dict())
    n, encoder = linears(plain.decoder)[0], linears(plain)[0] - linears(plain.decoder)[0]
    assert n > 0 and linears(model) == (n + encoder, 0) and (encoder > 0) == (family == "translation")
    plain.prepare_for_inference_(GENERATE_CFG)
    model.prepare_for_inference_(GENERATE_CFG)
    assert linears(plain) == (n + encoder, 0) and linears(model) == (encoder, n) and not model.training
    d = task.target_dictionary
    tokens = random_tokens(d, 2, 30, torch.Generator().manual_seed(3))
    inputs = (tokens,) if family == "lm" else (tokens, torch.full((2,), 30), tokens)
    with torch.no_grad():
        fp32, int8 = plain(*inputs)[0], model(*inputs)[0]
    assert 0 < (int8 - fp32).abs().mean() <= 0.05 * fp32.std()


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


@needs_int8_kernel
@pytest.mark.parametrize("family", ["lm", "translation"])
def test_int8_min_weights_keeps_the_smaller_linear_layers_float32(lm_model, translation_model, family):
    """By default (--int8-min-weights 2**18) only layers of at least that many weights are int8: here the output
    projection, made that large, alone; a threshold above every layer's size quantizes none, and a negative one is
    refused by its flag."""
    make = lm_model if family == "lm" else translation_model
    _, model = make("--rfa-gate", "--int8-inference")
    width = model.decoder.output_projection.in_features
    model.decoder.output_projection = nn.Linear(width, 2 ** 18 // width, bias=False)
    n = linears(model)[0]
    model.prepare_for_inference_(GENERATE_CFG)
    assert model.int8_min_weights == inference.INT8_MIN_WEIGHTS == 2 ** 18
    assert linears(model) == (n - 1, 1) and isinstance(model.decoder.output_projection, Int8Linear)
    _, model = make("--rfa-gate", "--int8-inference", "--int8-min-weights", str(2 ** 30))
    n = linears(model)[0]
    model.prepare_for_inference_(GENERATE_CFG)
    assert linears(model) == (n, 0)
    _, model = make("--rfa-gate", "--int8-inference", "--int8-min-weights", "-1")
    with pytest.raises(ValueError, match="--int8-min-weights must be 0 or a positive integer, got -1"):
        model.prepare_for_inference_(GENERATE_CFG)


def test_quantizing_refuses_a_model_in_training_mode(lm_model):
    _, model = lm_model()
    with pytest.raises(ValueError, match="eval"):
        quantize_linears_(model.train())


def test_quantizing_refuses_a_torch_whose_int_mm_takes_no_uint8(lm_model, monkeypatch):
    """torch 2.11's CPU _int_mm takes int8 rows only: there the int8 layers are refused by name."""
    _, model = lm_model()
    monkeypatch.setattr(inference, "int_mm_takes_uint8", lambda: False)  # as torch 2.11's
    with pytest.raises(RuntimeError, match=re.escape(f"torch {torch.__version__} does not") + ".*--int8-inference"):
        quantize_linears_(model.eval())
