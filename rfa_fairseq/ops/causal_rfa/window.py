"""Causal RFA with a local exact window (``--rfa-local-window W``): a query weighs its last ``W`` keys
(itself included) by the exact kernel and the older ones by their random features:

    out_t = sum_j a_tj s_tj [v_j | 1]  ->  numerator / max(denominator, eps)
    a_tj = g_{j+1} ... g_t (1 - g_j)        the gate's weights, as in naive_causal_rfa
    s_tj = kernel(q_t, k_j) if t - j < W, else phi(q_t) . phi(k_j)

The forms take the contract of every causal form, ``(q, k, v, log_g, initial_state, output_final_state) ->
(out, final_state)``, with ``q``, ``k`` the queries and keys as the kernel compares them
(``feature_maps.scale_inputs``), not their features: ``kernel`` and ``random_matrix`` (keywords) make
``phi`` (``feature_maps.features``). A pad (``pad [B, 1, T]``, True at a pad; or ``log_g`` 0 and ``k``'s
write weight 0) neither writes nor decays, but takes its place in the window. The state is a
:class:`WindowState` of tensors, ``F (K + 1) + W (2 K + 1)`` numbers per head whatever the length; the
plain forms are the window of size 0, whose state is ``[S | z]`` alone.
"""
from typing import NamedTuple, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from ..denominator import DEFAULT_EPS, as_dtype, compute_dtype, exact_dtypes, guarded_ratio
from ..feature_maps import exact_kernel, features
from .chunk import DEFAULT_CHUNK_SIZE, _pad_time, chunk_causal_sums
from .recurrent import advance, gate_weights


class WindowState(NamedTuple):
    state: Tensor  # [B, H, F, K + 1]: [S | z] of the keys older than the window
    keys: Tensor  # [B, H, W, K]: the last W keys, a ring whose oldest is at `slot`; zeros before the first
    values: Tensor  # [B, H, W, K + 1]: their [v | 1] times the weight a_tj of the last query t; zeros before the first
    # [B] (int64): the ring's oldest key, which the next token's replaces; the same in every row (the rows of a
    # batch advance together), kept per row so that beam reorders and graphs take it as any state tensor
    slot: Tensor

    def in_time_order(self) -> "WindowState":
        """The same state with the oldest key in slot 0."""
        B, H, W, K = self.keys.shape
        order = (torch.arange(W, device=self.slot.device) + self.slot[:, None]) % W  # [B, W]
        take = lambda t: t.gather(2, order[:, None, :, None].expand(B, H, W, t.size(-1)))  # noqa: E731
        return WindowState(self.state, take(self.keys), take(self.values), torch.zeros_like(self.slot))


def empty_window_state(B: int, H: int, Fd: int, K: int, window: int, like: Tensor) -> WindowState:
    acc = compute_dtype(like)
    return WindowState(like.new_zeros(B, H, Fd, K + 1, dtype=acc), like.new_zeros(B, H, window, K, dtype=acc),
                       like.new_zeros(B, H, window, K + 1, dtype=acc), torch.zeros(B, dtype=torch.long, device=like.device))


def _extended(q, k, v, log_g, initial_state, convex, pad, W):
    """What both chunked forms read: the scaled inputs in fp32, the log-gates (0 at the pads: they do not decay)
    and their cumulative sums ``[B, H, T]`` (fp64), and the ``W + T`` keys (the state's ring in time order, then the
    block's) with their values (the ring's as they are, the block's ``write [v | 1]``: ``1 - g`` with a convex gate,
    else 1; 0 at the pads) and the log-gate each is counted from."""
    B, H, T, K = v.shape
    acc = compute_dtype(q)
    q, k = q.to(acc), k.to(acc)
    write = q.new_ones(B, H, T) if log_g is None or not convex else -torch.expm1(log_g.to(acc))
    if pad is not None:
        write, log_g = write.masked_fill(pad, 0.0), None if log_g is None else log_g.masked_fill(pad, 0.0)
    first = None if initial_state is None else initial_state.in_time_order()
    ring_k = q.new_zeros(B, H, W, K) if first is None else first.keys
    ring_v = q.new_zeros(B, H, W, K + 1) if first is None else first.values
    cum = torch.zeros(B, H, T, dtype=torch.float64, device=q.device) if log_g is None else log_g.double().cumsum(-1)
    vals = torch.cat([ring_v, write.unsqueeze(-1) * F.pad(v.to(acc), (0, 1), value=1.0)], 2)
    return q, k, log_g, cum, first, torch.cat([ring_k, k], 2), vals, F.pad(cum, (W, 0))


