"""int8 linear layers for decoding on the CPU, in plain PyTorch ops (no quantized dtypes, no torch.ao).

A decoding step's linear layers read their whole weight for a few rows: their time is memory traffic, and an int8
weight is a quarter of a float32 one. Input rows are quantized (:func:`quantize_input`) into uint8 shifted by 128
(what oneDNN's int8 kernels take without a correction pass over the weight), multiplied into int32 and rescaled:
``y[i, j] = m[i] / 127 * scale[j] * acc[i, j] + bias[j]``. By the faster product measured (one thread, this
project's shapes): ``torch._int_mm`` on the plain weight for one row and small weights (the shift taken off after,
``128 * sum(weight[j])``), ``onednn.qlinear_pointwise`` for several rows and 2**19 weights or more: it takes
oneDNN's blocked layout, which ``_int_mm`` re-blocks on every call of more than one row (nearly 3x slower for a
512 x 25000 layer at 4 rows), but costs some 20 us more a call. The blocked copy is made on first use and kept
beside the buffers (not in the state dict, never pickled).
"""
import functools

import torch
from torch import nn

_TINY = torch.finfo(torch.float32).tiny
_SHIFT = torch.tensor(128.5)  # 128 for uint8, 0.5 to round: floor(v + 128.5) = round(v) + 128
_BLOCKED_MIN_NUMEL = 2 ** 19


@functools.lru_cache(maxsize=None)
def has_blocked_kernel() -> bool:
    """Whether this torch has oneDNN's int8 linear on the blocked weight."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.onednn, "qlinear_pointwise")


@functools.lru_cache(maxsize=None)
def int_mm_takes_uint8() -> bool:
    """Whether this torch's CPU ``torch._int_mm`` multiplies uint8 rows by an int8 weight (torch 2.13 does,
    2.11 does not: it takes int8 rows only)."""
    try:
        torch._int_mm(torch.zeros(1, 8, dtype=torch.uint8), torch.zeros(8, 8, dtype=torch.int8))
    except RuntimeError:
        return False
    return True


def quantize_input(x: torch.Tensor):
    """Rows of ``x`` (2-d, float32) as uint8, one scale each: ``(x_u8, m)``, ``m [rows, 1]`` the rows' largest
    ``|x|`` (the smallest positive float for a zero row): ``x ≈ (x_u8 - 128) * m / 127`` within ``m / 254``."""
    m = torch.linalg.vector_norm(x, float("inf"), dim=1, keepdim=True).clamp_min_(_TINY)
    return torch.addcdiv(_SHIFT, x, m, value=127).to(torch.uint8), m


class Int8Linear(nn.Module):
    """nn.Linear's inference with int8 weights and inputs (module docstring). Buffers: ``weight`` int8
    ``[out_features, in_features]``, row ``j`` rounded symmetrically to ``round(w[j] / scale[j])``; ``scale``
    float32 ``[out_features]``, ``max |w[j]| / 127``; ``bias`` float32 ``[out_features]`` or None. Make one with
    :meth:`from_float`, in evaluation mode: it has no backward pass, and in training mode it raises."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("weight", torch.zeros(out_features, in_features, dtype=torch.int8))
        self.register_buffer("scale", torch.ones(out_features))
        self.register_buffer("bias", torch.zeros(out_features) if bias else None)
        self._derived = None  # what the kernels take, made from the weight: see _kernel_inputs

    @classmethod
    @torch.no_grad()
    def from_float(cls, linear: nn.Linear) -> "Int8Linear":
        module = cls(linear.in_features, linear.out_features, bias=linear.bias is not None)
        w = linear.weight.detach().float().cpu()
        module.scale.copy_(w.abs().amax(1).div_(127).clamp_min_(_TINY))
        module.weight.copy_(torch.round(w / module.scale[:, None]))
        if linear.bias is not None:
            module.bias.copy_(linear.bias.detach())
        return module.eval()

    def _kernel_inputs(self):
        """``(128 * sum(weight[j]) in int32, the blocked weight or None, its zero points, a zero bias)``, made on
        first use, and again after load_state_dict or .to() (change the weight through these only)."""
        if self._derived is None:
            correction = 128 * self.weight.sum(1, dtype=torch.int32)
            blocked = None
            if has_blocked_kernel() and self.weight.numel() >= _BLOCKED_MIN_NUMEL:
                blocked = torch.ops.onednn.qlinear_prepack(self.weight, None)
            n = self.out_features
            self._derived = correction, blocked, torch.zeros(n, dtype=torch.long), torch.zeros(n)
        return self._derived

    def _load_from_state_dict(self, *args, **kwargs):
        self._derived = None
        super()._load_from_state_dict(*args, **kwargs)

    def _apply(self, *args, **kwargs):
        self._derived = None
        return super()._apply(*args, **kwargs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            raise RuntimeError("Int8Linear was converted for inference and cannot train: call .eval()")
        x2 = x.reshape(-1, self.in_features)
        correction, blocked, zero_points, zero_bias = self._kernel_inputs()
        bias = zero_bias if self.bias is None else self.bias
        x_u8, m = quantize_input(x2)
        if blocked is not None and x2.shape[0] > 1:
            # (x_u8 - 128) / 127 @ (weight * scale[:, None]).T, in float32
            out = torch.ops.onednn.qlinear_pointwise(x_u8, 1 / 127, 128, blocked, self.scale, zero_points, None,
                                                     1.0, 0, torch.float32, "none", [], "")
            out = torch.addcmul(bias, out, m)
        else:
            acc = torch._int_mm(x_u8, self.weight.t()).sub_(correction)  # (x_u8 - 128) @ weight.T, int32
            out = torch.addcmul(bias, acc.mul(m), self.scale, value=1 / 127)
        return out.view(*x.shape[:-1], self.out_features)

    def __getstate__(self):  # the blocked weight is an opaque oneDNN tensor, which cannot be copied
        return {**super().__getstate__(), "_derived": None}

    def extra_repr(self):
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
