"""Chunked parallel causal RFA, for training and for multi-token incremental calls. Time is split into chunks of
``C``: inside a chunk the masked quadratic form ``(q k^T * decay, lower triangular) @ v``, across chunks the packed
state ``[S | z]``, in fp32: memory per head O(T C + (T / C) F K), not the O(T F K) of a cumsum of outer products. With
a gate, ``b`` is the inclusive cumulative sum of ``log g`` inside a chunk: position ``j`` reaches position ``i >= j``
of the chunk with weight ``exp(b_i - b_j) (1 - g_j)``, the differences masked to -inf above the diagonal *before*
``exp``, so every exponent is <= 0."""
from typing import Optional, Tuple

import torch
from torch import Tensor

from ..denominator import DEFAULT_EPS, compute_dtype, exact_dtypes, guarded_ratio

DEFAULT_CHUNK_SIZE = 64


def _pad_time(x: Tensor, pad: int) -> Tensor:
    return torch.cat([x, x.new_zeros(*x.shape[:2], pad, *x.shape[3:])], dim=2) if pad else x


@exact_dtypes
def chunk_causal_rfa(q: Tensor, k: Tensor, v: Tensor, log_g: Optional[Tensor] = None,
                     initial_state: Optional[Tensor] = None, output_final_state: bool = False,
                     eps: float = DEFAULT_EPS, convex: bool = True,
                     chunk_size: int = DEFAULT_CHUNK_SIZE) -> Tuple[Tensor, Optional[Tensor]]:
    """The contract of :func:`naive_causal_rfa`, in chunks of ``chunk_size``: ``o``, ``q_t^T [S_t | z_t]``
    ``[B, H, T, K + 1]`` in fp32 (fp64 for fp64 inputs), then numerators over denominators."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    (B, H, T, Fd), K = q.shape, v.shape[-1]
    acc = compute_dtype(q)
    if T == 0:
        final = q.new_zeros(B, H, Fd, K + 1, dtype=acc) if initial_state is None else initial_state.to(acc)
        return v.new_zeros(B, H, 0, K), (final if output_final_state else None)
    C = min(chunk_size, T)
    pad = (-T) % C
    N = (T + pad) // C
    qf, kf = (_pad_time(t.to(acc), pad).view(B, H, N, C, Fd) for t in (q, k))
    vf = _pad_time(torch.cat([v.to(acc), v.new_ones(B, H, T, 1, dtype=acc)], dim=-1), pad).view(B, H, N, C, K + 1)
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    # One chunk, no state in or out (training on sentences): the intra-chunk part is all, the state would cost more.
    intra_only = N == 1 and initial_state is None and not output_final_state
    if initial_state is not None:
        state0 = initial_state.to(acc)
    elif not intra_only:
        state0 = qf.new_zeros(B, H, Fd, K + 1)
    if log_g is None:
        attn = (qf @ kf.transpose(-1, -2)).masked_fill(~causal, 0.0)
        o = attn @ vf
        if not intra_only:
            chunk_kv = kf.transpose(-1, -2) @ vf  # [B, H, N, F, K+1]
            inclusive = torch.cumsum(chunk_kv, dim=2) + state0.unsqueeze(2)
            before = torch.cat([state0.unsqueeze(2), inclusive[:, :, :-1]], dim=2)
            o = o + qf @ before
            final = inclusive[:, :, -1]
    else:
        lg = _pad_time(log_g.to(acc), pad).view(B, H, N, C)
        # b and b_i - b_j in fp64 (small: [B, H, N, C(, C)]): in fp32 a long chunk of small gates loses precision.
        b = torch.cumsum(lg.double(), dim=-1)
        # Write weights (1 - g as -expm1(log g), exact near g = 1; decay form: 1) in [C, C] and per key, not [.., C, F]
        write = -torch.expm1(lg) if convex else torch.ones_like(lg)
        diff = (b.unsqueeze(-1) - b.unsqueeze(-2)).masked_fill(~causal, float("-inf"))
        attn = (qf @ kf.transpose(-1, -2)) * (torch.exp(diff).to(acc) * write.unsqueeze(-2))
        o = attn @ vf
        if not intra_only:
            b_last = b[..., -1:]
            chunk_kv = (kf * (torch.exp(b_last - b).to(acc) * write).unsqueeze(-1)).transpose(-1, -2) @ vf
            # The states entering chunks 0..N in one matmul: with p_n the sum of the log-decays of chunks < n (fp64),
            # S_n = sum_{m < n} exp(p_n - p_{m+1}) chunk_kv_m + exp(p_n) S_0, -inf where m >= n before exp (in [0, 1]).
            p = torch.nn.functional.pad(torch.cumsum(b_last.squeeze(-1), dim=-1), (1, 0))  # [B, H, N+1]
            strictly_before = torch.ones(N + 1, N, dtype=torch.bool, device=q.device).tril(-1)
            exponents = (p.unsqueeze(-1) - p[..., 1:].unsqueeze(-2)).masked_fill(~strictly_before, float("-inf"))
            states = (torch.exp(exponents).to(acc) @ chunk_kv.flatten(-2)).view(B, H, N + 1, Fd, K + 1)
            if initial_state is not None:
                states = states + torch.exp(p).to(acc)[..., None, None] * state0.unsqueeze(2)
            before, final = states[:, :, :N], states[:, :, N]
            # the decay from the chunk start to position i, on the [C, K + 1] result, not the [C, F] queries
            o = o + torch.exp(b).to(acc).unsqueeze(-1) * (qf @ before)

    o = o.reshape(B, H, N * C, K + 1)[:, :, :T]
    # the final state a copy, not a view that would keep the per-chunk states alive beside the decoding state
    return guarded_ratio(o[..., :-1], o[..., -1], eps, v.dtype), (final.clone() if output_final_state else None)
