"""Encoder self-attention of every kind behind one builder, for the ``self_attn`` slot of fairseq's
``TransformerEncoderLayerBase`` (Time x Batch x Channel): ``softmax`` (fairseq's MultiheadAttention), or non-causal
linear attention over the whole source, padding excluded as keys: ``rfa`` (the decoder's random Fourier features with a
learned sigma) and ``favor`` (Performer's positive features), both the decoder's cross attention with the source as its
own keys, or ``lara`` (``ops.lara``)."""
from typing import Optional, Tuple

from fairseq.modules import MultiheadAttention
from torch import Tensor, nn

from ..validation import divisible_heads, one_of, positive_int
from .cross_rfa_attention import CrossRFAttention
from .lara_attention import LARAttention, check_self_attention_call
from .random_feature_map import RandomFeatureMap

ENCODER_ATTENTIONS = ("softmax", "rfa", "favor", "lara")


class EncoderRFAttention(CrossRFAttention):
    """Cross RFA with the source as its own keys. query: ``[T, B, C]``; key_padding_mask: ``[B, T]`` (True = pad).
    Returns ``([T, B, C], None)``: no weights, which would cost the T x T matrix that linear attention avoids."""

    def forward(self, query: Tensor, key: Optional[Tensor] = None, value: Optional[Tensor] = None,
                key_padding_mask: Optional[Tensor] = None, need_weights: bool = False,
                attn_mask: Optional[Tensor] = None) -> Tuple[Tensor, None]:
        check_self_attention_call(type(self).__name__, query, key, value, attn_mask)
        return super().forward(query, query, query, key_padding_mask=key_padding_mask)[0], None


def build_encoder_self_attention(kind: str, embed_dim: int, num_heads: int, dropout: float = 0.0,
                                 feature_dim: int = 64, landmarks: int = 16, module_id: int = 0) -> nn.Module:
    """The encoder self-attention module of ``kind`` (one of :data:`ENCODER_ATTENTIONS`), ``embed_dim`` divisible by
    ``num_heads``. ``dropout``: of ``softmax`` (the linear kinds form no probabilities to drop); ``feature_dim``: random
    features ``D`` per head of ``rfa`` (phi has ``2D`` values) and ``favor``; ``landmarks``: ``C`` of ``lara``
    (landmarks, proposals and samples per head); ``module_id``: seeds the random matrix of ``rfa`` / ``favor`` apart
    from the model's other modules' (with fairseq's seed and the update number)."""
    one_of("encoder attention", kind, ENCODER_ATTENTIONS)
    divisible_heads(embed_dim, num_heads)
    if kind == "softmax":
        return MultiheadAttention(embed_dim, num_heads, dropout=dropout, self_attention=True)
    if kind == "lara":
        return LARAttention(embed_dim, num_heads, landmarks=landmarks)
    positive_int("feature_dim", feature_dim)
    feature_map = RandomFeatureMap(num_heads=num_heads, head_dim=embed_dim // num_heads, num_features=feature_dim,
                                   kernel={"rfa": "gaussian", "favor": "favor"}[kind], module_id=module_id)
    return EncoderRFAttention(embed_dim, num_heads, feature_map)