def _final(keys, vals, cum, cum_k, W, S):
    """The final :class:`WindowState` from the old state's part ``S`` and the ``W + T`` keys: the last ``W`` keys
    stay in the ring, with their values weighted for the last query (copies: no views of the block's tensors)."""
    log_a = cum[..., -1:] - cum_k[..., -W:] if cum.size(-1) else cum_k.new_zeros(1)  # no new key: weights kept
    vals = vals[:, :, -W:] * torch.exp(log_a).to(vals.dtype).unsqueeze(-1)
    return WindowState(S, keys[:, :, -W:].clone(), vals, torch.zeros(keys.size(0), dtype=torch.long, device=keys.device))


@exact_dtypes
def naive_window_causal_rfa(q: Tensor, k: Tensor, v: Tensor, log_g: Optional[Tensor] = None,
                            initial_state: Optional[WindowState] = None, output_final_state: bool = False, *,
                            kernel: str, random_matrix: Tensor, window: int, pad: Optional[Tensor] = None,
                            eps: float = DEFAULT_EPS, convex: bool = True) -> Tuple[Tensor, Optional[WindowState]]:
    """The definition above as one ``[T, W + T]`` matrix per head over the state's ring and the block (the
    reference). ``q``, ``k``, ``v``: ``[B, H, T, K]``; ``log_g``: ``[B, H, T]`` or None; ``pad [B, 1, T]`` or
    None. Returns ``out [B, H, T, K]`` in the dtype of ``v`` and the final state (or None)."""
    T, W = q.size(2), window
    q, k, log_g, cum, first, keys, vals, cum_k = _extended(q, k, v, log_g, initial_state, convex, pad, W)
    lag = torch.arange(T, device=q.device)[:, None] + W - torch.arange(W + T, device=q.device)[None, :]
    phi_q, phi_k = features(kernel, q, random_matrix), features(kernel, keys, random_matrix)
    scores = torch.where(lag < W, exact_kernel(kernel, q, keys), phi_q @ phi_k.transpose(-1, -2))
    log_a = (cum[..., :, None] - cum_k[..., None, :]).masked_fill(lag < 0, float("-inf"))
    o = (scores * torch.exp(log_a).to(q.dtype)) @ vals
    if first is not None:
        o = o + torch.exp(cum).to(q.dtype).unsqueeze(-1) * (phi_q @ first.state)
    out = guarded_ratio(o[..., :-1], o[..., -1], eps, v.dtype)
    if not output_final_state:
        return out, None
    a_last = torch.exp(cum_k.new_zeros(1) if T == 0 else cum[..., -1:] - cum_k).to(q.dtype)  # [B, H, W + T]
    S = phi_k[:, :, :T].transpose(-1, -2) @ (vals * a_last.unsqueeze(-1))[:, :, :T]  # keys leaving the window
    if first is not None:
        S = S + torch.exp(cum[..., -1:] if T else cum.new_zeros(1)).to(q.dtype)[..., None] * first.state
    return out, _final(keys, vals, cum, cum_k, W, S)


