"""The translation model's attention choices (``rfa_transformer`` only), and their checks: not the
``--rfa-*`` flags (``rfa_fairseq.config``), which shape the RFA decoder, but which attention the encoder
(:class:`EncoderAttentionConfig`), the decoder and its cross attention use."""
from dataclasses import dataclass, field
from typing import Optional

from fairseq.dataclass import ChoiceEnum

from ..config import RFA_FIELDS, read_fields, refuse_changed
from ..validation import flag, non_negative_finite, non_negative_int, one_of
from .rfa_encoder import EncoderAttentionConfig, encoder_attention_config_from

DECODER_ATTENTIONS = ("rfa", "softmax")
CROSS_ATTENTIONS = ("rfa", "softmax")


@dataclass
class TranslationAttentionConfig(EncoderAttentionConfig):
    """The encoder's choices, and which attention the decoder uses."""
    decoder_attention: ChoiceEnum(list(DECODER_ATTENTIONS)) = field(default="rfa", metadata={
        "help": "the decoder's attention: rfa (causal RFA self-attention shaped by the --rfa-* flags, cross attention "
                "as --cross-attention says) or softmax (fairseq's own decoder; the --rfa-* flags then must keep their "
                "defaults)"})
    cross_attention: ChoiceEnum(list(CROSS_ATTENTIONS)) = field(default="softmax", metadata={
        "help": "the RFA decoder's cross attention: softmax (fairseq's, over the cached encoder output: its cost per "
                "step grows with the source length, not the output length; the better BLEU, see docs/quality.md) or "
                "rfa (the paper's: random features, a source summary of fixed size)"})
    decoding_attention: bool = field(default=False, metadata={
        "help": "return the last decoder layer's cross-attention weights in every decoding step, as fairseq's "
                "transformer does, for hypo['attention']. Off by default: the generator reorders a beam x source x "
                "output copy of them after every step, as costly as the decoder at long inputs. fairseq-generate "
                "--print-alignment does not need them (it aligns in its own pass)"})
    sentence_index: bool = field(default=False, metadata={
        "help": "documents with <sep> between sentences (scripts/make_documents.py): add to every source and target "
                "token's input a sinusoidal embedding of its sentence's number, the target's counted from the "
                "separators written (rfa_fairseq/models/sentence_index.py; docs/quality.md)"})
    no_sentence_alignment: bool = field(default=False, metadata={
        "help": "with --sentence-index, decoding writes one sentence per source sentence: a hypothesis ends only after "
                "the source's last sentence and opens none past it (fairseq-generate, -interactive; beam search and "
                "sampling). This flag turns that off. For a trained checkpoint: --model-overrides "
                "\"{'no_sentence_alignment': True}\""})
    sentence_min: Optional[float] = field(default=None, metadata={
        "help": "with --sentence-index, the shortest sentence aligned decoding ends, as a share of its source "
                "sentence's subwords (with its separator); 0: no floor. Unset, fairseq-train sets it from the "
                "training data (a low quantile of its sentences' target over source lengths; docs/quality.md) and the "
                "checkpoint keeps it. For a trained checkpoint: --model-overrides "
                "\"{'sentence_min': 0.4}\""})
    cross_sentence_window: int = field(default=-1, metadata={
        "help": "with --sentence-index: softmax cross attention reads only the source sentences within K of the "
                "sentence being written (0: that one; 1: also the one before and after), so a decoding step reads a "
                "few sentences, not the whole document (rfa_fairseq/ops/sentence_window.py). -1: the whole source"})


def attention_config_from(args) -> TranslationAttentionConfig:
    """The attention choices, validated (a softmax decoder: no ``--rfa-*`` flag changed; ValueError names the flag)."""
    values = dict(read_fields(TranslationAttentionConfig, args), **vars(encoder_attention_config_from(args)))
    for name, choices in (("decoder_attention", DECODER_ATTENTIONS), ("cross_attention", CROSS_ATTENTIONS)):
        values[name] = one_of(flag(name), values[name], choices)
    if values["decoder_attention"] == "softmax":
        refuse_changed(args, RFA_FIELDS, "the RFA decoder", "with --decoder-attention softmax the decoder is fairseq's own")
        if values["cross_attention"] != "softmax":
            raise ValueError("--cross-attention rfa shapes the RFA decoder; with --decoder-attention softmax the "
                             "decoder, its cross attention too, is fairseq's own (a checkpoint saved with both loads "
                             "with --model-overrides \"{'cross_attention': 'softmax'}\")")
    if values["cross_attention"] == "softmax":
        refuse_changed(args, ("rfa_cross_feature_dim",), "RFA cross attention",
                       "with --cross-attention softmax (the default) the cross attention is fairseq's own")
    for name in ("decoding_attention", "sentence_index", "no_sentence_alignment"):
        values[name] = bool(values[name])
    if values["no_sentence_alignment"] and not values["sentence_index"]:
        raise ValueError("--no-sentence-alignment turns off the sentence counts of --sentence-index's decoding: it "
                         "does nothing without --sentence-index")
    if values["sentence_min"] is not None:
        non_negative_finite("--sentence-min", values["sentence_min"])
        if not values["sentence_index"]:
            raise ValueError("--sentence-min is the floor of --sentence-index's aligned decoding: it does nothing "
                             "without --sentence-index")
    if values["cross_sentence_window"] != -1:
        non_negative_int("--cross-sentence-window (-1: off)", values["cross_sentence_window"])
        if not values["sentence_index"] or values["cross_attention"] != "softmax":
            raise ValueError("--cross-sentence-window restricts softmax cross attention to sentences numbered by "
                             "--sentence-index: it needs --sentence-index and --cross-attention softmax")
    return TranslationAttentionConfig(**values)
