"""Causal RFA's decoding step in one pass over the state (float32 on the CPU; ``fused_step.cpp``). torch's operators
read the ``[B, H, F, K + 1]`` state four times a step (the beam's reorder, the decay, the update, the read-out) and
write it three times; at large batches that traffic is most of the step. The op here reads each parent's state once
and writes the advanced state once, into a second buffer (the two alternate). It is compiled by torch's extension API
on first use (about 45 s, cached in ``~/.cache/torch_extensions``); where it cannot be built, one warning, and
decoding keeps torch's operators (:func:`recurrent_causal_rfa_step`, its reference)."""
from pathlib import Path
from typing import Optional, Tuple

import torch
from torch import Tensor

from ...extensions import build
from ..denominator import as_dtype, guarded_ratio
from .recurrent import gate_weights


def load():
    """The compiled op, or None (built on the first call, for this CPU)."""
    return build(Path(__file__).with_name("fused_step.cpp"), "rfa_fused_step")


def deferrable(state: Optional[Tensor]) -> bool:
    """Whether beam search's reorder of ``state`` can wait for the next step: a float32 CPU state, no autograd."""
    return (state is not None and state.dtype == torch.float32 and state.device.type == "cpu"
            and not torch.is_grad_enabled() and not state.requires_grad)


def usable(state: Optional[Tensor]) -> bool:
    """Whether a step from ``state`` takes the fused op: deferrable, not being traced, the op built."""
    return deferrable(state) and not torch.compiler.is_compiling() and load() is not None


def fused_causal_rfa_step(q: Tensor, k: Tensor, v: Tensor, log_g: Optional[Tensor], state: Tensor,
                          parents: Optional[Tensor], spare: Tensor, eps: float, convex: bool = True
                          ) -> Tuple[Tensor, Tensor]:
    """:func:`recurrent_causal_rfa_step` from ``state.index_select(0, parents)`` (``parents [B]``, None: the rows as
    they are), the advanced state written into and returned as ``spare`` (``[B, H, F, K + 1]``, not ``state``'s)."""
    B, H, F = q.shape
    decay, v1 = gate_weights(v, log_g, torch.float32, convex)
    decay = torch.ones(B, H) if decay is None else decay.reshape(B, H)
    parents = torch.arange(B) if parents is None else parents
    o = load().step(state, spare, parents, as_dtype(q, torch.float32).contiguous(),
                    as_dtype(k, torch.float32).contiguous(), v1.contiguous(), decay.contiguous())
    return guarded_ratio(o[..., :-1], o[..., -1], eps, v.dtype), spare  # o: [B, H, K + 1]
