"""Compiled CPU kernels for decoding (``decode_step_cpu.cpp``): the fused causal step, the random
feature map of a few rows, and cross attention's readout.

A decoding step of causal RFA in PyTorch ops makes several passes over the layer's state: the
beam gather, the gate's decay, the update and the readout, each over a multi-MiB tensor that the
other layers' weights have pushed out of the caches. The kernel does them in one pass per
(row, head). It is built on first use with torch's C++ extension tools (a C++ compiler and
ninja; about half a minute, then cached in ``TORCH_EXTENSIONS_DIR``, by default
``~/.cache/torch_extensions``) and used by :class:`~rfa_fairseq.modules.CausalRFAttention` when
``--rfa-decode-kernel`` allows it. The PyTorch ops in ``ops/causal_rfa`` stay the reference:
``tests/kernels`` checks the two agree.

The feature map of a decoding step (normalise, project, sin and cos, scale: about ten small
PyTorch ops, each starting cold) is one call too, used by
:class:`~rfa_fairseq.modules.RandomFeatureMap` without autograd, and so is cross attention's
readout of the source state (:class:`~rfa_fairseq.modules.CrossRFAttention` while decoding). The
PyTorch ops in ``ops/feature_maps.py`` and ``ops/cross_rfa`` are their references.

    fused_summary_step(src, dst, order, q, k, v, log_g, eps)          # the summary [S | z]
    fused_keys_step(src, dst, order, length, q, k, v, log_g, eps)     # the attention form
    feature_map(kernel, x, matrix, eps)                               # ops.prepared_feature_map
    cross_readout(q, Sz or (kT, v1), eps)                             # ops.cross_rfa_apply(_keys)

The loops are compiled for x86-64-v3 (AVX2 + FMA) and for the baseline; ``simd()`` says which
one runs on this CPU.
"""
import logging
import os
import shutil
import sys
import threading
import time
from typing import Optional

import torch
from torch import Tensor

logger = logging.getLogger(__name__)

DECODE_KERNELS = ("auto", "cpp", "torch")
_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "decode_step_cpu.cpp")
_NAME = "rfa_fairseq_decode_cpu"
_lock = threading.Lock()
_loaded = {"module": None, "error": None}


def load():
    """The compiled module, built on the first call. Raises RuntimeError (with the build's
    error) when it cannot be built; a failed build is not retried in the same process."""
    with _lock:
        if _loaded["module"] is not None:
            return _loaded["module"]
        if _loaded["error"] is not None:
            raise RuntimeError(_loaded["error"])
        try:
            from torch.utils.cpp_extension import load as load_extension

            if shutil.which("ninja") is None:
                # pip's ninja installs next to this interpreter, which need not be on PATH
                os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
            from torch.utils.cpp_extension import _get_build_directory

            clear_stale_lock(_get_build_directory(_NAME, verbose=False))
            logger.info("loading the RFA CPU decoding kernels (the first time: building them, about 30 s)")
            # OpenMP for at::parallel_for over (row, head) pairs: the process's libgomp, torch's own
            openmp = ["-fopenmp"] if sys.platform.startswith("linux") else []
            _loaded["module"] = load_extension(name=_NAME, sources=[_SOURCE],
                                               extra_cflags=["-O3"] + openmp, extra_ldflags=openmp, verbose=False)
        except Exception as e:  # a missing compiler, ninja or headers
            _loaded["error"] = (f"the RFA CPU decoding kernels could not be built ({type(e).__name__}: {e}); "
                                f"use --rfa-decode-kernel torch")
            raise RuntimeError(_loaded["error"]) from e
        return _loaded["module"]


def clear_stale_lock(build_dir: str, max_age: float = 600.0) -> bool:
    """Remove the lock file of an interrupted build (older than ``max_age`` seconds; a build takes
    about 30 s). torch's extension loader waits for that file to go away, without a time limit, so
    a build killed by Ctrl-C would otherwise hang every later process that loads the kernels.
    Returns whether a lock was removed."""
    lock = os.path.join(build_dir, "lock")
    try:
        age = time.time() - os.path.getmtime(lock)
        if age <= max_age:
            return False
        os.remove(lock)
    except OSError:  # no lock, or another process removed it first
        return False
    logger.warning("removed %s, left by a build of the RFA kernels that stopped %.0f s ago", lock, age)
    return True


