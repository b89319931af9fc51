"""The translation model's encoder with linear self-attention (RFA, FAVOR+ or LARA), Time x Batch x Channel inside
layers; the padding mask (``[B, S]``, True = pad) keeps padded positions out of the keys, the values and LARA's
landmarks. ``--encoder-attention softmax`` (the default) builds fairseq's own :class:`SoftmaxTransformerEncoder`, which
adds no weights: softmax-encoder checkpoints hold exactly the weights they always did."""
from dataclasses import dataclass, field

from fairseq.dataclass import ChoiceEnum, FairseqDataclass
from fairseq.models.transformer import TransformerEncoderBase
from fairseq.modules.transformer_layer import TransformerEncoderLayerBase

from ..config import read_fields
from ..modules import ENCODER_ATTENTIONS, build_encoder_self_attention
from ..validation import flag, one_of, positive_int
from .wrapping import wrap_layer


@dataclass
class EncoderAttentionConfig(FairseqDataclass):
    """Which self-attention the encoder uses, and its size (translation and classification)."""
    encoder_attention: ChoiceEnum(list(ENCODER_ATTENTIONS)) = field(default="softmax", metadata={
        "help": "the encoder's self-attention (padding excluded): softmax (fairseq's, quadratic in the source length), "
                "rfa (random Fourier features with a learned sigma, as the RFA decoder), favor (Performer's positive "
                "random features) or lara (linear randomized attention, Zheng et al. 2022); --attention-dropout "
                "applies to softmax only"})
    encoder_feature_dim: int = field(default=64, metadata={
        "help": "random features D per head of --encoder-attention rfa (phi has 2D values) or favor"})
    lara_landmarks: int = field(default=16, metadata={
        "help": "landmarks C per head of --encoder-attention lara (segment means of the queries and keys, "
                "one proposal and sample each; cost O(source length x C) per head)"})


def encoder_attention_config_from(args) -> EncoderAttentionConfig:
    """The encoder's choices from a namespace, dataclass or DictConfig, validated (ValueError names a bad flag)."""
    values = read_fields(EncoderAttentionConfig, args)
    encoder = values["encoder_attention"] = one_of(flag("encoder_attention"), values["encoder_attention"],
                                                   ENCODER_ATTENTIONS)
    for name in ("encoder_feature_dim", "lara_landmarks"):
        positive_int(flag(name), values[name])
    if encoder not in ("rfa", "favor") and values["encoder_feature_dim"] != EncoderAttentionConfig.encoder_feature_dim:
        raise ValueError(f"--encoder-feature-dim sets the random features of --encoder-attention rfa or favor; "
                         f"it does nothing with --encoder-attention {encoder}"
                         + (" (LARA's samples are its landmarks: --lara-landmarks)" if encoder == "lara" else ""))
    if encoder != "lara" and values["lara_landmarks"] != EncoderAttentionConfig.lara_landmarks:
        raise ValueError(f"--lara-landmarks needs --encoder-attention lara (got --encoder-attention {encoder})")
    return EncoderAttentionConfig(**values)


class BeamGroupedReorder:
    """``reorder_encoder_out`` without fairseq's copy (an ``index_select`` of the T x (B * beam) x C output after every
    step, costlier than the decoder step at long sources) where it would change nothing: while the batch keeps its
    size, orders move rows only within their sentence's beam (``modules/beam.py``), whose rows are copies of one row.
    Orders that drop sentences are applied as fairseq does. The output keeps the source's tokens in fairseq's
    ``src_tokens`` slot (reordered with it): ``--cross-sentence-window`` numbers the source's sentences from them."""

    def forward(self, src_tokens, src_lengths=None, return_all_hiddens: bool = False, token_embeddings=None):
        out = super().forward(src_tokens, src_lengths, return_all_hiddens, token_embeddings)
        return dict(out, src_tokens=[src_tokens])

    def reorder_encoder_out(self, encoder_out, new_order):
        out = encoder_out["encoder_out"]
        if len(out) > 0 and out[0].size(1) == new_order.numel():
            return encoder_out
        return super().reorder_encoder_out(encoder_out, new_order)


class SoftmaxTransformerEncoder(BeamGroupedReorder, TransformerEncoderBase):
    """fairseq's transformer encoder, reordered for beam search as :class:`BeamGroupedReorder` says."""


class RFATransformerEncoderLayer(TransformerEncoderLayerBase):
    """A fairseq encoder layer whose self-attention is of the kind ``attention.encoder_attention``."""

    def __init__(self, cfg, attention: EncoderAttentionConfig, layer_idx: int, return_fc: bool = False):
        # build_self_attention runs inside the parent constructor and needs these.
        self.attention, self.layer_idx = attention, layer_idx
        super().__init__(cfg, return_fc=return_fc)

    def build_self_attention(self, embed_dim, cfg):
        return build_encoder_self_attention(
            self.attention.encoder_attention, embed_dim, cfg.encoder.attention_heads, dropout=cfg.attention_dropout,
            feature_dim=self.attention.encoder_feature_dim, landmarks=self.attention.lara_landmarks,
            module_id=(1 << 20) + self.layer_idx)  # seeds its draws: never a decoder module's id (0, 1, ...)


class RFATransformerEncoder(BeamGroupedReorder, TransformerEncoderBase):
    """fairseq's transformer encoder (a ``TransformerConfig``'s) with :class:`RFATransformerEncoderLayer` layers."""

    def __init__(self, cfg, dictionary, embed_tokens, attention: EncoderAttentionConfig, return_fc=False):
        self.attention, self._layers_built = attention, 0  # build_encoder_layer runs in the parent constructor
        super().__init__(cfg, dictionary, embed_tokens, return_fc=return_fc)

    def build_encoder_layer(self, cfg):
        layer = RFATransformerEncoderLayer(cfg, self.attention, self._layers_built, return_fc=self.return_fc)
        self._layers_built += 1
        return wrap_layer(layer, cfg)
