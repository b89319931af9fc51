"""Cross RFA through its state: the source summarised once as ``[S | z]`` ``[B, H, F, K + 1]`` over its non-padding
positions (the causal state's layout: one matmul per query), read at O(F K) per query. A state of ``Bs`` sources serves
``Bs * beam`` sentence-major query rows (rows ``i * beam ... (i + 1) * beam - 1`` share source ``i``), as in fairseq's
beam search, without a copy per beam (:func:`group_queries`). :func:`cross_rfa_quadratic` gives the same numbers
through the ``[Tq, S]`` feature products (by associativity ``phi(q_i).[S | z] = sum_j (phi(q_i).phi(k_j)) [v_j | 1]``),
cheaper while source and target are short next to the feature size (in training at sentence lengths, several times).
Decoding does not use it: the whole decode gained a few percent, not worth a second kind of decoding state."""
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from ..denominator import DEFAULT_EPS, compute_dtype, exact_dtypes, guard, guarded_ratio


@exact_dtypes
def cross_rfa_state(k: Tensor, v: Tensor, key_padding_mask: Optional[Tensor] = None) -> Tensor:
    """The state of k ``[B, H, S, F]``, v ``[B, H, S, K]`` bar padding: ``[B, H, F, K + 1]``, fp32 (fp64 for fp64)."""
    kf = k.to(compute_dtype(k))
    if key_padding_mask is not None:
        kf = kf.masked_fill(key_padding_mask[:, None, :, None].to(torch.bool), 0.0)
    return kf.transpose(-1, -2) @ F.pad(v.to(kf.dtype), (0, 1), value=1.0)


def group_queries(q: Tensor, num_sources: int) -> Tensor:
    """``[B, H, Tq, F]`` -> ``[Bs, H, beam * Tq, F]``: each source's beams side by side, for one matmul per source."""
    B, H, Tq, Fd = q.shape
    if B % num_sources != 0:
        raise ValueError(f"{B} query rows cannot share {num_sources} source states")
    return q.reshape(num_sources, B // num_sources, H, Tq, Fd).transpose(1, 2).reshape(num_sources, H, -1, Fd)


def ungroup(out: Tensor, B: int, Tq: int) -> Tensor:
    """The inverse of :func:`group_queries` for a result ``[Bs, H, beam * Tq, K]``."""
    Bs, H, _, K = out.shape
    return out.reshape(Bs, H, B // Bs, Tq, K).transpose(1, 2).reshape(B, H, Tq, K)


@exact_dtypes
def cross_rfa_apply(q: Tensor, state: Tensor, eps: float = DEFAULT_EPS, out_dtype=None) -> Tensor:
    """q ``[B, H, Tq, F]`` read from the state of :func:`cross_rfa_state` for ``B`` or ``B / beam`` sources, guarded
    by ``eps`` (``ops.denominator``): ``[B, H, Tq, K]`` in ``out_dtype`` (default: dtype of ``q``)."""
    o = group_queries(q.to(state.dtype), state.shape[0]) @ state  # numerator | denominator
    return ungroup(guarded_ratio(o[..., :-1], o[..., -1], eps, out_dtype or q.dtype), q.shape[0], q.shape[2])


def feature_products(q: Tensor, k: Tensor, key_padding_mask: Optional[Tensor] = None) -> Tensor:
    """``phi(q_i) . phi(k_j)`` for q ``[B, H, Tq, F]``, k ``[Bs, H, S, F]``: ``[Bs, H, beam * Tq, S]`` (grouped as
    :func:`group_queries`) in the accumulation dtype, zero at padded keys."""
    acc = compute_dtype(q)
    scores = group_queries(q.to(acc), k.shape[0]) @ k.to(acc).transpose(-1, -2)
    if key_padding_mask is not None:
        scores = scores.masked_fill(key_padding_mask[:, None, None, :].to(torch.bool), 0.0)
    return scores


def quadratic_is_cheaper(S: int, Fd: int, K: int, Tq: int) -> bool:
    """Whether :func:`cross_rfa_quadratic` takes fewer multiply-adds than the summary (``Tq`` queries per source)."""
    return Tq * S * (Fd + K + 1) < (S + Tq) * Fd * (K + 1)


@exact_dtypes
def cross_rfa_quadratic(q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Optional[Tensor] = None,
                        eps: float = DEFAULT_EPS, out_dtype=None) -> Tensor:
    """``cross_rfa_apply(q, cross_rfa_state(k, v, key_padding_mask))`` by :func:`feature_products`: q ``[B, H, Tq, F]``;
    k ``[Bs, H, S, F]``, v ``[Bs, H, S, K]``, key_padding_mask ``[Bs, S]``, ``Bs`` = ``B`` or ``B / beam``."""
    scores = feature_products(q, k, key_padding_mask)
    o = scores @ F.pad(v.to(scores.dtype), (0, 1), value=1.0)  # numerator | denominator
    return ungroup(guarded_ratio(o[..., :-1], o[..., -1], eps, out_dtype or q.dtype), q.shape[0], q.shape[2])


@exact_dtypes
def cross_rfa_weights(q: Tensor, k: Tensor, key_padding_mask: Optional[Tensor] = None, eps: float = DEFAULT_EPS) -> Tensor:
    """The attention weights RFA applies implicitly, ``phi(q_i).phi(k_j) / guard(phi(q_i).z)`` (``phi(q_i).z``: the
    row's sum), shapes as :func:`cross_rfa_quadratic`: ``[B, H, Tq, S]`` in fp32 (fp64 for fp64), zero at padding."""
    scores = feature_products(q, k, key_padding_mask)
    return ungroup(scores / guard(scores.sum(-1), eps).unsqueeze(-1), q.shape[0], q.shape[2])