def available() -> bool:
    """Whether the kernel is built or can be built now (building it if needed)."""
    try:
        load()
        return True
    except RuntimeError:
        return False


def check_choice(choice: str) -> str:
    if choice not in DECODE_KERNELS:
        raise ValueError(f"--rfa-decode-kernel must be one of {', '.join(DECODE_KERNELS)}, got {choice!r}")
    return choice


def usable(choice: str, q: Tensor, v: Tensor) -> bool:
    """Whether a decoding step on ``q`` (features) and ``v`` runs the kernel under ``choice``:
    fp32 CPU tensors with autograd off (the kernel updates the state in place, as the PyTorch ops
    do only then), and for ``auto`` a kernel that builds (if it does not: a warning, once, then
    the PyTorch ops). ``cpp`` raises where the kernel cannot serve."""
    if choice == "torch":
        return False
    fits = (q.device.type == "cpu" and q.dtype == torch.float32 and v.dtype == torch.float32
            and not torch.is_grad_enabled())
    if choice == "cpp":
        if not fits:
            raise ValueError(f"--rfa-decode-kernel cpp runs fp32 CPU decoding with autograd off; got "
                             f"{q.dtype} features and {v.dtype} values on {q.device}"
                             f"{' with autograd on' if torch.is_grad_enabled() else ''} (use auto or torch)")
        load()
        return True
    if not fits:
        return False
    if _loaded["module"] is None and _loaded["error"] is None and not available():
        logger.warning("%s; decoding with the PyTorch ops instead", _loaded["error"])
    return _loaded["module"] is not None


def feature_map(kernel: str, x: Tensor, matrix: Tensor, eps: float) -> Tensor:
    """:func:`~rfa_fairseq.ops.prepared_feature_map` of ``l2_normalize(x, eps)`` in one pass:
    ``x [B, H, T, K]`` fp32 (any strides), ``matrix`` the ``[H, K, D]`` of
    :func:`~rfa_fairseq.ops.projection_matrix`. The same features up to fp32 rounding (the sin
    and cos are the kernel's own, within about 1e-7)."""
    if kernel not in ("gaussian", "arccos"):
        raise ValueError(f"unknown kernel {kernel!r}; expected gaussian or arccos")
    for name, t in (("x", x), ("matrix", matrix)):
        if t.dtype != torch.float32 or t.device.type != "cpu":
            raise ValueError(f"{name} must be a float32 CPU tensor, got {t.dtype} on {t.device}")
    if x.dim() != 4 or matrix.dim() != 3 or x.shape[1] != matrix.shape[0] or x.shape[3] != matrix.shape[1]:
        raise ValueError(f"x {list(x.shape)} [B, H, T, K] does not match the matrix {list(matrix.shape)} [H, K, D]")
    if x.stride(-1) != 1:
        x = x.contiguous()
    return load().feature_map(x, matrix.contiguous(), kernel == "gaussian", float(eps))


