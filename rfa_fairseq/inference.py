"""A trained model's inference form, made in one place: fairseq-generate, fairseq-interactive and fairseq-eval-lm call
the model's ``prepare_for_inference_`` after loading it (:class:`InferenceMixin`), which converts the model as its flags
ask (:func:`to_decoding_form_`: ``onnx_step.py``, ``step_graphs.py``); the model's own layers stay as trained."""
import logging
from dataclasses import dataclass, field, fields

from fairseq.dataclass import FairseqDataclass
from torch import nn

from . import onnx_step
from .engines.compiled import CompiledStep
from .step_graphs import StepGraphs
from .validation import flag, non_negative_int

logger = logging.getLogger(__name__)

# Below this many weights a product stays float32 under --int8-inference: quantizing a decoding step's few input
# rows costs about what the smaller weight saves (docs/benchmarks.md#decoding-documents-trained-checkpoints).
INT8_MIN_WEIGHTS = 2 ** 18


@dataclass
class InferenceConfig(FairseqDataclass):
    int8_inference: bool = field(default=False, metadata={
        "help": "--onnx-runtime with the step's products by weight matrices in int8 (ONNX Runtime's dynamic "
                "quantization: uint8, one scale per output column; decoding steps only, not fairseq-eval-lm's "
                "scoring). For a trained checkpoint: --model-overrides \"{'int8_inference': True}\""})
    int8_min_weights: int = field(default=INT8_MIN_WEIGHTS, metadata={
        "help": "with --int8-inference, only the weight matrices of at least this many numbers (0: all)"})
    cuda_graphs: bool = field(default=False, metadata={
        "help": "at inference on a CUDA device, every decoding step after the first replayed as one CUDA "
                "graph, one per batch size and state layout (rfa_fairseq/step_graphs.py); RFA "
                "decoders only. For a trained checkpoint: --model-overrides \"{'cuda_graphs': True}\""})
    compiled_step: bool = field(default=False, metadata={
        "help": "at inference on the CPU, every decoding step after the first run by the project's compiled layers "
                "(rfa_fairseq/engines/compiled_step.cpp, built on first use); with --int8-inference their weight "
                "products in int8. RFA decoders only. For a trained checkpoint: --model-overrides "
                "\"{'compiled_step': True}\""})
    onnx_runtime: bool = field(default=False, metadata={
        "help": "at inference on the CPU, every decoding step after the first run by ONNX Runtime, exported from the "
                "model once and cached in $RFA_ONNX_CACHE (default ~/.cache/rfa_fairseq/onnx; needs onnxruntime and "
                "onnxscript); with --int8-inference the exported graph is quantized by ONNX Runtime. RFA decoders "
                "only. For a trained checkpoint: --model-overrides \"{'onnx_runtime': True}\""})


def to_decoding_form_(model: nn.Module, int8: bool = False, cuda_graphs: bool = False,
                      int8_min_weights: int = INT8_MIN_WEIGHTS, onnx_runtime: bool = False,
                      compiled_step: bool = False) -> nn.Module:
    """``model`` (in evaluation mode) with its decoding steps replayed as CUDA graphs (``cuda_graphs``) or run by ONNX
    Runtime (``onnx_runtime``; ``int8``: that and its weight matrices of ``int8_min_weights`` numbers or more in int8;
    without onnxruntime installed, a warning and eager steps); an RFA decoder's; returns it."""
    if model.training:
        raise ValueError("the decoding form is for inference: call model.eval() first")
    non_negative_int(flag("int8_min_weights"), int8_min_weights)
    onnx_runtime = onnx_runtime or int8 and not compiled_step
    if cuda_graphs and onnx_runtime:
        raise ValueError("--cuda-graphs (CUDA) and --onnx-runtime or --int8-inference (CPU) are two ways to run the "
                         "step: choose one")
    if onnx_runtime and not onnx_step.available():
        logger.warning("--onnx-runtime, --int8-inference: onnxruntime or onnxscript is not installed (pip install "
                       "onnxruntime onnxscript); decoding steps run eagerly in float32")
        onnx_runtime = False
    if cuda_graphs:
        model.decoder.step_engine = StepGraphs(model.decoder)
    if compiled_step:
        model.decoder.step_engine = CompiledStep(model.decoder, int8=int8, int8_min_weights=int8_min_weights)
    if onnx_runtime:
        model.decoder.step_engine = onnx_step.OnnxStep(model.decoder, int8=int8, int8_min_weights=int8_min_weights)
    return model


class InferenceMixin:
    """Model mixin: ``prepare_for_inference_`` by the :class:`InferenceConfig` fields (which ``build_model`` reads)."""

    int8_inference, cuda_graphs, int8_min_weights, onnx_runtime, compiled_step = False, False, INT8_MIN_WEIGHTS, False, False

    def read_inference_flags(self, args):
        """The :class:`InferenceConfig` fields from ``args`` (a field unset or None: its default)."""
        for f in [f for f in fields(InferenceConfig) if not f.name.startswith("_")]:  # not FairseqDataclass's _name
            value = getattr(args, f.name, None)
            setattr(self, f.name, f.default if value is None else type(f.default)(value))

    def prepare_for_inference_(self, cfg):
        super().prepare_for_inference_(cfg)  # fairseq's: evaluation mode, no training after it
        to_decoding_form_(self, self.int8_inference, self.cuda_graphs, self.int8_min_weights, self.onnx_runtime,
                          self.compiled_step)

    def set_beam_size(self, beam_size):
        """Called by fairseq's SequenceGenerator (for beams above 1): see ``modules/beam.py``."""
        self.decoder.set_beam_size(beam_size)
