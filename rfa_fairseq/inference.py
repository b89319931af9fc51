"""A trained model's inference form, made in one place: fairseq-generate, fairseq-interactive and fairseq-eval-lm
call the model's ``prepare_for_inference_`` after loading it (:class:`InferenceMixin`), which, beyond fairseq's own
preparation, converts the model as its flags ask (:func:`to_decoding_form_`): with ``--int8-inference`` the decoder's
linear layers of at least ``--int8-min-weights`` weights in int8 on the CPU (``modules/int8_linear.py``), with
``--cuda-graphs`` every decoding step after the first replayed as a CUDA graph (``step_graphs.py``), with
``--onnx-runtime`` run by ONNX Runtime on the CPU (``onnx_step.py``; with ``--int8-inference`` its graph quantized by
ONNX Runtime, the model's layers kept float32). The int8 conversion swaps modules and cannot be undone: a converted
model does not train (checkpoints keep the training form).
"""
import logging
from dataclasses import dataclass, field, fields

import torch
from fairseq.dataclass import FairseqDataclass
from fairseq.modules import MultiheadAttention
from torch import nn

from . import onnx_step
from .modules.int8_linear import Int8Linear, int_mm_takes_uint8
from .step_graphs import StepGraphs
from .validation import flag, non_negative_int

logger = logging.getLogger(__name__)

# Below this many weights a linear layer stays float32 under --int8-inference: quantizing a decoding step's few
# input rows costs more than the int8 weight saves (docs/benchmarks.md#decoding-documents-trained-checkpoints).
INT8_MIN_WEIGHTS = 2 ** 18


@dataclass
class InferenceConfig(FairseqDataclass):
    int8_inference: bool = field(default=False, metadata={
        "help": "at inference on the CPU (fairseq-generate, fairseq-interactive, fairseq-eval-lm), the decoder's "
                "linear layers in int8, one scale per output row, as CTranslate2's int8 compute type (needs torch "
                "2.13's CPU int8 product). For a trained checkpoint: --model-overrides \"{'int8_inference': True}\""})
    int8_min_weights: int = field(default=INT8_MIN_WEIGHTS, metadata={
        "help": "with --int8-inference, only the layers of at least this many weights (0: all): below, quantizing a "
                "decoding step's few input rows costs more than the int8 weight saves"})
    cuda_graphs: bool = field(default=False, metadata={
        "help": "at inference on a CUDA device, every decoding step after the first replayed as one CUDA "
                "graph, one per batch size and state layout (rfa_fairseq/step_graphs.py); RFA "
                "decoders only. For a trained checkpoint: --model-overrides \"{'cuda_graphs': True}\""})
    onnx_runtime: bool = field(default=False, metadata={
        "help": "at inference on the CPU, every decoding step after the first run by ONNX Runtime, exported from the "
                "model once and cached in $RFA_ONNX_CACHE (default ~/.cache/rfa_fairseq/onnx; needs onnxruntime and "
                "onnxscript); with --int8-inference the exported graph is quantized by ONNX Runtime. RFA decoders "
                "only. For a trained checkpoint: --model-overrides \"{'onnx_runtime': True}\""})


def quantize_linears_(model: nn.Module, min_weights: int = 0) -> nn.Module:
    """Replace every ``nn.Linear`` of at least ``min_weights`` weights in ``model`` (evaluation mode, on the CPU), in
    place, by an :class:`Int8Linear`; returns ``model``. Subclasses of nn.Linear stay (as with torch's
    quantize_dynamic): torch's own MultiheadAttention, for one, reads its ``out_proj.weight``."""
    if model.training:
        raise ValueError("int8 quantization is for decoding: call model.eval() first (the int8 layers cannot train)")
    if any(t.device.type != "cpu" for t in [*model.parameters(), *model.buffers()]):
        raise ValueError("int8 layers run on the CPU only (oneDNN's CPU kernels): move the model with .cpu()")
    if not int_mm_takes_uint8():
        raise RuntimeError(f"int8 layers need torch._int_mm to take uint8 rows on the CPU, which torch {torch.__version__} "
                           "does not (torch 2.13 does): upgrade torch, or decode without --int8-inference")
    for module in list(model.modules()):
        if isinstance(module, MultiheadAttention):
            # fairseq's softmax attention hands its projections' weights to torch's fused attention outside
            # decoding steps, and int8 layers have none to hand: this flag (fairseq's own, for pruned
            # models) sends it down its other path, which calls the projections.
            module.skip_embed_dim_check = True
        for name, child in module.named_children():
            if type(child) is nn.Linear and child.weight.numel() >= min_weights:
                setattr(module, name, Int8Linear.from_float(child))
    return model


def to_decoding_form_(model: nn.Module, int8: bool = False, cuda_graphs: bool = False,
                      int8_min_weights: int = INT8_MIN_WEIGHTS, onnx_runtime: bool = False) -> nn.Module:
    """``model`` (in evaluation mode) with its decoder's linear layers of ``int8_min_weights`` weights or more in int8
    (``int8``; the encoder's one pass over many rows is faster in float32) and its decoding steps replayed as CUDA
    graphs (``cuda_graphs``: an RFA decoder's) or run by ONNX Runtime (``onnx_runtime``: then ``int8`` quantizes its
    graph, not the model's layers; without onnxruntime installed, a warning and eager steps); returns it."""
    if model.training:
        raise ValueError("the decoding form is for inference: call model.eval() first")
    if cuda_graphs and onnx_runtime:
        raise ValueError("--cuda-graphs (CUDA) and --onnx-runtime (CPU) are two ways to run the step: choose one")
    if onnx_runtime and not onnx_step.available():
        logger.warning("--onnx-runtime: onnxruntime or onnxscript is not installed (pip install onnxruntime "
                       "onnxscript); decoding steps run eagerly")
        onnx_runtime = False
    if int8 and not onnx_runtime:
        quantize_linears_(model.decoder, non_negative_int(flag("int8_min_weights"), int8_min_weights))
    if cuda_graphs:
        model.decoder.step_engine = StepGraphs(model.decoder)
    if onnx_runtime:
        model.decoder.step_engine = onnx_step.OnnxStep(model.decoder, int8=int8, int8_min_weights=non_negative_int(
            flag("int8_min_weights"), int8_min_weights))
    return model


class InferenceMixin:
    """Model mixin: ``prepare_for_inference_`` as the module docstring says (by the :class:`InferenceConfig` fields,
    which ``build_model`` reads); ``set_beam_size`` tells the decoder's modules the beam."""

    int8_inference, cuda_graphs, int8_min_weights, onnx_runtime = False, False, INT8_MIN_WEIGHTS, False

    def read_inference_flags(self, args):
        """The :class:`InferenceConfig` fields from ``args`` (a field unset or None: its default)."""
        for f in [f for f in fields(InferenceConfig) if not f.name.startswith("_")]:  # not FairseqDataclass's _name
            value = getattr(args, f.name, None)
            setattr(self, f.name, f.default if value is None else type(f.default)(value))

    def prepare_for_inference_(self, cfg):
        super().prepare_for_inference_(cfg)  # fairseq's: evaluation mode, no training after it
        to_decoding_form_(self, self.int8_inference, self.cuda_graphs, self.int8_min_weights, self.onnx_runtime)

    def set_beam_size(self, beam_size):
        """Called by fairseq's SequenceGenerator (for beams above 1): see ``modules/beam.py``."""
        self.decoder.set_beam_size(beam_size)
