"""Cross RFA in its quadratic form, for all target positions at once (training, scoring).

By associativity ``phi(q_i).S = sum_j (phi(q_i).phi(k_j)) v_j`` and ``phi(q_i).z = sum_j
phi(q_i).phi(k_j)``: the same numbers as the state path of ``state.py``, computed through the
``[Tq, S]`` matrix of feature products instead of the ``[F, K + 1]`` summary. Per head this costs
``Tq S (F + K + 1)`` multiply-adds against the summary's ``(S + Tq) F (K + 1)``, so it is the
cheaper one whenever the source and target are short next to the feature size: at sentence
lengths (tens of tokens, ``F`` in the hundreds) several times cheaper.
"""
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from ..denominator import DEFAULT_EPS, compute_dtype, guarded_ratio


def quadratic_is_cheaper(Tq: int, S: int, Fd: int, K: int) -> bool:
    """Whether :func:`cross_rfa_quadratic` takes fewer multiply-adds than the summary path."""
    return Tq * S * (Fd + K + 1) < (S + Tq) * Fd * (K + 1)


def cross_rfa_quadratic(
    q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Optional[Tensor] = None, eps: float = DEFAULT_EPS,
    out_dtype=None, absolute: bool = False,
) -> Tensor:
    """q: ``[B, H, Tq, F]``, k: ``[B, H, S, F]``, v: ``[B, H, S, K]``, key_padding_mask ``[B, S]``
    (True = pad). Returns ``[B, H, Tq, K]`` in ``out_dtype`` (default: dtype of ``q``), equal to
    ``cross_rfa_apply(q, cross_rfa_state(k, v, key_padding_mask))``."""
    acc = compute_dtype(q)
    scores = q.to(acc) @ k.to(acc).transpose(-1, -2)  # [B, H, Tq, S]
    if key_padding_mask is not None:
        scores = scores.masked_fill(key_padding_mask[:, None, None, :].to(torch.bool), 0.0)
    o = scores @ F.pad(v.to(acc), (0, 1), value=1.0)  # numerator | denominator
    return guarded_ratio(o[..., :-1], o[..., -1], eps, out_dtype or q.dtype, absolute)
