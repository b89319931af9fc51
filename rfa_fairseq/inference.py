"""A trained model's inference form, made in one place: fairseq-generate, fairseq-interactive and fairseq-eval-lm call
the model's ``prepare_for_inference_`` after loading it (:class:`InferenceMixin`), which converts the model as its flags
ask (:func:`to_decoding_form_`: a step engine of ``engines/``); the model's own layers stay as trained."""
from dataclasses import dataclass, field, fields

from fairseq.dataclass import FairseqDataclass
from torch import nn

from .engines.compiled import CompiledStep
from .engines.step_graphs import StepGraphs
from .validation import flag, non_negative_int

# Under --int8-inference the products by weight matrices of at least this many numbers take int8 weights: all of them
# (docs/benchmarks.md#the-compiled-step---compiled-step).
INT8_MIN_WEIGHTS = 0


@dataclass
class InferenceConfig(FairseqDataclass):
    compiled_step: bool = field(default=False, metadata={
        "help": "at inference on the CPU, every decoding step run by the project's compiled layers "
                "(rfa_fairseq/engines/compiled_step.cpp, built for the CPU on first use); with --task rfa_translation "
                "the beam search too. RFA decoders with the gaussian kernel. For a trained "
                "checkpoint: --model-overrides \"{'compiled_step': True}\""})
    int8_inference: bool = field(default=False, metadata={
        "help": "--compiled-step with its products by weight matrices in int8 (the weights one scale per output, the "
                "inputs quantized per step and row; oneDNN, at a few rows a loop of its own on CPUs with AVX-512 "
                "VNNI) and the causal states in float16 (the compiled layers only, not fairseq-eval-lm's scoring). "
                "For a trained checkpoint: --model-overrides \"{'int8_inference': True}\""})
    int8_min_weights: int = field(default=INT8_MIN_WEIGHTS, metadata={
        "help": "with --int8-inference, only the weight matrices of at least this many numbers (0: all)"})
    cuda_graphs: bool = field(default=False, metadata={
        "help": "at inference on a CUDA device, every decoding step after the first replayed as one CUDA "
                "graph, one per batch size and state layout (rfa_fairseq/engines/step_graphs.py); RFA "
                "decoders only. For a trained checkpoint: --model-overrides \"{'cuda_graphs': True}\""})


def to_decoding_form_(model: nn.Module, int8: bool = False, cuda_graphs: bool = False,
                      int8_min_weights: int = INT8_MIN_WEIGHTS, compiled_step: bool = False) -> nn.Module:
    """``model`` (in evaluation mode) with its decoding steps replayed as CUDA graphs (``cuda_graphs``) or run by the
    compiled layers (``compiled_step``; ``int8``: that with its weight matrices of ``int8_min_weights`` numbers or more
    in int8; where the C++ cannot be built, a warning and eager steps); an RFA decoder's; returns it."""
    if model.training:
        raise ValueError("the decoding form is for inference: call model.eval() first")
    non_negative_int(flag("int8_min_weights"), int8_min_weights)
    compiled_step = compiled_step or int8
    if cuda_graphs and compiled_step:
        raise ValueError("--cuda-graphs (CUDA) and --compiled-step or --int8-inference (CPU) are two ways to run the "
                         "step: choose one")
    if cuda_graphs:
        model.decoder.step_engine = StepGraphs(model.decoder)
    if compiled_step:
        model.decoder.step_engine = CompiledStep(model.decoder, int8=int8, int8_min_weights=int8_min_weights)
    return model


class InferenceMixin:
    """Model mixin: ``prepare_for_inference_`` by the :class:`InferenceConfig` fields (which ``build_model`` reads)."""

    int8_inference, cuda_graphs, int8_min_weights, compiled_step = False, False, INT8_MIN_WEIGHTS, False

    def read_inference_flags(self, args):
        """The :class:`InferenceConfig` fields from ``args`` (a field unset or None: its default)."""
        for f in [f for f in fields(InferenceConfig) if not f.name.startswith("_")]:  # not FairseqDataclass's _name
            value = getattr(args, f.name, None)
            setattr(self, f.name, f.default if value is None else type(f.default)(value))

    def prepare_for_inference_(self, cfg):
        super().prepare_for_inference_(cfg)  # fairseq's: evaluation mode, no training after it
        to_decoding_form_(self, self.int8_inference, self.cuda_graphs, self.int8_min_weights, self.compiled_step)

    def set_beam_size(self, beam_size):
        """Called by fairseq's SequenceGenerator (for beams above 1): see ``modules/beam.py``."""
        self.decoder.set_beam_size(beam_size)