@exact_dtypes
def window_causal_rfa(q: Tensor, k: Tensor, v: Tensor, log_g: Optional[Tensor] = None,
                      initial_state: Optional[WindowState] = None, output_final_state: bool = False, *, kernel: str,
                      random_matrix: Tensor, window: int, pad: Optional[Tensor] = None, eps: float = DEFAULT_EPS,
                      convex: bool = True, chunk_size: int = DEFAULT_CHUNK_SIZE) -> Tuple[Tensor, Optional[WindowState]]:
    """:func:`naive_window_causal_rfa` in linear time (training, prompts, a stateful LM's blocks): every key by its
    features through :func:`chunk_causal_sums`, then, in blocks of ``W`` queries, each query's last ``W`` keys
    corrected from ``phi . phi`` to the exact kernel."""
    B, H, T, K = v.shape
    W = window
    if W < 1:
        raise ValueError(f"window must be positive, got {W} (a window of 0 keys is plain RFA: chunk_causal_rfa)")
    if initial_state is None and T <= W and not output_final_state:  # training on sentences: exact attention
        return naive_window_causal_rfa(q, k, v, log_g, kernel=kernel, random_matrix=random_matrix, window=W, pad=pad,
                                       eps=eps, convex=convex)
    q, k, log_g, cum, first, keys, vals, cum_k = _extended(q, k, v, log_g, initial_state, convex, pad, W)
    phi_q, phis = features(kernel, q, random_matrix), features(kernel, keys, random_matrix)
    phi_k = phis[:, :, W:] if pad is None else phis[:, :, W:].masked_fill(pad.unsqueeze(-1), 0.0)
    # every key by its features, from the state of all keys before the block
    full = None if first is None else first.state + phis[:, :, :W].transpose(-1, -2) @ first.values
    o, final = chunk_causal_sums(phi_q, phi_k, v, log_g, full, output_final_state, convex, chunk_size)
    # Queries in blocks of W; block n's window keys are among the W + T keys' blocks n and n + 1.
    P = (-T) % W
    N = (T + P) // W

    def blocks(t: Tensor, n: int) -> Tensor:  # [B, H, n, W, ...]
        return _pad_time(t, n * W - t.size(2)).unflatten(2, (n, W))

    def pairs(t: Tensor) -> Tensor:  # [B, H, N, 2 W, ...]: blocks n and n + 1
        b = blocks(t, N + 1)
        return torch.cat([b[:, :, :-1], b[:, :, 1:]], 3)

    r, p = torch.arange(W, device=q.device)[:, None], torch.arange(2 * W, device=q.device)[None, :]
    band = (p > r) & (p <= r + W)  # key p of the pair is within the last W of query r
    # the padded queries take the last cumulative log-gate: exponents <= 0 there too (no inf * 0 in the backward)
    cum_q = F.pad(cum, (0, P), mode="replicate") if P else cum
    log_a = (blocks(cum_q, N)[..., :, None] - pairs(cum_k)[..., None, :]).masked_fill(~band, float("-inf"))
    scores = exact_kernel(kernel, blocks(q, N), pairs(keys)) - blocks(phi_q, N) @ pairs(phis).transpose(-1, -2)
    o = o + ((scores * torch.exp(log_a).to(q.dtype)) @ pairs(vals)).flatten(2, 3)[:, :, :T]
    out = guarded_ratio(o[..., :K], o[..., K], eps, v.dtype)
    if not output_final_state:
        return out, None
    ring = _final(keys, vals, cum, cum_k, W, None)
    return out, ring._replace(state=final - phis[:, :, -W:].transpose(-1, -2) @ ring.values)


@exact_dtypes
def window_causal_rfa_step(q: Tensor, k: Tensor, v: Tensor, log_g: Optional[Tensor], state: WindowState, *,
                           kernel: str, random_matrix: Tensor, pad: Optional[Tensor] = None, eps: float = DEFAULT_EPS,
                           convex: bool = True, inplace: bool = False) -> Tuple[Tensor, WindowState]:
    """One token (``q``, ``k``, ``v [B, H, K]``, ``log_g [B, H]`` or None, ``pad [B, 1]`` or None) from ``state``:
    every weight decays by ``g_t``, the oldest key leaves the ring into ``[S | z]`` by its features
    (the update of :func:`recurrent_causal_rfa_step`), the new key takes its slot. ``inplace``: advance the
    state's tensors in place (no autograd; the caller owns them). Returns ``out [B, H, K]`` and the new state.
    No value is read back to the host: a CUDA graph or a compiled step replays it."""
    acc = compute_dtype(q)
    q, k = as_dtype(q, acc), as_dtype(k, acc)
    decay, v1 = gate_weights(v, log_g, acc, convex)
    if pad is not None:
        v1 = v1.masked_fill(pad.unsqueeze(-1), 0.0)
    S, keys, values, slot = state if inplace else (t.clone() for t in state)
    W = keys.size(2)
    at = slot[:1]  # every row's (index_select and index_copy_ on it: a quarter of gather's and scatter's time)
    if decay is not None:
        values.mul_(decay)
    phi = features(kernel, torch.cat([q.unsqueeze(2), keys.index_select(2, at)], 2), random_matrix)  # query, leaving key
    S = advance(S, decay, phi[:, :, 1], values.index_select(2, at).squeeze(2), inplace=True)
    keys.index_copy_(2, at, k.unsqueeze(2))
    values.index_copy_(2, at, v1.unsqueeze(2))
    slot.add_(1).remainder_(W)
    o = (phi[:, :, :1] @ S + exact_kernel(kernel, q.unsqueeze(2), keys) @ values).squeeze(2)
    K = v.size(-1)
    return guarded_ratio(o[..., :K], o[..., K], eps, v.dtype), WindowState(S, keys, values, slot)
