"""LARA: linear randomised attention (Zheng, Wang and Kong, ICML 2022), pure torch, with ``xi(x, w)`` =
``exp(w . x - |x|^2 / 2)``: ``exp(q . k) = E_{w ~ N(0, I)}[xi(q, w) xi(k, w)]``, and softmax attention of query ``n`` is
the expectation of ``f_n(w) = sum_m xi(k_m, w) v_m / sum_m xi(k_m, w)`` under
``p_n(w) = sum_m softmax_m(q_n . k_m) N(w; q_n + k_m, I)`` (Prop. 1). Sampling ``w ~ p_n`` per query
(:func:`randomized_attention`) is unbiased but quadratic; RFA and Performer draw ``w ~ N(0, I)`` and self-normalise
(cheap, biased). LARA (Algorithm 3, default choices) shares ``C`` proposals between all queries, weighed per query:

1. landmarks ``q~_c``, ``k~_c``: the means of the queries and keys over ``C`` contiguous segments of the non-padding
   positions; proposals ``q_c(w) = N(w; mu_c, I)``, ``mu_c = q~_c + k~_c`` (Eq. 34), one sample each,
   ``w_c = mu_c + eps_c`` (``eps``: the caller's standard normal draw);
2. ``alpha_nc(w) = q_c(w) / sum_c' q_c'(w) + lambda (r_nc - 1 / C)``, ``r_nc = softmax_c(q_n . q~_c)`` (Eq. 9), summing
   to 1, clamped at :data:`ALPHA_FLOOR` (> 0; as the authors' code, both) so that the output is a convex combination
   of the ``f_n(w_c)``, always finite;
3. ``out_n = sum_c a_nc f_n(w_c) / sum_c a_nc``, ``a_nc = alpha_nc(w_c) p_n(w_c) / q_c(w_c)``, where the ``N(w; 0, I)``
   factor and ``Z_n`` of ``p_n / q_c = xi(q_n, w) sum_m xi(k_m, w) / (Z_n xi(mu_c, w))`` cancel: O(T C K) per head,
   in log space so that large logits cannot overflow."""
import math
from typing import Optional, Tuple

import torch
from torch import Tensor

from .denominator import compute_dtype

ALPHA_FLOOR = 1e-8


def segment_landmarks(x: Tensor, key_padding_mask: Optional[Tensor], num_landmarks: int) -> Tuple[Tensor, Tensor]:
    """Means of ``x [B, H, T, K]`` over ``C = num_landmarks`` contiguous segments of each row's non-pad positions:
    ``[B, H, C, K]``, and ``present [B, C]``. Non-pad ``r`` of ``L`` is in segment ``floor(r C / L)`` wherever the
    padding is (fairseq pads on the left); ``L < C`` leaves ``C - L`` empty segments (``present`` False, mean 0)."""
    B, _, T, _ = x.shape
    valid = (torch.ones(B, T, dtype=torch.bool, device=x.device) if key_padding_mask is None
             else ~key_padding_mask.to(torch.bool))
    rank = valid.long().cumsum(1) - 1
    length = valid.long().sum(1, keepdim=True).clamp_min(1)
    segment = rank * num_landmarks // length  # [B, T], integer arithmetic: the naive loop's rule exactly
    one_hot = (segment.unsqueeze(-1) == torch.arange(num_landmarks, device=x.device)) & valid.unsqueeze(-1)
    counts = one_hot.sum(1)  # [B, C]
    assign = one_hot.to(x.dtype) / counts.clamp_min(1).unsqueeze(1).to(x.dtype)  # [B, T, C]
    return torch.einsum("btc,bhtk->bhck", assign, x), counts > 0


def _mask_keys(logits: Tensor, key_padding_mask: Optional[Tensor]) -> Tensor:
    """``-inf`` in ``logits [B, H, *, T]`` at the padded keys of ``key_padding_mask [B, T]``."""
    if key_padding_mask is None:
        return logits
    return logits.masked_fill(key_padding_mask.to(torch.bool)[:, None, None, :], float("-inf"))


def _log_xi(x: Tensor, w: Tensor) -> Tensor:
    """``log xi(x_t, w_c) = w_c . x_t - |x_t|^2 / 2``: x ``[B, H, T, K]``, w ``[B, H, C, K]`` -> ``[B, H, C, T]``."""
    return w @ x.transpose(-1, -2) - 0.5 * x.pow(2).sum(-1).unsqueeze(-2)


