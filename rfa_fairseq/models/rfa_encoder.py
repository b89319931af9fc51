"""The translation model's encoder with linear self-attention: RFA, FAVOR+ or LARA.

fairseq's TransformerEncoder with one builder overridden: each layer's ``self_attn`` comes from
``modules.encoder_attention.build_encoder_self_attention``. Embeddings, layer norms, the
feed-forward blocks and the forward pass are fairseq's. Layout: Time x Batch x Channel inside
layers; the padding mask fairseq passes to every layer (``[B, S]``, True = pad) keeps padded
positions out of the keys, the values and LARA's landmarks.

With ``--encoder-attention softmax`` (the default) the model builds fairseq's own encoder
instead, so softmax-encoder checkpoints hold exactly the weights they always did.
"""
from fairseq.distributed import fsdp_wrap
from fairseq.models.transformer import TransformerEncoderBase
from fairseq.modules.checkpoint_activations import checkpoint_wrapper
from fairseq.modules.transformer_layer import TransformerEncoderLayerBase

from ..config import TranslationAttentionConfig
from ..modules import build_encoder_self_attention

# Encoder modules seed their random matrices with ids from here on, so that their draws never
# coincide with the decoder's (whose modules are numbered 0, 1, ... from its first layer).
ENCODER_MODULE_ID_BASE = 1 << 20


class RFATransformerEncoderLayer(TransformerEncoderLayerBase):
    """A fairseq encoder layer whose self-attention is of the kind ``attention.encoder_attention``."""

    def __init__(self, cfg, attention: TranslationAttentionConfig, layer_idx: int, return_fc: bool = False):
        # build_self_attention runs inside the parent constructor and needs these.
        self.attention, self.layer_idx = attention, layer_idx
        super().__init__(cfg, return_fc=return_fc)

    def build_self_attention(self, embed_dim, cfg):
        return build_encoder_self_attention(
            self.attention.encoder_attention, embed_dim, cfg.encoder.attention_heads, dropout=cfg.attention_dropout,
            feature_dim=self.attention.encoder_feature_dim, landmarks=self.attention.lara_landmarks,
            module_id=ENCODER_MODULE_ID_BASE + self.layer_idx,
        )


class RFATransformerEncoder(TransformerEncoderBase):
    """fairseq's transformer encoder with :class:`RFATransformerEncoderLayer` layers.

    Args: as ``TransformerEncoderBase`` (a ``TransformerConfig``), plus the attention choices.
    """

    def __init__(self, cfg, dictionary, embed_tokens, attention: TranslationAttentionConfig, return_fc=False):
        self.attention = attention
        self._layers_built = 0
        super().__init__(cfg, dictionary, embed_tokens, return_fc=return_fc)

    def build_encoder_layer(self, cfg):
        layer = RFATransformerEncoderLayer(cfg, self.attention, self._layers_built, return_fc=self.return_fc)
        self._layers_built += 1
        # Same wrapping as fairseq's own encoder layers.
        checkpoint = cfg.checkpoint_activations
        if checkpoint:
            layer = checkpoint_wrapper(layer, offload_to_cpu=cfg.offload_activations)
        return fsdp_wrap(layer, min_num_params=cfg.min_params_to_wrap if not checkpoint else 0)
