"""int8 linear layers for decoding on the CPU, as CTranslate2's ``int8`` compute type does.

PyTorch's dynamic quantization (``torch.ao.quantization.quantize_dynamic``, fbgemm kernels): every
``nn.Linear`` keeps its weight in int8, one scale per output row, and quantizes its input on the
fly, one scale per call. At decoding's small batches a linear layer reads its whole weight for
a few rows, so the time goes to memory traffic, which int8 cuts by four. Embeddings, the random
feature maps, layer norms and the attention itself stay in float32. Inference on the CPU only:
the quantized layers have no backward pass and no CUDA kernels.

PyTorch 2.13 marks this API deprecated in favour of torchao, whose int8 layers are fast on the CPU
only under ``torch.compile`` (eager, they were slower than float32 here: docs/benchmarks.md);
when the API goes, this module is the one place to change.

The models take it as ``--int8-inference``: fairseq-generate, fairseq-interactive and
fairseq-eval-lm call the model's ``prepare_for_inference_`` after loading it, and
:class:`InferenceMixin` quantizes there.
"""
from dataclasses import dataclass, field

import torch
from fairseq.dataclass import FairseqDataclass
from fairseq.modules import MultiheadAttention
from torch import nn
from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic


@dataclass
class InferenceConfig(FairseqDataclass):
    int8_inference: bool = field(
        default=False,
        metadata={"help": "at inference on the CPU (fairseq-generate, fairseq-interactive, fairseq-eval-lm), the linear "
                          "layers in int8, as CTranslate2's int8 compute type (PyTorch's dynamic quantization, "
                          "rfa_fairseq/models/quantize.py). Training ignores it; for a trained checkpoint: "
                          "--model-overrides \"{'int8_inference': True}\""},
    )


def quantize_int8(model: nn.Module) -> nn.Module:
    """Replace ``model``'s linear layers, in place, by int8 ones (see the module docstring); returns it."""
    if model.training:
        raise ValueError("int8 quantization is for decoding: call model.eval() first (the int8 layers cannot train)")
    if any(p.device.type != "cpu" for p in model.parameters()):
        raise ValueError("int8 quantization runs on the CPU only: its kernels are fbgemm's (move the model with .cpu())")
    if "fbgemm" not in torch.backends.quantized.supported_engines:
        raise ValueError(f"int8 quantization needs PyTorch's fbgemm engine; this build has {torch.backends.quantized.supported_engines}")
    torch.backends.quantized.engine = "fbgemm"
    for module in model.modules():
        if isinstance(module, MultiheadAttention):
            # fairseq's softmax attention hands its projections' weights to torch's fused attention outside
            # decoding steps, and int8 layers have none to hand: this flag (fairseq's own, for pruned
            # models) sends it down its other path, which calls the projections.
            module.skip_embed_dim_check = True
    return quantize_dynamic(model, {nn.Linear: per_channel_dynamic_qconfig}, inplace=True)


class InferenceMixin:
    """Model mixin for ``prepare_for_inference_`` (what fairseq-generate, -interactive and -eval-lm
    call after loading): fuse every causal RFA module's input projections
    (``CausalRFAttention.fuse_projections_``), then quantize (:func:`quantize_int8`) when the model
    was built with ``--int8-inference`` (``self.int8_inference``, set by ``build_model``)."""

    int8_inference = False

    def prepare_for_inference_(self, cfg):
        super().prepare_for_inference_(cfg)  # fairseq's: eval mode, no training after it
        for module in self.modules():
            if hasattr(module, "fuse_projections_"):
                module.fuse_projections_()
        if self.int8_inference:
            quantize_int8(self)