def lara(q: Tensor, k: Tensor, v: Tensor, noise: Tensor, key_padding_mask: Optional[Tensor] = None,
         alpha_coeff: float = 1.0) -> Tensor:
    """LARA's estimate of ``softmax(q k^T) v`` with ``C = noise.shape[-2]`` landmarks and samples, ``[B, H, T, K]`` in
    fp32 (fp64 for fp64). ``q, k, v [B, H, T, K]``, q, k scaled (raw heads times ``K^-1/4``); ``noise``: N(0, I)
    ``[(B,) H, C, K]``, ``w_c = mu_c + noise_c``; ``key_padding_mask [B, T]``: True at pads (no key or landmark; each
    row needs a real position); ``alpha_coeff``: ``lambda`` of the query-specific weights (0: balance heuristic)."""
    acc = compute_dtype(q)
    q, k, v, noise = q.to(acc), k.to(acc), v.to(acc), noise.to(acc)
    C = noise.shape[-2]
    q_land, present = segment_landmarks(q, key_padding_mask, C)
    absent = ~present[:, None, :]  # [B, 1, C]
    mu = q_land + segment_landmarks(k, key_padding_mask, C)[0]  # q~_c + k~_c
    w = mu + noise  # [B, H, C, K]: one sample per proposal
    log_xi_k = _mask_keys(_log_xi(k, w), key_padding_mask)  # [B, H, C, T]
    f = torch.softmax(log_xi_k, dim=-1) @ v  # f_n(w_c) = sum_m xi(k_m, w_c) v_m / sum_m xi(k_m, w_c): [B, H, C, K]
    log_keys = torch.logsumexp(log_xi_k, dim=-1)  # log sum_m xi(k_m, w_c): [B, H, C]
    # log q_c'(w_c) up to the N(w; 0, I) factor shared by every density at w_c: [B, H, C, C'].
    log_prop = _log_xi(mu, w).masked_fill(absent.unsqueeze(-2), float("-inf"))
    log_own = torch.diagonal(log_prop, dim1=-2, dim2=-1)  # log q_c(w_c): [B, H, C]
    balance = torch.exp(log_own - torch.logsumexp(log_prop, dim=-1))  # [B, H, C]
    r = torch.softmax((q @ q_land.transpose(-1, -2)).masked_fill(absent.unsqueeze(-2), float("-inf")), dim=-1)
    num_present = present.sum(-1).to(acc)[:, None, None, None]  # [B, 1, 1, 1]
    alpha = (balance.unsqueeze(-2) + alpha_coeff * (r - 1.0 / num_present)).clamp_min(ALPHA_FLOOR)  # [B, H, T, C]
    # log a_nc = log alpha_nc + log xi(q_n, w_c) + log sum_m xi(k_m, w_c) - log xi(mu_c, w_c)
    log_a = torch.log(alpha) + _log_xi(q, w).transpose(-1, -2) + (log_keys - log_own).unsqueeze(-2)
    log_a = log_a.masked_fill(absent.unsqueeze(-2), float("-inf"))
    return torch.softmax(log_a, dim=-1) @ f


