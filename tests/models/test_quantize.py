"""--int8-inference: the linear layers in int8 at inference (rfa_fairseq/models/quantize.py)."""
from argparse import Namespace

import pytest
import torch
from torch import nn
from torch.ao.nn.quantized.dynamic import Linear as Int8Linear

from rfa_fairseq.models.quantize import quantize_int8
from rfa_test_utils import random_tokens

GENERATE_CFG = Namespace(generation=Namespace(beam=4))  # what prepare_for_inference_ reads of fairseq-generate's


def linears(model):
    return sum(type(m) is nn.Linear for m in model.modules()), sum(type(m) is Int8Linear for m in model.modules())


@pytest.mark.parametrize("family", ["lm", "translation"])
def test_prepare_for_inference_quantizes_every_linear_layer_only_when_asked(lm_model, translation_model, family):
    make = lm_model if family == "lm" else translation_model
    _, plain = make("--rfa-gate")
    _, model = make("--rfa-gate", "--int8-inference")
    n = linears(plain)[0]
    assert n > 0 and linears(model) == (n, 0)  # built as usual: training is not affected
    plain.prepare_for_inference_(GENERATE_CFG)
    model.prepare_for_inference_(GENERATE_CFG)
    assert linears(plain) == (n, 0) and linears(model) == (0, n)
    assert not model.training


def test_int8_logits_follow_float32_and_decode_as_the_full_pass(lm_model):
    """int8 weights (per output row) and inputs (per call) move the logits by a few percent of their
    spread; step by step, each step's input is quantized alone, so incremental decoding agrees with
    the int8 full pass to that precision too, not to 1e-5 as in float32."""
    task, model = lm_model("--rfa-gate")
    model.eval()
    tokens = random_tokens(task.dictionary, 2, 60, torch.Generator().manual_seed(2))
    with torch.no_grad():
        fp32, _ = model(tokens)
        quantize_int8(model)
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
        quantize_int8(model.train())
