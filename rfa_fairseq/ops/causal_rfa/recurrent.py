"""One step of causal RFA for incremental decoding: O(F K) per head, whatever the length.

The recurrent state is kept packed, ``Sz = [S | z]`` of shape ``[B, H, F, K + 1]`` (``z`` is the
last column): with a column of ones appended to ``v`` one outer product updates both, one
matmul reads out numerator and denominator, and beam search reorders one tensor.
"""
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from ..denominator import DEFAULT_EPS, compute_dtype, guarded_ratio


def pack_state(S: Tensor, z: Tensor) -> Tensor:
    """``(S [..., F, K], z [..., F])`` -> ``Sz [..., F, K + 1]`` (a new tensor)."""
    return torch.cat([S, z.unsqueeze(-1).to(S.dtype)], dim=-1)


def unpack_state(Sz: Tensor) -> Tuple[Tensor, Tensor]:
    """``Sz [..., F, K + 1]`` -> ``(S, z)`` as views of ``Sz``."""
    return Sz[..., :-1], Sz[..., -1]


def recurrent_causal_rfa_step(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    log_g: Optional[Tensor],
    state: Optional[Tensor],
    eps: float = DEFAULT_EPS,
    inplace: bool = False,
    convex: bool = True,
) -> Tuple[Tensor, Tensor]:
    """Advance the packed state by one token and read it out.

        Sz_t = g_t Sz_{t-1} + phi(k_t) [(1 - g_t) v_t | (1 - g_t)]      (g_t = 1 without a gate)
        out_t = phi(q_t) S_t / max(phi(q_t) . z_t, eps)

    (``convex=False``: the decay form, without the factors ``1 - g_t``.)

    Args:
        q, k: feature-mapped ``[B, H, F]``; v: ``[B, H, K]``; log_g: ``[B, H]`` or None.
        state: ``Sz [B, H, F, K + 1]`` in fp32 (fp64 for fp64 inputs), or None at the first token.
        inplace: update ``state`` in place (only when no gradient is needed and the caller
            owns the tensor); the same tensor is then returned.
    Returns:
        ``out [B, H, K]`` (dtype of ``v``) and the new ``Sz``.
    """
    acc = compute_dtype(q)
    qf, kf = q.to(acc), k.to(acc)
    v1 = F.pad(v.to(acc), (0, 1), value=1.0)  # [v | 1]
    decay = None
    if log_g is not None:
        lg = log_g.to(acc)
        decay = torch.exp(lg)[..., None, None]
        if convex:
            # (1 - g) as -expm1(log g) (exact for g near 1), on the value side: K + 1 numbers, not F.
            v1 = v1 * (-torch.expm1(lg)).unsqueeze(-1)
    if state is None:
        # contiguous whatever the strides of k: every later step and reorder reads it whole
        Sz = (kf.unsqueeze(-1) * v1.unsqueeze(-2)).contiguous()
    elif inplace and state.dtype == acc:
        Sz = state
        if decay is not None:
            Sz.mul_(decay)
        Sz.addcmul_(kf.unsqueeze(-1), v1.unsqueeze(-2))  # no [B, H, F, K + 1] temporary
    else:
        Sz = state.to(acc)
        if decay is not None:
            Sz = Sz * decay
        Sz = torch.addcmul(Sz, kf.unsqueeze(-1), v1.unsqueeze(-2))
    o = torch.matmul(qf.unsqueeze(-2), Sz).squeeze(-2)  # [B, H, K + 1]: numerator | denominator
    return guarded_ratio(o[..., :-1], o[..., -1], eps, v.dtype), Sz
