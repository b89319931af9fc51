"""The guard on RFA's denominator phi(q) . z.

phi(q) . z estimates a sum of kernel values, which is positive. With sin/cos features
(``gaussian``) the estimate can still come out small or negative for a short history or few
features, and a denominator near zero blows the output up. We clamp it from below at ``eps``
(``--rfa-eps``, default 1e-2), in fp32; with ``absolute`` its absolute value is clamped instead
(``--rfa-cross-abs-denominator``, cross attention only). Positive feature maps (``arccos``,
``favor``, ``elu``) cannot make it negative, so for them the floor only bounds how small it gets.

The authors' code guards the same quantity at a much higher floor. Their features are
``c [sin, cos]`` with a constant ``c`` where ours are ``D^-1/2 [sin, cos]``, so their
denominator is ours times ``c^2 D``: Noahs-ARK/RFA clamps at 1.0 with c = 0.1 and T2R at 0.01
with c = 0.01, both 1.56 in our units at D = 64 (156 times our default), and rfa-doc-mt's
floor is 0.31 in our units at D = 32. Their cross attention takes the absolute value before the
clamp. In the paper's gated form (a convex mix of the history) phi(q) . z stays below about 1,
so a floor near 1.56 clamps almost every position there; it is a floor for ungated sums.

Gradients do not flow through a clamped denominator (it is a constant there). When the result
is cast to fp16/bf16 it is clamped to the dtype's finite range, so a large but finite fp32 value
never becomes inf.
"""
import torch
from torch import Tensor

DEFAULT_EPS = 1e-2


def compute_dtype(x: Tensor) -> torch.dtype:
    """The accumulation dtype of the ops: fp32, or fp64 for fp64 inputs (used by tests)."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def as_dtype(x: Tensor, dtype: torch.dtype) -> Tensor:
    """``x`` in ``dtype``; ``x`` itself when it is already (cheaper than a call to ``Tensor.to``,
    which a decoding step's few hundred numbers would notice)."""
    return x if x.dtype == dtype else x.to(dtype)


def guard(den: Tensor, eps: float, absolute: bool = False) -> Tensor:
    """max(den, eps), or max(|den|, eps) with ``absolute``."""
    return (den.abs() if absolute else den).clamp_min(eps)


def guarded_ratio(num: Tensor, den: Tensor, eps: float, out_dtype: torch.dtype, absolute: bool = False) -> Tensor:
    """num / guard(den) in (at least) fp32; ``num`` is ``[..., K]`` and ``den`` is ``[...]``."""
    acc = compute_dtype(num)
    return cast_finite(as_dtype(num, acc) / guard(as_dtype(den, acc), eps, absolute).unsqueeze(-1), out_dtype)


def cast_finite(out: Tensor, out_dtype: torch.dtype) -> Tensor:
    """``out`` in ``out_dtype``, clamped to its finite range when that is narrower."""
    if out.dtype == out_dtype:
        return out
    if torch.finfo(out_dtype).max < torch.finfo(out.dtype).max:
        limit = torch.finfo(out_dtype).max
        out = out.clamp(-limit, limit)
    return out.to(out_dtype)
