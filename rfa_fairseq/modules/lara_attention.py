"""LARAttention: linear randomised attention (``ops.lara``) as an encoder's self-attention layer."""
from typing import Optional, Tuple

import torch
from torch import Tensor, nn

from ..ops.denominator import cast_finite
from ..ops.lara import lara
from ..validation import divisible_heads, positive_int
from .heads import merge_heads, split_heads
from .rfa_attention_base import add_projections


def check_self_attention_call(name: str, query: Tensor, key: Optional[Tensor], value: Optional[Tensor],
                              attn_mask: Optional[Tensor]):
    """The linear encoder attentions are self-attention with no attention matrix to mask."""
    if (key is not None and key is not query) or (value is not None and value is not query):
        raise ValueError(f"{name} is self-attention: key and value must be the query tensor (or None)")
    if attn_mask is not None:
        raise ValueError(f"{name} takes no attn_mask: linear attention never forms the T x T matrix it "
                         "would mask (padding goes through key_padding_mask)")


class LARAttention(nn.Module):
    """LARA self-attention over a whole sequence (non-causal: the landmarks need every position). ``embed_dim``: ``C``;
    ``num_heads``: ``H`` (``K = C / H``); ``landmarks`` per head: proposals, and samples (one per proposal), cost linear
    in them; ``alpha_coeff``: ``lambda`` of the query-specific weights (``ops.lara``; 1 as the paper).

    Projections are initialised as fairseq's MultiheadAttention's, and queries and keys scaled by ``K^-1/4`` each, so
    the estimate is a softmax layer's ``softmax(q k^T / sqrt(K)) v``. In training each proposal draws a fresh sample
    per sequence and head (torch's random stream, which fairseq reseeds from ``--seed`` and the update number); in
    evaluation the sample is the proposal's mean, as in the authors' code: deterministic, and closer to softmax
    attention than a random sample."""

    def __init__(self, embed_dim: int, num_heads: int, landmarks: int = 16, bias: bool = True,
                 alpha_coeff: float = 1.0):
        super().__init__()
        divisible_heads(embed_dim, num_heads)
        positive_int("landmarks", landmarks)
        self.embed_dim, self.num_heads, self.landmarks = embed_dim, num_heads, landmarks
        self.head_dim, self.alpha_coeff = embed_dim // num_heads, alpha_coeff
        add_projections(self, embed_dim, embed_dim, bias)

    def noise(self, batch: int, device: torch.device) -> Tensor:
        """Standard normal ``[B, H, C, K]`` in training (fresh per call), zeros ``[H, C, K]`` in eval."""
        if self.training:
            return torch.randn(batch, self.num_heads, self.landmarks, self.head_dim, device=device)
        return torch.zeros(self.num_heads, self.landmarks, self.head_dim, device=device)

    def forward(self, query: Tensor, key: Optional[Tensor] = None, value: Optional[Tensor] = None,
                key_padding_mask: Optional[Tensor] = None, need_weights: bool = False,
                attn_mask: Optional[Tensor] = None) -> Tuple[Tensor, None]:
        """query: ``[T, B, C]``; key_padding_mask: ``[B, T]`` (True = pad). Returns ``([T, B, C], None)``."""
        check_self_attention_call(type(self).__name__, query, key, value, attn_mask)
        q, k, v = (split_heads(proj(query), self.num_heads) for proj in (self.q_proj, self.k_proj, self.v_proj))
        scale = self.head_dim ** -0.25
        out = lara(q * scale, k * scale, v, self.noise(query.size(1), query.device), key_padding_mask, self.alpha_coeff)
        return self.out_proj(merge_heads(cast_finite(out, query.dtype))), None

    def extra_repr(self) -> str:
        return f"heads={self.num_heads}, head_dim={self.head_dim}, landmarks={self.landmarks}"
