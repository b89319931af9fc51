"""The guard on RFA's denominator phi(q) . z.

With sin/cos features phi(q) . z estimates a sum of positive kernel values, but the estimate
can come out small or negative for a short history or few features. We clamp it from below at
``eps`` (default 1e-2, ``--rfa-eps``) in fp32. The authors' code clamps too, at a higher floor
in these units: their features are scaled by a constant (0.1 or 0.01) instead of D^-1/2. Since
|phi(q)| = 1 for the Gaussian map and the sum over keys is bounded, the ratio is finite; when
the result is cast to fp16/bf16 it is clamped to the dtype's finite range so that a large but
finite fp32 value can never become inf. Gradients do not flow through a clamped
denominator (it is a constant there).
"""
import torch
from torch import Tensor

DEFAULT_EPS = 1e-2


def compute_dtype(x: Tensor) -> torch.dtype:
    """The accumulation dtype of the ops: fp32, or fp64 for fp64 inputs (used by tests)."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def guarded_ratio(num: Tensor, den: Tensor, eps: float, out_dtype: torch.dtype) -> Tensor:
    """num / max(den, eps) in (at least) fp32; ``num`` is ``[..., K]`` and ``den`` is ``[...]``."""
    acc = compute_dtype(num)
    return cast_finite(num.to(acc) / den.to(acc).clamp_min(eps).unsqueeze(-1), out_dtype)


def cast_finite(out: Tensor, out_dtype: torch.dtype) -> Tensor:
    """``out`` in ``out_dtype``, clamped to its finite range when that is narrower."""
    if out.dtype != out_dtype and torch.finfo(out_dtype).max < torch.finfo(out.dtype).max:
        limit = torch.finfo(out_dtype).max
        out = out.clamp(-limit, limit)
    return out.to(out_dtype)
