"""Cross RFA through its state: (S, z) summarise the source once; each query costs O(F K).

``S = sum_j phi(k_j) v_j^T`` ``[B, H, F, K]`` and ``z = sum_j phi(k_j)`` ``[B, H, F]`` over the
non-padding source positions. A state computed for ``Bs`` sources can serve ``Bs * beam`` query
rows laid out sentence-major (rows ``i * beam ... (i + 1) * beam - 1`` share source ``i``), as in
fairseq's beam search: the queries are grouped, and the state is never copied per beam.
"""
from typing import Optional, Tuple

import torch
from torch import Tensor

from ..denominator import DEFAULT_EPS, compute_dtype, guarded_ratio


def cross_rfa_state(k: Tensor, v: Tensor, key_padding_mask: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """k: ``[B, H, S, F]``, v: ``[B, H, S, K]``, key_padding_mask ``[B, S]`` (True = pad).

    Returns ``(S [B, H, F, K], z [B, H, F])`` in fp32."""
    acc = compute_dtype(k)
    kf = k.to(acc)
    if key_padding_mask is not None:
        kf = kf.masked_fill(key_padding_mask[:, None, :, None].to(torch.bool), 0.0)
    return kf.transpose(-1, -2) @ v.to(acc), kf.sum(dim=2)


def _group(q: Tensor, num_sources: int) -> Tensor:
    B = q.shape[0]
    if B % num_sources != 0:
        raise ValueError(f"{B} query rows cannot share {num_sources} source states")
    return q.reshape(num_sources, B // num_sources, *q.shape[1:])


def cross_rfa_apply(q: Tensor, state: Tuple[Tensor, Tensor], eps: float = DEFAULT_EPS, out_dtype=None) -> Tensor:
    """q: ``[B, H, Tq, F]``; state from :func:`cross_rfa_state` for ``B`` or ``B / beam`` sources.

    Returns ``[B, H, Tq, K]`` in ``out_dtype`` (default: dtype of ``q``)."""
    S, z = state
    Bs, H, Fd, K = S.shape
    B, _, Tq, _ = q.shape
    # [B, H, Tq, F] -> [Bs, H, beam * Tq, F]: the rows of one source's beams as one matmul.
    qg = _group(q.to(S.dtype), Bs).transpose(1, 2).reshape(Bs, H, -1, Fd)
    num = torch.matmul(qg, S)
    den = torch.matmul(qg, z.unsqueeze(-1)).squeeze(-1)
    out = guarded_ratio(num, den, eps, out_dtype or q.dtype)  # [Bs, H, beam * Tq, K]
    return out.reshape(Bs, H, B // Bs, Tq, K).transpose(1, 2).reshape(B, H, Tq, K)


def cross_rfa_weights(
    q: Tensor, k: Tensor, state: Tuple[Tensor, Tensor], key_padding_mask: Optional[Tensor] = None,
    eps: float = DEFAULT_EPS,
) -> Tensor:
    """The attention weights RFA applies implicitly: ``phi(q_i).phi(k_j) / max(phi(q_i).z, eps)``.

    q: ``[B, H, Tq, F]``; k: ``[Bs, H, S, F]`` for the ``Bs`` sources of ``state``.
    Returns ``[B, H, Tq, S]`` in fp32 (zero at padding)."""
    Bs = k.shape[0]
    acc = state[0].dtype
    qg = _group(q.to(acc), Bs)
    scores = torch.einsum("sbhtf,shjf->sbhtj", qg, k.to(acc))
    if key_padding_mask is not None:
        scores = scores.masked_fill(key_padding_mask[:, None, None, None, :].to(torch.bool), 0.0)
    den = torch.einsum("sbhtf,shf->sbht", qg, state[1]).clamp_min(eps)
    w = scores / den.unsqueeze(-1)
    return w.reshape(q.shape[0], *w.shape[2:])
