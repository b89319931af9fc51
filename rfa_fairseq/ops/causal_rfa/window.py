"""Causal RFA with a local exact window (``--rfa-local-window W``): a query weighs its last ``W`` keys
(itself included) by the exact kernel and the older ones by their random features:

    out_t = sum_j a_tj s_tj [v_j | 1]  ->  numerator / max(denominator, eps)
    a_tj = g_{j+1} ... g_t (1 - g_j)        the gate's weights, as in naive_causal_rfa
    s_tj = kernel(x_t, y_j) if t - j < W, else phi(x_t) . phi(y_j)

``x``, ``y``: queries and keys as the kernel compares them (``feature_maps.scale_inputs``); ``phi``: their
random features (``feature_maps.features`` with ``random_matrix``). The state of a sequence is a
:class:`WindowState`, whose size does not depend on the length: ``F (K + 1) + W (2 K + 1)`` numbers per head.
"""
from typing import NamedTuple, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from ..denominator import DEFAULT_EPS, as_dtype, compute_dtype, exact_dtypes, guarded_ratio
from ..feature_maps import exact_kernel, features
from .chunk import DEFAULT_CHUNK_SIZE, _pad_time, chunk_causal_sums


class WindowState(NamedTuple):
    state: Tensor  # [B, H, F, K + 1]: [S | z] of the keys older than the window
    keys: Tensor  # [B, H, W, K]: the last W keys (scaled), a ring from slot `start` (the oldest); zeros before the first
    values: Tensor  # [B, H, W, K + 1]: their [v | 1] times the weight a_tj of the last query t; zeros before the first
    start: int = 0  # the slot of the oldest key: the next step's key replaces it

    def in_time_order(self) -> "WindowState":
        """The same state with the oldest key in slot 0."""
        if self.start == 0:
            return self
        return WindowState(self.state, self.keys.roll(-self.start, 2), self.values.roll(-self.start, 2))


def empty_window_state(B: int, H: int, Fd: int, K: int, window: int, like: Tensor) -> WindowState:
    acc = compute_dtype(like)
    return WindowState(like.new_zeros(B, H, Fd, K + 1, dtype=acc), like.new_zeros(B, H, window, K, dtype=acc),
                       like.new_zeros(B, H, window, K + 1, dtype=acc))


def _write(log_g: Optional[Tensor], like: Tensor, convex: bool, pad: Optional[Tensor]) -> Tuple[Tensor, Optional[Tensor]]:
    """The write weight of every position ``[B, H, T]`` (``1 - g`` with a convex gate, else 1; 0 at the pads)
    and the log-gates (0 at the pads: they do not decay)."""
    write = like.new_ones(like.shape[:3]) if log_g is None or not convex else -torch.expm1(log_g.to(like.dtype))
    if pad is None:
        return write, log_g
    return write.masked_fill(pad, 0.0), None if log_g is None else log_g.masked_fill(pad, 0.0)


@exact_dtypes
def naive_window_causal_rfa(x: Tensor, y: Tensor, v: Tensor, log_g: Optional[Tensor], kernel: str,
                            random_matrix: Tensor, window: int, pad: Optional[Tensor] = None, eps: float = DEFAULT_EPS,
                            convex: bool = True) -> Tensor:
    """The definition above as one ``[T, T]`` matrix per head (the reference; no state). ``x``, ``y``, ``v``:
    ``[B, H, T, K]``; ``log_g``: ``[B, H, T]`` or None; ``pad [B, 1, T]`` (True: a pad) or None. Returns
    ``out [B, H, T, K]`` in the dtype of ``v``. The chunked form takes it for a sequence within one window."""
    acc = compute_dtype(x)
    x, y, v1 = x.to(acc), y.to(acc), F.pad(v.to(acc), (0, 1), value=1.0)
    write, log_g = _write(log_g, x, convex, pad)
    T = x.size(2)
    lag = torch.arange(T, device=x.device)[:, None] - torch.arange(T, device=x.device)[None, :]
    scores = exact_kernel(kernel, x, y)
    if T > window:
        scores = torch.where(lag < window, scores,
                             features(kernel, x, random_matrix) @ features(kernel, y, random_matrix).transpose(-1, -2))
    cum = torch.zeros_like(v1[..., 0], dtype=torch.float64) if log_g is None else log_g.double().cumsum(-1)
    log_a = (cum[..., :, None] - cum[..., None, :]).masked_fill(lag < 0, float("-inf"))
    o = (scores * torch.exp(log_a).to(acc) * write[..., None, :]) @ v1
    return guarded_ratio(o[..., :-1], o[..., -1], eps, v.dtype)


