"""The guard on RFA's denominator phi(q) . z, and the dtypes of the attention ops. phi(q) . z estimates a positive sum
of kernel values, but with sin/cos features (``gaussian``) it can come out small or negative for a short history or
few features, and blow the output up. It is clamped from below at ``eps`` (``--rfa-eps``), in fp32; for positive
feature maps the floor only bounds how small it gets. Gradients do not flow through a clamped denominator. The authors' floors are much higher: their features are
``c [sin, cos]``, ours ``D^-1/2 [sin, cos]``, so their denominator is ours times ``c^2 D``: Noahs-ARK/RFA's 1.0
(c = 0.1) and T2R's 0.01 (c = 0.01) are both 1.56 in our units at D = 64, rfa-doc-mt's floor 0.31 at D = 32; their
cross attention takes the absolute value first. In the paper's gated form phi(q) . z stays below about 1: such a
floor, for ungated sums, would clamp almost every position."""
import contextlib
import functools

import torch
from torch import Tensor

DEFAULT_EPS = 1e-2


def compute_dtype(x: Tensor) -> torch.dtype:
    """The accumulation dtype of the ops: fp32, or fp64 for fp64 inputs (used by tests)."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def as_dtype(x: Tensor, dtype: torch.dtype) -> Tensor:
    """``x`` in ``dtype``; ``x`` itself when it is already (cheaper than ``Tensor.to``, as a decoding step notices)."""
    return x if x.dtype == dtype else x.to(dtype)


def guard(den: Tensor, eps: float) -> Tensor:
    return den.clamp_min(eps)


def guarded_ratio(num: Tensor, den: Tensor, eps: float, out_dtype: torch.dtype) -> Tensor:
    """num / guard(den) in (at least) fp32; ``num`` is ``[..., K]`` and ``den`` is ``[...]``."""
    acc = compute_dtype(num)
    return cast_finite(as_dtype(num, acc) / guard(as_dtype(den, acc), eps).unsqueeze(-1), out_dtype)


def cast_finite(out: Tensor, out_dtype: torch.dtype) -> Tensor:
    """``out`` in ``out_dtype``, clamped to its finite range when that is narrower."""
    if out.dtype == out_dtype:
        return out
    limit = torch.finfo(out_dtype).max
    if limit < torch.finfo(out.dtype).max:
        out = out.clamp(-limit, limit)
    return out.to(out_dtype)


def exact_dtypes(op):
    """``op`` run with autocast off where it is on: the op's own dtypes (fp32 accumulation for half inputs) always."""
    @functools.wraps(op)
    def run(*args, **kwargs):
        on = [device for device in ("cuda", "cpu") if torch.is_autocast_enabled(device)]
        if not on:
            return op(*args, **kwargs)
        with contextlib.ExitStack() as stack:
            for device in on:
                stack.enter_context(torch.autocast(device, enabled=False))
            return op(*args, **kwargs)
    return run
