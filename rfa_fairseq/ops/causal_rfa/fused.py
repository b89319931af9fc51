"""Causal RFA's decoding step in one pass over the state (float32 on the CPU; ``fused_step.cpp``). torch's operators
read the ``[B, H, F, K + 1]`` state four times a step (the beam's reorder, the decay, the update, the read-out) and
write it three times; at large batches that traffic is most of the step. The op here reads each parent's state once
and writes the advanced state once, into a second buffer (the two alternate). It is compiled by torch's extension API
on first use (about 45 s, cached in ``~/.cache/torch_extensions``); where it cannot be built, one warning, and
decoding keeps torch's operators (:func:`recurrent_causal_rfa_step`, its reference)."""
import hashlib
import logging
import platform
import time
import warnings
from pathlib import Path
from typing import Optional, Tuple

import torch
from torch import Tensor

from ..denominator import as_dtype, guarded_ratio
from .recurrent import gate_weights

logger = logging.getLogger(__name__)
_op = None  # the compiled module; False where it could not be built


def load():
    """The compiled op, or None (built on the first call; compiled for this CPU, so named by its flags)."""
    global _op
    if _op is None:
        try:
            from torch.utils.cpp_extension import _get_build_directory, load as build
            cpu = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else platform.processor()
            flags = next((line for line in cpu.splitlines() if line.startswith("flags")), cpu)
            source = Path(__file__).with_name("fused_step.cpp")  # a checkout elsewhere builds its own
            name = "rfa_fused_step_" + hashlib.sha256((flags + str(source)).encode()).hexdigest()[:8]
            logger.info("causal RFA's fused decoding step: %s (compiled on its first load on a machine)", name)
            lock = Path(_get_build_directory(name, verbose=False)) / "lock"
            if lock.exists() and time.time() - lock.stat().st_mtime > 600:  # left by a build that was killed
                logger.warning("removing %s, left by a build of the fused step that did not finish", lock)
                lock.unlink(missing_ok=True)
            _op = build(name, [str(source)], extra_cflags=["-O3", "-march=native"])
        except Exception as e:  # no compiler, no ninja, no headers
            warnings.warn(f"causal RFA's fused decoding step could not be compiled ({type(e).__name__}: {e}); "
                          "decoding steps use torch's operators")
            _op = False
    return _op or None


def deferrable(state: Optional[Tensor]) -> bool:
    """Whether beam search's reorder of ``state`` can wait for the next step: a float32 CPU state, no autograd."""
    return (state is not None and state.dtype == torch.float32 and state.device.type == "cpu"
            and not torch.is_grad_enabled() and not state.requires_grad)


def usable(state: Optional[Tensor]) -> bool:
    """Whether a step from ``state`` takes the fused op: deferrable, not being traced, the op built."""
    return deferrable(state) and not torch.compiler.is_compiling() and load() is not None


def fused_causal_rfa_step(q: Tensor, k: Tensor, v: Tensor, log_g: Optional[Tensor], state: Tensor,
                          parents: Optional[Tensor], spare: Tensor, eps: float, convex: bool = True
                          ) -> Tuple[Tensor, Tensor]:
    """:func:`recurrent_causal_rfa_step` from ``state.index_select(0, parents)`` (``parents [B]``, None: the rows as
    they are), the advanced state written into and returned as ``spare`` (``[B, H, F, K + 1]``, not ``state``'s)."""
    B, H, F = q.shape
    decay, v1 = gate_weights(v, log_g, torch.float32, convex)
    decay = torch.ones(B, H) if decay is None else decay.reshape(B, H)
    parents = torch.arange(B) if parents is None else parents
    o = load().step(state, spare, parents, as_dtype(q, torch.float32).contiguous(),
                    as_dtype(k, torch.float32).contiguous(), v1.contiguous(), decay.contiguous())
    return guarded_ratio(o[..., :-1], o[..., -1], eps, v.dtype), spare  # o: [B, H, K + 1]
