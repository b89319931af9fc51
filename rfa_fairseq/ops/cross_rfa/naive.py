"""Naive cross RFA: explicit loops over keys and queries, in fp32. The reference."""
from typing import Optional

import torch
from torch import Tensor

from ..denominator import DEFAULT_EPS, compute_dtype, exact_dtypes, guarded_ratio


@exact_dtypes
def naive_cross_rfa(q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Optional[Tensor] = None,
                    eps: float = DEFAULT_EPS) -> Tensor:
    """out_i = sum_j phi(q_i).phi(k_j) v_j / max(sum_j phi(q_i).phi(k_j), eps) over non-pad keys j. q: ``[B, H, Tq, F]``; k: ``[B, H, S, F]``; v: ``[B, H, S, K]``;
    key_padding_mask: ``[B, S]``, True at padding. Returns ``[B, H, Tq, K]`` in the dtype of ``v``."""
    (B, H, Tq, F), (S_len, K) = q.shape, v.shape[2:]
    acc = compute_dtype(q)
    out = torch.empty(B, H, Tq, K, dtype=v.dtype, device=v.device)
    for b in range(B):
        for i in range(Tq):
            num, den = q.new_zeros(H, K, dtype=acc), q.new_zeros(H, dtype=acc)
            for j in range(S_len):
                if key_padding_mask is not None and bool(key_padding_mask[b, j]):
                    continue
                w = (q[b, :, i].to(acc) * k[b, :, j].to(acc)).sum(-1)
                num, den = num + w.unsqueeze(-1) * v[b, :, j].to(acc), den + w
            out[b, :, i] = guarded_ratio(num, den, eps, v.dtype)
    return out
