"""Recurrent causal RFA: one token at a time, O(F K) per head whatever the length (decoding). The state is ``[S | z]``
packed as one tensor ``[B, H, F, K + 1]``, as in every form: with a column of ones on ``v`` one outer product updates
both, one matmul reads out numerator and denominator, and beam search reorders one tensor. A decoding step's tensors
are a few hundred numbers: its time is the number of operators (kept small), not their size."""
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from ..denominator import DEFAULT_EPS, as_dtype, compute_dtype, exact_dtypes, guarded_ratio


def gate_weights(v: Tensor, log_g: Optional[Tensor], acc: torch.dtype, convex: bool) -> Tuple[Optional[Tensor], Tensor]:
    """A step's decay ``g [B, H, 1, 1]`` (None without a gate) and what it writes beside ``phi(k)``: ``[v | 1]``
    ``[B, H, K + 1]``, times ``1 - g`` if convex (-expm1(log g): exact for g near 1; K + 1 numbers, not F (K + 1))."""
    v1 = F.pad(as_dtype(v, acc), (0, 1), value=1.0)
    if log_g is None:
        return None, v1
    lg = as_dtype(log_g, acc).unsqueeze(-1)
    return torch.exp(lg).unsqueeze(-1), (v1 * -torch.expm1(lg) if convex else v1)


def advance(state: Optional[Tensor], decay: Optional[Tensor], k: Tensor, v1: Tensor, inplace: bool) -> Tensor:
    """``decay * state + k v1^T`` (``state`` None: zeros); ``inplace``: in ``state``'s memory, with no state-sized
    temporary (only when no gradient is needed and the caller owns the tensor)."""
    if state is None:  # contiguous whatever the strides of k: every later step and reorder reads it whole
        return (k.unsqueeze(-1) * v1.unsqueeze(-2)).contiguous()
    if inplace and state.dtype == k.dtype:
        if decay is not None:
            state.mul_(decay)
        return state.addcmul_(k.unsqueeze(-1), v1.unsqueeze(-2))
    state = as_dtype(state, k.dtype) if decay is None else as_dtype(state, k.dtype) * decay
    return torch.addcmul(state, k.unsqueeze(-1), v1.unsqueeze(-2))


@exact_dtypes
def recurrent_causal_rfa_step(q: Tensor, k: Tensor, v: Tensor, log_g: Optional[Tensor] = None,
                              state: Optional[Tensor] = None, eps: float = DEFAULT_EPS, convex: bool = True,
                              inplace: bool = False) -> Tuple[Tensor, Tensor]:
    """Advance the state by one token and read it out: ``out [B, H, K]`` (dtype of ``v``) and the new state. ``q, k``:
    feature-mapped ``[B, H, F]``; ``v``: ``[B, H, K]``; ``log_g``: ``[B, H]`` or None; ``state``: ``[B, H, F, K + 1]``
    in fp32 (fp64 for fp64 inputs), or None (zeros); ``inplace``: update ``state`` in place (:func:`advance`) and return
    that tensor; ``convex``: as :func:`naive_causal_rfa`. A pad (``k = 0``, ``log g = 0``) neither writes nor decays.

        [S | z]_t = g_t [S | z]_{t-1} + phi(k_t) [(1 - g_t) v_t | (1 - g_t)]   (g_t = 1 without a gate)
        out_t = phi(q_t) S_t / max(phi(q_t) . z_t, eps)"""
    acc = compute_dtype(q)
    decay, v1 = gate_weights(v, log_g, acc, convex)
    state = advance(state, decay, as_dtype(k, acc), v1, inplace)
    (B, H, Fd), K = q.shape, v.size(-1)
    o = torch.bmm(as_dtype(q, acc).reshape(B * H, 1, Fd), state.reshape(B * H, Fd, K + 1)).view(B, H, K + 1)
    return guarded_ratio(o[..., :K], o[..., K], eps, v.dtype), state  # numerator / denominator


@exact_dtypes
def recurrent_causal_rfa(q: Tensor, k: Tensor, v: Tensor, log_g: Optional[Tensor] = None,
                         initial_state: Optional[Tensor] = None, output_final_state: bool = False,
                         eps: float = DEFAULT_EPS, convex: bool = True) -> Tuple[Tensor, Optional[Tensor]]:
    """The contract of :func:`naive_causal_rfa` by :func:`recurrent_causal_rfa_step` (the decoder calls the step)."""
    state, outs = initial_state, []
    for t in range(q.size(2)):
        o, state = recurrent_causal_rfa_step(q[:, :, t], k[:, :, t], v[:, :, t],
                                             None if log_g is None else log_g[:, :, t], state, eps=eps, convex=convex)
        outs.append(o)
    if state is None:
        state = q.new_zeros(*q.shape[:2], q.size(-1), v.size(-1) + 1, dtype=compute_dtype(q))
    return (torch.stack(outs, dim=2) if outs else v.new_zeros(*v.shape)), (state if output_final_state else None)
