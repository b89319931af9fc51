"""Causal RFA decoding in the attention form, for the first tokens of a decode.

After ``t`` tokens the summary ``Sz = [S | z]`` holds ``F (K + 1)`` numbers per head, however
small ``t`` is, and every decoding step reads (and beam search copies) all of them. The same
attention kept as its keys, values and gate weights,

    Sz_t = sum_{i <= t} w_{t,i} phi(k_i) [v_i | 1]^T,   w_{t,i} = (1 - g_i) prod_{i < j <= t} g_j

(``w = 1`` without a gate), holds ``t (F + K + 1)`` numbers (plus ``t`` gate weights): fewer
while ``t`` is below :func:`keys_capacity` (43 for the default self-attention F = 128, K = 64;
42 with a gate). A step then reads ``phi(q) . phi(k_i)`` for the
``t`` keys and mixes their ``[v_i | 1]``: the output of :func:`recurrent_causal_rfa_step_packed`
up to rounding. When the keys would outgrow the summary, :func:`keys_to_summary` folds them into
``Sz`` and decoding continues with the packed step.

The keys live in a buffer of exactly the summary's shape ``[B, H, F, K + 1]``, read as rows
``[n, B, H, W]`` (:func:`key_rows`; ``W = F + K + 1``, plus one gate-weight column with a gate):
the state's size is the same from the first token to the last, and the rows of the first ``t``
keys are one contiguous block, which is all a beam reorder copies (:func:`gather_keys`).
"""
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from ..denominator import DEFAULT_EPS, compute_dtype, guarded_ratio


def _row_width(num_features: int, head_dim: int, gated: bool) -> int:
    return num_features + head_dim + 1 + int(gated)


def keys_capacity(num_features: int, head_dim: int, gated: bool) -> int:
    """How many keys fit in a buffer the size of the summary ``[F, K + 1]`` per head: while a
    decode has fewer tokens than this, the attention form reads fewer numbers than the summary."""
    return num_features * (head_dim + 1) // _row_width(num_features, head_dim, gated)


def key_rows(buf: Tensor, gated: bool) -> Tensor:
    """The key rows ``[n, B, H, W]`` held in a contiguous ``[B, H, F, K + 1]`` buffer (a view):
    row ``i`` is ``[phi(k_i) | v_i | 1 (| w_i)]``. Rows past the number of keys in use are
    unused memory (uninitialised in a new buffer) and are never read."""
    B, H, Fd, K1 = buf.shape
    W = _row_width(Fd, K1 - 1, gated)
    n = keys_capacity(Fd, K1 - 1, gated)
    return buf.view(-1)[: n * B * H * W].view(n, B, H, W)


def _split(rows: Tensor, num_features: int, gated: bool):
    """``rows [t, B, H, W]`` -> ``phi(K)^T [B, H, F, t]``, ``[V | 1] [B, H, t, K + 1]``, ``w [B, H, t]``
    (views; ``w`` None without a gate)."""
    end = rows.shape[-1] - int(gated)
    keys = rows[..., :num_features].permute(1, 2, 3, 0)
    values = rows[..., num_features:end].permute(1, 2, 0, 3)
    w = rows[..., -1].permute(1, 2, 0) if gated else None
    return keys, values, w


def causal_keys_step(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    log_g: Optional[Tensor],
    buf: Optional[Tensor],
    length: int,
    eps: float = DEFAULT_EPS,
    inplace: bool = False,
) -> Tuple[Tensor, Tensor]:
    """Append token ``length`` (0-based) to the attention form and read it out.

    Args:
        q, k: ``[B, H, F]``; v: ``[B, H, K]``; log_g: ``[B, H]`` or None.
        buf: the key buffer ``[B, H, F, K + 1]`` (fp32, fp64 for fp64 inputs) holding ``length``
            keys, or None at the first token (``length`` must then be 0).
        inplace: write into ``buf`` (only when no gradient is needed and the caller owns it);
            otherwise a copy is written and returned.
    Returns:
        ``out [B, H, K]`` (dtype of ``v``) and the buffer now holding ``length + 1`` keys.
    """
    B, H, Fd = q.shape
    K = v.shape[-1]
    gated = log_g is not None
    acc = compute_dtype(q)
    if buf is None:
        if length != 0:
            raise ValueError(f"no key buffer for a state of {length} tokens")
        # Left uninitialised: only the rows in use are ever read or copied, and pages never
        # written are never made resident (zeros would add 8 MiB to the peak of a short decode).
        buf = q.new_empty(B, H, Fd, K + 1, dtype=acc)
    elif tuple(buf.shape) != (B, H, Fd, K + 1) or buf.dtype != acc:
        raise ValueError(f"key buffer {tuple(buf.shape)} {buf.dtype} does not match "
                         f"[{B}, {H}, {Fd}, {K + 1}] {acc}")
    elif not inplace:
        buf = buf.clone()
    rows = key_rows(buf, gated)
    if not 0 <= length < rows.shape[0]:
        raise ValueError(f"the attention form holds at most {rows.shape[0]} keys; got token {length}")
    row = [k.to(acc), F.pad(v.to(acc), (0, 1), value=1.0)]
    if gated:
        lg = log_g.to(acc)
        rows[:length, ..., -1].mul_(torch.exp(lg))  # every earlier key decays by g_t
        row.append(-torch.expm1(lg).unsqueeze(-1))  # and the new one enters with 1 - g_t
    if torch.is_grad_enabled():
        rows[length] = torch.cat(row, dim=-1)
    else:
        torch.cat(row, dim=-1, out=rows[length])
    keys, values, w = _split(rows[: length + 1], Fd, gated)
    scores = torch.matmul(q.to(acc).unsqueeze(-2), keys)  # [B, H, 1, t]
    if w is not None:
        scores = scores * w.unsqueeze(-2)
    o = torch.matmul(scores, values).squeeze(-2)  # [B, H, K + 1]: numerator | denominator
    return guarded_ratio(o[..., :-1], o[..., -1], eps, v.dtype), buf


def keys_to_summary(buf: Tensor, length: int, gated: bool) -> Tensor:
    """The packed summary ``Sz [B, H, F, K + 1]`` of the ``length`` keys in ``buf`` (a new tensor),
    from which :func:`recurrent_causal_rfa_step_packed` continues."""
    keys, values, w = _split(key_rows(buf, gated)[:length], buf.shape[-2], gated)
    if w is not None:
        keys = keys * w.unsqueeze(-2)
    return torch.matmul(keys, values)


def gather_keys(buf: Tensor, length: int, order: Tensor, gated: bool, out: Optional[Tensor] = None) -> Tensor:
    """Beam search: ``buf``'s batch rows in ``order`` (``[B', H, F, K + 1]``), copying only the
    ``length`` keys in use. ``out`` (same shape as the result, not ``buf``) receives them without
    autograd; otherwise a new buffer is made."""
    if out is None:
        out = buf.new_empty(order.numel(), *buf.shape[1:])
        key_rows(out, gated)[:length] = key_rows(buf, gated)[:length].index_select(1, order)
    else:
        torch.index_select(key_rows(buf, gated)[:length], 1, order, out=key_rows(out, gated)[:length])
    return out
