"""Causal RFA by flash-linear-attention's Triton kernels (optional ``fla-core``), for training on a GPU. RFA-Gate is
fla's "simple GLA", one scalar gate per head and step: ``chunk_simple_gla(q = phi(q), k = w phi(k), v = [v | 1],
g = log g, scale = 1)``, ``w = 1 - g`` in the convex form (else 1); fla's state ``[F, K + 1]`` per head is our packed
``[S | z]``. The kernels compute in fp32 inside but hand the numerators and the denominator back in the inputs' dtype
(bf16 under ``--bf16``) before our fp32 division; the state stays fp32. ``v`` gets a column of zeros where ``K + 1``
is odd (fla's half-precision backward wants even sizes). On a CPU the kernels run only under Triton's interpreter
(``TRITON_INTERPRET=1`` before fla's import)."""
import functools
import importlib.util
import os
from typing import Optional, Tuple

import torch
from torch import Tensor

from ..denominator import DEFAULT_EPS, exact_dtypes, guarded_ratio

BACKENDS = ("auto", "torch", "fla")  # --rfa-backend


@functools.lru_cache(maxsize=None)
def fla_installed() -> bool:
    """Whether fla-core and Triton can be imported (without importing them); looked up once, not per forward."""
    return all(importlib.util.find_spec(name) is not None for name in ("fla", "triton"))


def fla_chosen(backend: str, device: torch.device, gated: bool) -> bool:
    """Whether ``--rfa-backend`` ``backend`` trains on fla's kernels on ``device``: ``fla`` always (its errors name what
    is missing), ``torch`` never, ``auto`` on CUDA with fla-core unless gated and :func:`fla_refuses_gated_backward`."""
    if backend != "auto":
        return backend == "fla"
    return device.type == "cuda" and fla_installed() and not (gated and fla_refuses_gated_backward())


def fla_refuses_gated_backward() -> bool:
    """Whether fla refuses gated backward passes on this stack (Hopper with Triton >= 3.4 and < 3.7.1, its issue
    640): the condition of fla's own guard, read where the guard reads it."""
    import fla.ops.common.chunk_o as guard
    return guard.IS_NVIDIA_HOPPER and guard.TRITON_ABOVE_3_4_0 and not guard.TRITON_ABOVE_3_7_1


@exact_dtypes
def fla_causal_rfa(q: Tensor, k: Tensor, v: Tensor, log_g: Optional[Tensor] = None,
                   initial_state: Optional[Tensor] = None, output_final_state: bool = False, eps: float = DEFAULT_EPS,
                   convex: bool = True) -> Tuple[Tensor, Optional[Tensor]]:
    """The contract of :func:`naive_causal_rfa` (the state in fp32) by fla's chunked kernel, for fp32, fp16 or bf16
    inputs. Padded steps must come with ``k = 0`` and ``log g = 0``, as the attention modules make them."""
    if q.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"fla's kernels take fp32, fp16 or bf16 inputs, got {q.dtype}")
    if not (fla_installed() and (q.device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1")):
        raise RuntimeError(f"fla's kernels need fla-core and Triton (pip install .[gpu]) and a CUDA device, got "
                           f"{q.device}{'' if fla_installed() else ' and no fla-core'} (TRITON_INTERPRET=1 runs "
                           "them slowly on a CPU)")
    from fla.ops.simple_gla import chunk_simple_gla
    (B, H, T, F), K = q.shape, v.size(-1)
    width = K + 1 + (K + 1) % 2  # [v | 1], and a column of zeros to make it even
    v1 = torch.cat([v.to(q.dtype), v.new_ones(B, H, T, 1, dtype=q.dtype),
                    v.new_zeros(B, H, T, width - K - 1, dtype=q.dtype)], dim=-1)
    g = None
    if log_g is not None:
        g = log_g.float().transpose(1, 2)  # [B, T, H]
        if convex:  # the write weight 1 - g, exact near g = 1, on the keys
            k = (k.float() * -torch.expm1(log_g.float()).unsqueeze(-1)).to(q.dtype)
    state = None if initial_state is None else torch.nn.functional.pad(initial_state.float(), (0, width - K - 1))
    o, final = chunk_simple_gla(q.transpose(1, 2), k.to(q.dtype).transpose(1, 2), v1.transpose(1, 2), g=g, scale=1.0,
                                initial_state=state, output_final_state=output_final_state)
    o = o.transpose(1, 2)  # [B, H, T, width]
    return guarded_ratio(o[..., :K], o[..., K], eps, v.dtype), (final[..., :K + 1] if output_final_state else None)
