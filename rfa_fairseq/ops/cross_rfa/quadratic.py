"""Cross RFA in its quadratic form: through the keys' features instead of their summary.

By associativity ``phi(q_i).S = sum_j (phi(q_i).phi(k_j)) v_j`` and ``phi(q_i).z = sum_j
phi(q_i).phi(k_j)``: the numbers of the summary path (``state.py``) through the ``[Tq, S]`` feature
products. Per head, ``Tq`` queries of one source cost ``Tq S (F + K + 1)`` multiply-adds here and
``(S + Tq) F (K + 1)`` through the summary, so this form is cheaper while source and target are short
next to the feature size (in training at sentence lengths, several times). Decoding does not use it:
the whole decode gained a few percent, not worth a second kind of decoding state.
"""
from typing import Optional

import torch.nn.functional as F
from torch import Tensor

from ..denominator import DEFAULT_EPS, exact_dtypes, guarded_ratio
from .state import feature_products, ungroup


def quadratic_is_cheaper(S: int, Fd: int, K: int, Tq: int) -> bool:
    """Whether :func:`cross_rfa_quadratic` takes fewer multiply-adds than the summary for ``Tq``
    queries per source."""
    return Tq * S * (Fd + K + 1) < (S + Tq) * Fd * (K + 1)


@exact_dtypes
def cross_rfa_quadratic(
    q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Optional[Tensor] = None, eps: float = DEFAULT_EPS,
    out_dtype=None, absolute: bool = False,
) -> Tensor:
    """q: ``[B, H, Tq, F]``; k: ``[Bs, H, S, F]``, v: ``[Bs, H, S, K]``, key_padding_mask
    ``[Bs, S]`` (True = pad) for ``Bs`` = ``B`` or ``B / beam`` sources (beam rows sentence-major).
    Returns ``[B, H, Tq, K]`` in ``out_dtype`` (default: dtype of ``q``), equal to
    ``cross_rfa_apply(q, cross_rfa_state(k, v, key_padding_mask))``."""
    scores = feature_products(q, k, key_padding_mask)
    o = scores @ F.pad(v.to(scores.dtype), (0, 1), value=1.0)  # numerator | denominator
    out = guarded_ratio(o[..., :-1], o[..., -1], eps, out_dtype or q.dtype, absolute)
    return ungroup(out, q.shape[0], q.shape[2])
