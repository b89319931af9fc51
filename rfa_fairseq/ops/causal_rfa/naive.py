"""Naive causal RFA: the per-step recurrence transcribed literally, in fp32. The reference."""
from typing import Optional, Tuple

import torch
from torch import Tensor

from ..denominator import DEFAULT_EPS, compute_dtype, exact_dtypes, guarded_ratio


@exact_dtypes
def naive_causal_rfa(q: Tensor, k: Tensor, v: Tensor, log_g: Optional[Tensor] = None,
                     initial_state: Optional[Tensor] = None, output_final_state: bool = False,
                     eps: float = DEFAULT_EPS, convex: bool = True) -> Tuple[Tensor, Optional[Tensor]]:
    """Causal (gated) RFA by an explicit loop over time, the contract of every causal form (``chunk_causal_rfa``,
    ``recurrent_causal_rfa``). ``q, k``: feature-mapped queries and keys ``[B, H, T, F]``; ``v``: values
    ``[B, H, T, K]``; ``log_g``: the log gate ``[B, H, T]`` (``<= 0``), or None for plain RFA; ``initial_state``:
    ``[S | z]`` packed as ``[B, H, F, K + 1]`` (every RFA state's layout), or None (zeros); ``convex=False``: the decay
    form ``S_t = g_t S_{t-1} + k_t v_t^T`` (the RFA slides, GLA). Returns ``out [B, H, T, K]`` (dtype of ``v``) and,
    with ``output_final_state``, the final state (fp32; fp64 for fp64 inputs), else None:

        S_t = g_t S_{t-1} + (1 - g_t) k_t v_t^T,  z_t = g_t z_{t-1} + (1 - g_t) k_t
        out_t = q_t^T S_t / max(q_t . z_t, eps)      (g_t = 1 without a gate)"""
    (B, H, T, F), K = q.shape, v.shape[-1]
    acc = compute_dtype(q)
    qf, kf, vf = q.to(acc), k.to(acc), v.to(acc)
    S, z = ((qf.new_zeros(B, H, F, K), qf.new_zeros(B, H, F)) if initial_state is None
            else (initial_state[..., :K].to(acc), initial_state[..., K].to(acc)))
    outs = []
    for t in range(T):
        kt, vt = kf[:, :, t], vf[:, :, t]
        if log_g is None:
            S, z = S + kt.unsqueeze(-1) * vt.unsqueeze(-2), z + kt
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
    return out, (torch.cat([S, z.unsqueeze(-1)], dim=-1) if output_final_state else None)
