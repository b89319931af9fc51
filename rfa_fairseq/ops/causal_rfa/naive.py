"""Naive causal RFA: the per-step recurrence transcribed literally, in fp32. The reference."""
from typing import Optional, Tuple

import torch
from torch import Tensor

from ..denominator import DEFAULT_EPS, compute_dtype, guarded_ratio


def naive_causal_rfa(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    log_g: Optional[Tensor] = None,
    initial_state: Optional[Tuple[Tensor, Tensor]] = None,
    output_final_state: bool = False,
    eps: float = DEFAULT_EPS,
    convex: bool = True,
):
    """Causal (gated) RFA by an explicit loop over time.

    Args:
        q, k: feature-mapped queries and keys ``[B, H, T, F]``.
        v: values ``[B, H, T, K]``.
        log_g: log of the gate ``[B, H, T]`` (``<= 0``), or None for plain RFA.
        initial_state: ``(S [B, H, F, K], z [B, H, F])`` or None (zeros).
        convex: with a gate, write with weight ``1 - g_t`` (the paper's form, below); False: the
            decay form ``S_t = g_t S_{t-1} + k_t v_t^T`` (the RFA slides, GLA).
    Returns:
        ``out [B, H, T, K]`` (dtype of ``v``) and, if asked, the final ``(S, z)`` in fp32.

        S_t = g_t S_{t-1} + (1 - g_t) k_t v_t^T,  z_t = g_t z_{t-1} + (1 - g_t) k_t
        out_t = q_t^T S_t / max(q_t . z_t, eps)      (g_t = 1 - (1 - g_t) = 1 without a gate)
    """
    B, H, T, F = q.shape
    K = v.shape[-1]
    acc = compute_dtype(q)
    qf, kf, vf = q.to(acc), k.to(acc), v.to(acc)
    if initial_state is None:
        S = qf.new_zeros(B, H, F, K)
        z = qf.new_zeros(B, H, F)
    else:
        S, z = initial_state[0].to(acc), initial_state[1].to(acc)
    outs = []
    for t in range(T):
        kt, vt = kf[:, :, t], vf[:, :, t]
        if log_g is None:
            S = S + kt.unsqueeze(-1) * vt.unsqueeze(-2)
            z = z + kt
        else:
            lg = log_g[:, :, t].to(acc)
            g = torch.exp(lg)
            w = -torch.expm1(lg) if convex else torch.ones_like(lg)  # expm1: exact 1 - g for g near 1
            S = g[..., None, None] * S + w[..., None, None] * kt.unsqueeze(-1) * vt.unsqueeze(-2)
            z = g[..., None] * z + w[..., None] * kt
        qt = qf[:, :, t]
        num = torch.einsum("bhf,bhfk->bhk", qt, S)
        den = torch.einsum("bhf,bhf->bh", qt, z)
        outs.append(guarded_ratio(num, den, eps, v.dtype))
    out = torch.stack(outs, dim=2) if outs else v.new_zeros(B, H, 0, K)
    return (out, (S, z)) if output_final_state else out
