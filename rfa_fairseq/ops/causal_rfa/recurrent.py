"""One step of causal RFA for incremental decoding: O(F K) per head, whatever the length.

The state is ``[S | z]`` packed as one tensor ``[B, H, F, K + 1]`` (``z`` is the last column),
the layout the chunked and naive forms take and return too: with a column of ones appended to
``v`` one outer product updates both, one matmul reads out numerator and denominator, and beam
search reorders one tensor.
"""
import math
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from ..denominator import DEFAULT_EPS, as_dtype, compute_dtype, guarded_ratio
from ..feature_maps import l2_normalize


def recurrent_causal_rfa_step(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    log_g: Optional[Tensor],
    state: Optional[Tensor],
    eps: float = DEFAULT_EPS,
    inplace: bool = False,
    convex: bool = True,
) -> Tuple[Tensor, Tensor]:
    """Advance the state by one token and read it out.

        [S | z]_t = g_t [S | z]_{t-1} + phi(k_t) [(1 - g_t) v_t | (1 - g_t)]   (g_t = 1 without a gate)
        out_t = phi(q_t) S_t / max(phi(q_t) . z_t, eps)

    (``convex=False``: the decay form, without the factors ``1 - g_t``.)

    Args:
        q, k: feature-mapped ``[B, H, F]``; v: ``[B, H, K]``; log_g: ``[B, H]`` or None.
        state: ``[B, H, F, K + 1]`` in fp32 (fp64 for fp64 inputs), or None at the first token.
        inplace: update ``state`` in place (only when no gradient is needed and the caller
            owns the tensor); the same tensor is then returned.
    Returns:
        ``out [B, H, K]`` (dtype of ``v``) and the new state.
    """
    acc = compute_dtype(q)
    qf, kf = q.to(acc), k.to(acc)
    v1 = F.pad(v.to(acc), (0, 1), value=1.0)  # [v | 1]
    decay = None
    if log_g is not None:
        lg = log_g.to(acc)
        decay = torch.exp(lg)[..., None, None]
        if convex:
            # (1 - g) as -expm1(log g) (exact for g near 1), on the value side: K + 1 numbers, not F.
            v1 = v1 * (-torch.expm1(lg)).unsqueeze(-1)
    if state is None:
        # contiguous whatever the strides of k: every later step and reorder reads it whole
        state = (kf.unsqueeze(-1) * v1.unsqueeze(-2)).contiguous()
    elif inplace and state.dtype == acc:
        if decay is not None:
            state.mul_(decay)
        state.addcmul_(kf.unsqueeze(-1), v1.unsqueeze(-2))  # no [B, H, F, K + 1] temporary
    else:
        state = state.to(acc) if decay is None else state.to(acc) * decay
        state = torch.addcmul(state, kf.unsqueeze(-1), v1.unsqueeze(-2))
    o = torch.matmul(qf.unsqueeze(-2), state).squeeze(-2)  # [B, H, K + 1]: numerator | denominator
    return guarded_ratio(o[..., :-1], o[..., -1], eps, v.dtype), state


def gaussian_step_weights(random_matrix: Tensor, sigma: Tensor, dtype: torch.dtype) -> Tuple[Tensor, Tensor]:
    """What :func:`gaussian_recurrent_step` projects with, made once per generation: the random
    matrix with sigma folded in (``(sigma * x) . w == x . (sigma * w)``), twice side by side, and
    the phases ``[0, pi/2]`` that turn the second half's sines into cosines
    (``cos(a) == sin(a + pi/2)``), so that one bmm and one sine make ``[sin | cos]``.

    Args:
        random_matrix: ``[H, D, K]``; sigma: ``[H, K]``; dtype: the step's compute dtype.
    Returns:
        ``projection [H, K, 2 D]`` and ``phase [2 D]``.
    """
    w = (as_dtype(random_matrix, dtype) * as_dtype(sigma, dtype).unsqueeze(1)).transpose(1, 2)  # [H, K, D]
    D = w.size(-1)
    phase = torch.cat([w.new_zeros(D), w.new_full((D,), math.pi / 2)])
    return torch.cat([w, w], dim=-1), phase


def gaussian_recurrent_step(
    qk: Tensor,
    v: Tensor,
    gate_logit: Optional[Tensor],
    state: Optional[Tensor],
    projection: Tensor,
    phase: Tensor,
    eps: float = DEFAULT_EPS,
    convex: bool = True,
) -> Tuple[Tensor, Tensor]:
    """One decoding step of causal RFA with the ``gaussian`` kernel (the default), from the raw
    heads: ``feature_map`` on queries and keys, then :func:`recurrent_causal_rfa_step` in place,
    which it equals (tests/ops/test_causal_rfa.py) in fewer ops. A decoding step's tensors are a
    few hundred numbers, so its time is the number of ops, not their size:

    - queries and keys are L2-normalised together and go through one bmm, then the phases and one
      sine (:func:`gaussian_step_weights`);
    - the features' scale ``D^-1/2`` goes into the values (and their column of ones) for the keys,
      and into the guard for the queries: ``c phi(q) S / max(c phi(q) z, c eps)`` is
      ``phi(q) S / max(phi(q) z, eps)``;
    - the gate comes as its logit ``l``: ``g = sigmoid(l)`` and ``1 - g = sigmoid(-l)``.

    Args:
        qk: ``[B, 2, H, K]``, the queries then the keys, before the feature map (a view of the
            fused projection's output).
        v: ``[B, H, K]``; gate_logit: ``[B, H]``, or None without a gate.
        state: ``[B, H, 2 D, K + 1]`` in fp32 (fp64 for fp64 inputs), updated in place; or None.
        projection, phase: from :func:`gaussian_step_weights` in the compute dtype.
    Returns:
        ``out [B, H, K]`` (dtype of ``v``) and the state.
    """
    acc = compute_dtype(qk)
    B, _, H, K = qk.shape
    F2 = projection.size(-1)
    D = F2 // 2
    qk = l2_normalize(as_dtype(qk, acc)).view(2 * B, H, K).transpose(0, 1)
    # bmm then add_, not baddbmm: baddbmm copies the broadcast phases into its output first
    phi = torch.bmm(qk, projection).add_(phase).sin_().view(H, B, 2, F2).transpose(0, 1)  # D^1/2 phi: [B, H, 2, F]
    q, k = phi.narrow(2, 0, 1), phi.select(2, 1)  # [B, H, 1, F], [B, H, F]
    v1 = F.pad(as_dtype(v, acc) * D**-0.5, (0, 1), value=D**-0.5)  # [v | 1] D^-1/2
    logit = None if gate_logit is None else as_dtype(gate_logit, acc).view(B, H, 1, 1)
    if logit is not None and convex:
        v1.mul_(torch.sigmoid(-logit).view(B, H, 1))  # (1 - g) on K + 1 numbers, not F (K + 1)
    if state is None:
        # contiguous whatever the strides of k: every later step and reorder reads it whole
        state = (k.unsqueeze(-1) * v1.unsqueeze(-2)).contiguous()
    else:
        if logit is not None:
            state.mul_(torch.sigmoid(logit))
        # in place, with no state-sized temporary: at large batches a fresh one would be mapped and
        # zeroed by the operating system at every step
        state.addcmul_(k.unsqueeze(-1), v1.unsqueeze(-2))
    o = torch.matmul(q, state).view(B, H, K + 1)  # D^1/2 [numerator | denominator]
    return guarded_ratio(o.narrow(-1, 0, K), o.select(-1, K), eps * D**0.5, v.dtype), state
