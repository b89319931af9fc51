"""One step of causal RFA for incremental decoding: O(F K) per head, whatever the length."""
from typing import Optional, Tuple

import torch
from torch import Tensor

from ..denominator import DEFAULT_EPS, compute_dtype, guarded_ratio


def recurrent_causal_rfa_step(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    log_g: Optional[Tensor],
    state: Optional[Tuple[Tensor, Tensor]],
    eps: float = DEFAULT_EPS,
    inplace: bool = False,
) -> Tuple[Tensor, Tuple[Tensor, Tensor]]:
    """Advance the state by one token and read it out.

    Args:
        q, k: ``[B, H, F]``; v: ``[B, H, K]``; log_g: ``[B, H]`` or None.
        state: ``(S [B, H, F, K], z [B, H, F])`` in fp32, or None at the first token.
        inplace: update ``state`` in place (only when no gradient is needed and the caller
            owns the tensors); the same tensors are then returned.
    Returns:
        ``out [B, H, K]`` (dtype of ``v``) and the new ``(S, z)``.
    """
    acc = compute_dtype(q)
    kf, vf, qf = k.to(acc), v.to(acc), q.to(acc)
    if log_g is None:
        decay = None
        kw = kf
    else:
        lg = log_g.to(acc)
        decay = torch.exp(lg)
        kw = kf * (-torch.expm1(lg)).unsqueeze(-1)
    if state is None:
        S = kw.unsqueeze(-1) * vf.unsqueeze(-2)
        z = kw.clone()  # kw may be the caller's k; a later in-place step must not write into it
    elif inplace and state[0].dtype == acc:
        S, z = state
        if decay is not None:
            S.mul_(decay[..., None, None])
            z.mul_(decay[..., None])
        S.addcmul_(kw.unsqueeze(-1), vf.unsqueeze(-2))  # no [B, H, F, K] temporary
        z.add_(kw)
    else:
        S, z = state[0].to(acc), state[1].to(acc)
        if decay is not None:
            S = S * decay[..., None, None]
            z = z * decay[..., None]
        S = S + kw.unsqueeze(-1) * vf.unsqueeze(-2)
        z = z + kw
    num = (qf.unsqueeze(-2) @ S).squeeze(-2)
    den = (qf * z).sum(-1)
    return guarded_ratio(num, den, eps, v.dtype), (S, z)
