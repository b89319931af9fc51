"""The inference form (rfa_fairseq/inference.py): the flags fairseq's command lines pass make the step engine they
name, with int8 only in the compiled step's packed copies (the model's layers stay float32); bad values and combinations are
refused by name."""
from argparse import Namespace

import pytest
import torch
from torch import nn

from rfa_fairseq import inference
from rfa_fairseq.engines.compiled import CompiledStep
from rfa_fairseq.engines.step_graphs import StepGraphs

GENERATE_CFG = Namespace(generation=Namespace(beam=4))  # what prepare_for_inference_ reads of fairseq-generate's


@pytest.mark.parametrize("family", ["lm", "translation"])
def test_the_flags_make_the_step_engine_they_name(lm_model, translation_model, family):
    make = lm_model if family == "lm" else translation_model
    for flags, engine, int8 in (((), None, None), (("--compiled-step",), CompiledStep, False),
                                (("--int8-inference", "--int8-min-weights", "7"), CompiledStep, True),
                                (("--cuda-graphs",), StepGraphs, None)):
        _, model = make("--rfa-gate", *flags)
        layers = [type(m) for m in model.modules() if isinstance(m, nn.Linear)]
        model.prepare_for_inference_(GENERATE_CFG)
        assert not model.training and [type(m) for m in model.modules() if isinstance(m, nn.Linear)] == layers
        assert type(model.decoder.step_engine) is engine if engine else model.decoder.step_engine is None
        if int8 is not None:
            assert model.decoder.step_engine.int8 == int8
    _, model = make("--rfa-gate", "--int8-inference")
    model.prepare_for_inference_(GENERATE_CFG)
    assert model.decoder.step_engine.int8_min_weights == inference.INT8_MIN_WEIGHTS == 0


def test_bad_values_and_combinations_are_refused(lm_model, translation_model):
    _, model = lm_model("--rfa-gate", "--int8-inference", "--int8-min-weights", "-1")
    with pytest.raises(ValueError, match="--int8-min-weights must be 0 or a positive integer, got -1"):
        model.prepare_for_inference_(GENERATE_CFG)
    _, model = lm_model("--rfa-gate", "--int8-inference", "--cuda-graphs")
    with pytest.raises(ValueError, match="choose one"):
        model.prepare_for_inference_(GENERATE_CFG)
    _, softmax = translation_model("--decoder-attention", "softmax", "--int8-inference", rfa_flags=False)
    with pytest.raises(ValueError, match="needs an RFA decoder"):
        softmax.prepare_for_inference_(GENERATE_CFG)
    _, model = lm_model()
    with pytest.raises(ValueError, match="eval"):
        inference.to_decoding_form_(model.train(), compiled_step=True)
    assert torch.is_grad_enabled()