@exact_dtypes
def window_causal_rfa(x: Tensor, y: Tensor, v: Tensor, log_g: Optional[Tensor], kernel: str, random_matrix: Tensor,
                      window: int, initial_state: Optional[WindowState] = None, output_final_state: bool = False,
                      pad: Optional[Tensor] = None, eps: float = DEFAULT_EPS, convex: bool = True,
                      chunk_size: int = DEFAULT_CHUNK_SIZE) -> Tuple[Tensor, Optional[WindowState]]:
    """:func:`naive_window_causal_rfa` from ``initial_state`` (training, prompts, a stateful LM's blocks):
    every key by its features through :func:`chunk_causal_sums`, then, in blocks of ``W`` queries, each
    query's last ``W`` keys corrected from ``phi . phi`` to the exact kernel. ``pad [B, 1, T]`` (True: a pad)
    neither writes nor decays. Returns ``out [B, H, T, K]`` and the final state (or None)."""
    B, H, T, K = v.shape
    W, acc = window, compute_dtype(x)
    if initial_state is None and T <= W and not output_final_state:  # training on sentences: exact attention
        return naive_window_causal_rfa(x, y, v, log_g, kernel, random_matrix, W, pad, eps, convex), None
    x, y = x.to(acc), y.to(acc)
    write, log_g = _write(log_g, x, convex, pad)
    phi_x, phi_y = features(kernel, x, random_matrix), features(kernel, y, random_matrix)
    v1 = F.pad(v.to(acc), (0, 1), value=1.0)
    # The buffer's keys, then the block's: each with its factor (the buffer's weighted values, the block's
    # write weight times [v | 1]) and the cumulative log-gate it is counted from (0 for the buffer).
    first = empty_window_state(B, H, phi_x.size(-1), K, W, x) if initial_state is None else initial_state.in_time_order()
    phi_b = features(kernel, first.keys, random_matrix)
    cum = torch.zeros(B, H, T, dtype=torch.float64, device=x.device) if log_g is None else log_g.double().cumsum(-1)
    keys, phis = torch.cat([first.keys, y], 2), torch.cat([phi_b, phi_y], 2)
    vals, cum_k = torch.cat([first.values, write.unsqueeze(-1) * v1], 2), F.pad(cum, (W, 0))
    # every key by its features, from the state of all keys before the block
    full = None if initial_state is None else first.state + phi_b.transpose(-1, -2) @ first.values
    o, final = chunk_causal_sums(phi_x, phi_y if pad is None else phi_y.masked_fill(pad.unsqueeze(-1), 0.0), v,
                                 log_g, full, output_final_state, convex, chunk_size)
    # Queries in blocks of W; block n's window keys are among the W + T keys' blocks n and n + 1.
    P = (-T) % W
    N = (T + P) // W

    def blocks(t: Tensor, n: int) -> Tensor:  # [B, H, n, W, ...]
        return _pad_time(t, n * W - t.size(2)).unflatten(2, (n, W))

    def pairs(t: Tensor) -> Tensor:  # [B, H, N, 2 W, ...]: blocks n and n + 1
        b = blocks(t, N + 1)
        return torch.cat([b[:, :, :-1], b[:, :, 1:]], 3)

    r, p = torch.arange(W, device=x.device)[:, None], torch.arange(2 * W, device=x.device)[None, :]
    band = (p > r) & (p <= r + W)  # key p of the pair is within the last W of query r
    # the padded queries take the last cumulative log-gate: exponents <= 0 there too (no inf * 0 in the backward)
    cum_q = F.pad(cum, (0, P), mode="replicate") if P else cum
    log_a = (blocks(cum_q, N)[..., :, None] - pairs(cum_k)[..., None, :]).masked_fill(~band, float("-inf"))
    scores = exact_kernel(kernel, blocks(x, N), pairs(keys)) - blocks(phi_x, N) @ pairs(phis).transpose(-1, -2)
    o = o + ((scores * torch.exp(log_a).to(acc)) @ pairs(vals)).flatten(2, 3)[:, :, :T]
    out = guarded_ratio(o[..., :K], o[..., K], eps, v.dtype)
    if not output_final_state:
        return out, None
    last = torch.exp(cum[..., -1:] - cum_k[..., -W:]).to(acc) if T else 1.0
    values = vals[:, :, -W:] * last.unsqueeze(-1) if T else vals[:, :, -W:]
    # keys: a copy, not a view that would keep the block's keys alive beside the decoding state
    return out, WindowState(final - phis[:, :, -W:].transpose(-1, -2) @ values, keys[:, :, -W:].clone(), values)


@exact_dtypes
def window_causal_rfa_step(x: Tensor, y: Tensor, v: Tensor, log_g: Optional[Tensor], kernel: str,
                           random_matrix: Tensor, state: WindowState, eps: float = DEFAULT_EPS, convex: bool = True,
                           inplace: bool = False) -> Tuple[Tensor, WindowState]:
    """One token (``x``, ``y``, ``v [B, H, K]``, ``log_g [B, H]`` or None) from ``state``: every weight decays
    by ``g_t``, the oldest key of the window goes into ``[S | z]`` by its features, the new key takes its
    slot. ``inplace``: advance the state's tensors in place (no autograd; the caller owns them). Returns
    ``out [B, H, K]`` and the new state."""
    acc = compute_dtype(x)
    x, y = as_dtype(x, acc), as_dtype(y, acc)
    v1 = F.pad(as_dtype(v, acc), (0, 1), value=1.0)
    old, keys, values, slot = state
    if not inplace:
        old, keys, values = old.clone(), keys.clone(), values.clone()
    phi = features(kernel, torch.stack([x, keys[:, :, slot]], 2), random_matrix)  # the query's, the leaving key's
    if log_g is not None:
        lg = as_dtype(log_g, acc)
        g = torch.exp(lg)[..., None, None]
        values.mul_(g)
        old.mul_(g)
        if convex:
            v1 = v1 * -torch.expm1(lg).unsqueeze(-1)
    old.addcmul_(phi[:, :, 1].unsqueeze(-1), values[:, :, slot].unsqueeze(-2))
    keys[:, :, slot] = y
    values[:, :, slot] = v1
    o = (phi[:, :, :1] @ old + exact_kernel(kernel, x.unsqueeze(2), keys) @ values).squeeze(2)
    K = v.size(-1)
    return guarded_ratio(o[..., :K], o[..., K], eps, v.dtype), WindowState(old, keys, values, (slot + 1) % keys.size(2))