def cross_readout(q: Tensor, state, eps: float) -> Tensor:
    """Cross attention's readout in one pass: :func:`~rfa_fairseq.ops.cross_rfa_apply` for a
    summary ``Sz [Bs, H, F, K + 1]``, :func:`~rfa_fairseq.ops.cross_rfa_apply_keys` for the
    attention form ``(kT [Bs, H, F, S], v1 [Bs, H, S, K + 1])``. ``q [B, H, T, F]`` fp32 (any
    strides), ``B`` a multiple of ``Bs`` (a source's beams in consecutive rows). Returns
    ``[B, H, T, K]`` fp32."""
    keys = not isinstance(state, Tensor)
    tensors = {"q": q, **({"kT": state[0], "v1": state[1]} if keys else {"Sz": state})}
    for name, t in tensors.items():
        if t.dtype != torch.float32 or t.device.type != "cpu" or t.dim() != 4:
            raise ValueError(f"{name} must be a 4-d float32 CPU tensor, got {t.dtype} {list(t.shape)} on {t.device}")
    values = state[1] if keys else state
    B, H, T, Fd = q.shape
    Bs, K1 = values.shape[0], values.shape[3]
    if keys:
        S = state[0].shape[3]
        expected = {"kT": (Bs, H, Fd, S), "v1": (Bs, H, S, K1)}
    else:
        expected = {"Sz": (Bs, H, Fd, K1)}
    for name, shape in expected.items():
        if tuple(tensors[name].shape) != shape:
            raise ValueError(f"{name} has shape {list(tensors[name].shape)}; expected {list(shape)} for queries "
                             f"{list(q.shape)}")
    if Bs == 0 or B % Bs != 0:
        raise ValueError(f"{B} query rows cannot share {Bs} source states")
    if q.stride(-1) != 1:
        q = q.contiguous()
    kT, v1, Sz = (state[0].contiguous(), state[1].contiguous(), _EMPTY_F) if keys else (_EMPTY_F, _EMPTY_F,
                                                                                       state.contiguous())
    return load().cross_readout(q, Sz, kT, v1, B // Bs, float(eps))


def simd() -> str:
    """Which version of the kernels' loops runs here: ``"x86-64-v3"`` (AVX2 + FMA) or
    ``"baseline"``."""
    return load().simd()


def _prepare(src: Optional[Tensor], dst: Tensor, order: Optional[Tensor], q: Tensor, k: Tensor, v: Tensor,
             log_g: Optional[Tensor]):
    """Check shapes, dtypes and devices; the kernel reads q, k, v through their strides as long
    as the last dimension is dense (a step's features are a view of the stacked feature map)."""
    B, H, Fd, K1 = dst.shape
    expected = {"q": (q, (B, H, Fd)), "k": (k, (B, H, Fd)), "v": (v, (B, H, K1 - 1))}
    if log_g is not None:
        expected["log_g"] = (log_g, (B, H))
    if src is not None:
        expected["src"] = (src, (B, H, Fd, K1))
    for name, (t, shape) in expected.items():
        if tuple(t.shape) != shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}; expected {list(shape)} for a state "
                             f"{list(dst.shape)}")
        if t.dtype != torch.float32 or t.device.type != "cpu":
            raise ValueError(f"{name} must be a float32 CPU tensor, got {t.dtype} on {t.device}")
    for name, t in (("dst", dst), ("src", src)):
        if t is not None and (not t.is_contiguous() or t.dtype != torch.float32 or t.device.type != "cpu"):
            raise ValueError(f"{name} must be a contiguous float32 CPU tensor")
    if order is None:
        order = _EMPTY
    else:
        if order.dtype != torch.int64 or tuple(order.shape) != (B,):
            raise ValueError(f"order must be int64 of shape [{B}], got {order.dtype} {tuple(order.shape)}")
        if src is None or src.data_ptr() == dst.data_ptr():
            raise ValueError("a reorder needs a source buffer other than the destination")
        order = order.contiguous()
    log_g = _EMPTY_F if log_g is None else log_g.contiguous()
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    return (dst if src is None else src), order, q, k, v, log_g


_EMPTY = torch.empty(0, dtype=torch.int64)
_EMPTY_F = torch.empty(0)


def fused_summary_step(src: Optional[Tensor], dst: Tensor, order: Optional[Tensor], q: Tensor, k: Tensor,
                       v: Tensor, log_g: Optional[Tensor], eps: float) -> Tensor:
    """``dst = g * src[order] + phi(k) [(1 - g) v | 1 - g]^T`` (``g = exp(log_g)``, 1 without a
    gate) and its readout ``[B, H, K]``: :func:`recurrent_causal_rfa_step_packed` on the gathered
    state, in one pass. ``src`` None or ``dst`` itself (no order): in place."""
    src, order, q, k, v, log_g = _prepare(src, dst, order, q, k, v, log_g)
    return load().summary_step(src, dst, order, q, k, v, log_g, float(eps))


def fused_keys_step(src: Optional[Tensor], dst: Tensor, order: Optional[Tensor], length: int, q: Tensor,
                    k: Tensor, v: Tensor, log_g: Optional[Tensor], eps: float) -> Tensor:
    """The ``length`` keys of ``src`` in ``order`` into ``dst``, then :func:`causal_keys_step`
    (token ``length``) in place on ``dst``, in one pass. Returns the readout ``[B, H, K]``."""
    src, order, q, k, v, log_g = _prepare(src, dst, order, q, k, v, log_g)
    return load().keys_step(src, dst, order, int(length), q, k, v, log_g, float(eps))