def naive_lara(q: Tensor, k: Tensor, v: Tensor, noise: Tensor, key_padding_mask: Optional[Tensor] = None,
               alpha_coeff: float = 1.0) -> Tensor:
    """:func:`lara` from its definition, with loops: explicit Gaussian densities for ``p_n`` and the proposals
    ``q_c``, ``xi(q_n, w)`` left in, nothing cancelled. Slow: small sizes only."""
    acc = compute_dtype(q)
    q, k, v, noise = q.to(acc), k.to(acc), v.to(acc), noise.to(acc)
    B, H, T, K = q.shape
    C = noise.shape[-2]
    noise = noise.expand(B, H, C, K)  # [H, C, K] or [B, H, C, K]
    out = torch.zeros(B, H, T, K, dtype=acc)

    def log_normal(w, mean):  # log N(w; mean, I)
        return -0.5 * (w - mean).pow(2).sum() - 0.5 * K * math.log(2 * math.pi)
    for b in range(B):
        keys = [j for j in range(T) if key_padding_mask is None or not bool(key_padding_mask[b, j])]
        L = len(keys)
        segments = [[keys[r] for r in range(L) if r * C // L == c] for c in range(C)]
        used = [c for c in range(C) if segments[c]]
        for h in range(H):
            q_land = {c: torch.stack([q[b, h, j] for j in segments[c]]).mean(0) for c in used}
            k_land = {c: torch.stack([k[b, h, j] for j in segments[c]]).mean(0) for c in used}
            mu = {c: q_land[c] + k_land[c] for c in used}
            w = {c: mu[c] + noise[b, h, c] for c in used}
            log_q = {(c, c2): log_normal(w[c], mu[c2]) for c in used for c2 in used}  # log q_c2(w_c)
            for n in range(T):
                pi = torch.softmax(torch.stack([q[b, h, n] @ k[b, h, m] for m in keys]), 0)  # mixture weights of p_n
                r = dict(zip(used, torch.softmax(torch.stack([q[b, h, n] @ q_land[c] for c in used]), 0)))
                num, den = torch.zeros(K, dtype=acc), torch.zeros((), dtype=acc)
                for c in used:
                    wc = w[c]
                    log_p = torch.logsumexp(torch.stack(
                        [torch.log(pi[i]) + log_normal(wc, q[b, h, n] + k[b, h, m]) for i, m in enumerate(keys)]), 0)
                    balance = torch.exp(log_q[c, c] - torch.logsumexp(torch.stack([log_q[c, c2] for c2 in used]), 0))
                    alpha = (balance + alpha_coeff * (r[c] - 1.0 / len(used))).clamp_min(ALPHA_FLOOR)
                    xi = torch.stack([torch.exp(wc @ q[b, h, n] - 0.5 * q[b, h, n] @ q[b, h, n]
                                                + wc @ k[b, h, m] - 0.5 * k[b, h, m] @ k[b, h, m]) for m in keys])
                    f = (xi.unsqueeze(-1) * torch.stack([v[b, h, m] for m in keys])).sum(0) / xi.sum()
                    a = alpha * torch.exp(log_p - log_q[c, c])
                    num, den = num + a * f, den + a
                out[b, h, n] = num / den
    return out


def softmax_attention(q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Optional[Tensor] = None) -> Tensor:
    """Exact ``softmax_j(q_i . k_j) v_j`` over non-padding keys: ``[B, H, T, K]`` (the target)."""
    acc = compute_dtype(q)
    return torch.softmax(_mask_keys(q.to(acc) @ k.to(acc).transpose(-1, -2), key_padding_mask), dim=-1) @ v.to(acc)


def randomized_attention(q: Tensor, k: Tensor, v: Tensor, num_samples: int = 1,
                         key_padding_mask: Optional[Tensor] = None,
                         generator: Optional[torch.Generator] = None) -> Tensor:
    """Randomised attention (RA), the paper's unbiased estimator: for every query ``n``, the mean of ``f_n(w)`` over
    ``num_samples`` draws ``w ~ p_n`` (a key ``m`` with probability ``softmax_m(q_n . k_m)``, then
    ``w = q_n + k_m + N(0, I)``). O(S T^2 K) per head: a reference. Shapes and dtype as :func:`lara`."""
    acc = compute_dtype(q)
    q, k, v = q.to(acc), k.to(acc), v.to(acc)
    B, H, T, K = q.shape
    pi = torch.softmax(_mask_keys(q @ k.transpose(-1, -2), key_padding_mask), dim=-1).reshape(-1, T)
    picked = torch.multinomial(pi, num_samples, replacement=True, generator=generator).reshape(B, H, T * num_samples)
    k_picked = torch.gather(k, 2, picked.unsqueeze(-1).expand(-1, -1, -1, K)).reshape(B, H, T, num_samples, K)
    eps = torch.randn(B, H, T, num_samples, K, generator=generator, dtype=acc)
    w = (q.unsqueeze(3) + k_picked + eps).reshape(B, H, T * num_samples, K)
    f = torch.softmax(_mask_keys(_log_xi(k, w), key_padding_mask), dim=-1) @ v  # [B, H, T * S, K]
    return f.reshape(B, H, T, num_samples, K).mean(3)
