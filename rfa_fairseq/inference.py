"""A trained model's decoding form, made in one place.

fairseq-generate, fairseq-interactive and fairseq-eval-lm call the model's
``prepare_for_inference_`` after loading it (:class:`InferenceMixin`); that converts the model:

- every causal RFA layer computes q, k, v and the gate's logit with one linear layer instead of
  four (a decoding step is a handful of rows, so each layer call costs about as much as its
  weight plus a fixed overhead: one call pays the overhead once), and with the ``gaussian``
  kernel takes its feature map precomputed (``ops.gaussian_step_weights``: one bmm and one sine
  make ``[sin | cos]``);
- with ``--int8-inference``, on the CPU, every linear layer holds int8 weights with one scale per
  output row (``modules.int8_linear``): at decoding's small batches a linear layer reads its whole
  weight for a few rows, and int8 reads a quarter as much.

The conversion swaps modules and cannot be undone: a converted model does not train, and a
checkpoint is always saved from the training form.
"""
from dataclasses import dataclass, field

import torch
from fairseq.dataclass import FairseqDataclass
from torch import nn

from .modules import CausalRFAttention
from .models.step_graphs import StepGraphs
from .modules.int8_linear import quantize_linears_
from .ops import gaussian_step_weights


@dataclass
class InferenceConfig(FairseqDataclass):
    int8_inference: bool = field(
        default=False,
        metadata={"help": "at inference on the CPU (fairseq-generate, fairseq-interactive, fairseq-eval-lm), the linear "
                          "layers in int8, one scale per output row, as CTranslate2's int8 compute type "
                          "(rfa_fairseq/inference.py; needs torch 2.13's CPU int8 product). Training ignores it; "
                          "for a trained checkpoint: --model-overrides \"{'int8_inference': True}\""},
    )
    cuda_graphs: bool = field(
        default=False,
        metadata={"help": "at inference on a CUDA device, every decoding step after the first replayed as one CUDA "
                          "graph, one per batch size and state layout (rfa_fairseq/models/step_graphs.py); RFA "
                          "decoders only. For a trained checkpoint: --model-overrides \"{'cuda_graphs': True}\""},
    )


@torch.no_grad()
def fuse_causal_rfa_(module: CausalRFAttention):
    """``module`` in its decoding form: ``in_proj`` in place of q_proj, k_proj, v_proj and gate_proj
    (their weights copied, stacked), and the gaussian feature map's step weights."""
    projs = [p for p in (module.q_proj, module.k_proj, module.v_proj, module.gate_proj) if p is not None]
    w = projs[0].weight
    fused = nn.Linear(module.embed_dim, sum(p.out_features for p in projs), device=w.device, dtype=w.dtype)
    fused.weight.copy_(torch.cat([p.weight for p in projs]))
    fused.bias.copy_(torch.cat([p.weight.new_zeros(p.out_features) if p.bias is None else p.bias for p in projs]))
    module.q_proj = module.k_proj = module.v_proj = module.gate_proj = None
    module.in_proj = fused
    if module.feature_map.kernel == "gaussian":
        module.step_projection, module.step_phase = gaussian_step_weights(module.feature_map.random_matrix,
                                                                          module.feature_map.sigma)


def to_decoding_form_(model: nn.Module, int8: bool = False) -> nn.Module:
    """Convert ``model`` (in evaluation mode) as the module docstring says; returns it."""
    if model.training:
        raise ValueError("the decoding form is for inference: call model.eval() first")
    for module in model.modules():
        if isinstance(module, CausalRFAttention) and module.in_proj is None:
            fuse_causal_rfa_(module)
    if int8:
        quantize_linears_(model)
    return model


class InferenceMixin:
    """Model mixin: ``prepare_for_inference_`` converts the model to its decoding form, with int8
    layers when it was built with ``--int8-inference`` and graphs of the decoding step with
    ``--cuda-graphs`` (``self.int8_inference``, ``self.cuda_graphs``: set by ``build_model``)."""

    int8_inference = cuda_graphs = False

    def prepare_for_inference_(self, cfg):
        super().prepare_for_inference_(cfg)  # fairseq's: evaluation mode, no training after it
        to_decoding_form_(self, self.int8_inference)
        if self.cuda_graphs:
            self.decoder.step_graphs = StepGraphs(self.decoder)
