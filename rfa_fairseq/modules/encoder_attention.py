"""Encoder self-attention of every kind, behind one builder: softmax, RFA, FAVOR+ or LARA.

:func:`build_encoder_self_attention` returns a module for the ``self_attn`` slot of fairseq's
``TransformerEncoderLayerBase`` (or another caller, such as the classifier): ``forward(query, key,
value, key_padding_mask=None, need_weights=False, attn_mask=None)`` in Time x Batch x Channel,
returning ``(out [T, B, C], None)`` for the linear kinds. ``softmax`` is fairseq's MultiheadAttention.
The linear kinds are non-causal attention over the whole source, padding excluded as keys:

- ``rfa``: the decoder's random Fourier (sin/cos) features of unit-normalised queries and keys with
  a learned sigma (kernel ``gaussian``), and ``favor``: Performer's positive features (kernel
  ``favor``), both computed by the decoder's cross attention with the source as its own keys;
- ``lara``: linear randomised attention (Zheng, Wang and Kong, ICML 2022; ``ops.lara``), which
  estimates softmax attention itself from ``landmarks`` proposals.
"""
from typing import Optional, Tuple

from fairseq.modules import MultiheadAttention
from torch import Tensor, nn

from ..validation import divisible_heads, positive_int
from .cross_rfa_attention import CrossRFAttention
from .lara_attention import LARAttention, check_self_attention_call
from .random_feature_map import RandomFeatureMap

ENCODER_ATTENTIONS = ("softmax", "rfa", "favor", "lara")
# The feature map of each random-feature kind (a kernel of ops.feature_maps).
RFA_KERNELS = {"rfa": "gaussian", "favor": "favor"}


class EncoderRFAttention(CrossRFAttention):
    """Non-causal RFA self-attention over the whole source: cross RFA with the source as its own keys.
    ``need_weights`` is accepted for fairseq's call signature and yields None: the weights would cost
    the T x T matrix that linear attention avoids."""

    def forward(self, query: Tensor, key: Optional[Tensor] = None, value: Optional[Tensor] = None,
                key_padding_mask: Optional[Tensor] = None, need_weights: bool = False,
                attn_mask: Optional[Tensor] = None) -> Tuple[Tensor, None]:
        """query: ``[T, B, C]``; key_padding_mask: ``[B, T]`` (True = pad). Returns ``([T, B, C], None)``."""
        check_self_attention_call(type(self).__name__, query, key, value, attn_mask)
        out, _ = super().forward(query, query, query, key_padding_mask=key_padding_mask)
        return out, None


def build_encoder_self_attention(kind: str, embed_dim: int, num_heads: int, dropout: float = 0.0,
                                 feature_dim: int = 64, landmarks: int = 16, module_id: int = 0) -> nn.Module:
    """The encoder self-attention module of ``kind`` (one of :data:`ENCODER_ATTENTIONS`).

    Args:
        embed_dim: model dimension ``C``; num_heads: ``H`` (``C`` divisible by ``H``).
        dropout: attention dropout of ``softmax`` (the linear kinds form no probabilities to drop).
        feature_dim: random features ``D`` per head of ``rfa`` (phi has ``2D`` values) and ``favor``.
        landmarks: ``C`` of ``lara``: landmarks, proposals and samples per head.
        module_id: tells the random matrix of ``rfa`` / ``favor`` apart from the model's other modules'
            (draws are seeded from fairseq's seed, the update number and this id).
    Raises ValueError naming the bad argument.
    """
    if kind not in ENCODER_ATTENTIONS:
        raise ValueError(f"encoder attention must be one of {ENCODER_ATTENTIONS}, got {kind!r}")
    divisible_heads(embed_dim, num_heads)
    if kind == "softmax":
        return MultiheadAttention(embed_dim, num_heads, dropout=dropout, self_attention=True)
    if kind == "lara":
        positive_int("landmarks", landmarks)
        return LARAttention(embed_dim, num_heads, landmarks=landmarks)
    positive_int("feature_dim", feature_dim)
    feature_map = RandomFeatureMap(num_heads=num_heads, head_dim=embed_dim // num_heads, num_features=feature_dim,
                                   kernel=RFA_KERNELS[kind], module_id=module_id)
    return EncoderRFAttention(embed_dim, num_heads, feature_map)
