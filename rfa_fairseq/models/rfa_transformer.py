"""Translation: model ``rfa_transformer`` (fairseq's TransformerModel with an RFA decoder) and its architectures."""
import argparse
import logging

from fairseq.dataclass.utils import gen_parser_from_dataclass
from fairseq.models import register_model, register_model_architecture
from fairseq.models.transformer import TransformerModel
from fairseq.models.transformer.transformer_legacy import (base_architecture, transformer_iwslt_de_en,
                                                           transformer_vaswani_wmt_en_de_big,
                                                           transformer_vaswani_wmt_en_fr_big, transformer_wmt_en_de)
from omegaconf import OmegaConf
import torch

from ..config import RFAConfig, fill_defaults, rfa_config_from
from ..modules import CrossRFAttention
from ..validation import divisible_heads
from ..inference import InferenceConfig, InferenceMixin
from .rfa_decoder import SENTENCE_MIN, RFATransformerDecoder, SoftmaxTransformerDecoder
from .rfa_encoder import RFATransformerEncoder, SoftmaxTransformerEncoder
from .sentence_index import add_sentence_index, sentence_length_ratios, separator_index
from .translation_config import TranslationAttentionConfig, attention_config_from

logger = logging.getLogger(__name__)
# --sentence-min's default: this share of the training sentences would end later than they do (chosen on valid,
# docs/quality.md); read from at most SCANNED training pairs
SENTENCE_MIN_QUANTILE, SCANNED = 0.002, 100_000


@register_model("rfa_transformer")
class RFATransformerModel(InferenceMixin, TransformerModel):
    """fairseq's transformer with a softmax encoder (``--encoder-attention {rfa,favor,lara}``: linear in the source
    length too) and an RFA decoder: causal RFA or RFA-Gate self-attention, fairseq's softmax cross attention
    (``--cross-attention rfa``: the paper's RFA cross attention); ``--decoder-attention softmax``: fairseq's own."""

    @classmethod
    def add_args(cls, parser):
        super().add_args(parser)
        for config in (RFAConfig(), TranslationAttentionConfig(), InferenceConfig()):
            gen_parser_from_dataclass(parser, config, delete_default=True)

    @classmethod
    def build_model(cls, args, task):
        if not isinstance(args, argparse.Namespace):
            # fairseq-hydra-train's DictConfig: TransformerConfig keeps rfa_* keys only from a (flat) Namespace.
            args = argparse.Namespace(**OmegaConf.to_container(args, resolve=True))
        rfa_base_architecture(args)
        rfa_config_from(args)  # validate the --rfa-* flags before building anything
        attention = attention_config_from(args)
        divisible_heads(args.decoder_embed_dim, args.decoder_attention_heads,
                        "--decoder-embed-dim", "--decoder-attention-heads")
        if attention.encoder_attention != "softmax":
            divisible_heads(args.encoder_embed_dim, args.encoder_attention_heads,
                            "--encoder-embed-dim", "--encoder-attention-heads")
        model = super().build_model(args, task)
        if attention.sentence_index:
            model.decoder.source_separator = separator_index(task.source_dictionary, "source")
            if args.sentence_min is None:  # fairseq-train: from the training data, kept with the model in its args
                args.sentence_min = training_sentence_min(task, model.decoder.sentence_separator)
            model.decoder.sentence_min = args.sentence_min
        model.decoder.cross_sentence_window = attention.cross_sentence_window  # -1: off
        model.read_inference_flags(args)
        return model

    def load_state_dict(self, state_dict, strict=True, model_cfg=None, args=None):
        # The other kind of cross attention's weights would fail with a list of key names: name the flag instead.
        prefix = "decoder.layers.0.encoder_attn."
        built = dict(self.named_modules()).get(prefix[:-1])
        if built is not None and any(key.startswith(prefix) for key in state_dict):
            saved = "rfa" if any(key.startswith(prefix + "feature_map.") for key in state_dict) else "softmax"
            built = "rfa" if isinstance(built, CrossRFAttention) else "softmax"
            if saved != built:
                raise ValueError(f"the checkpoint has {saved} cross attention and the model was built with "
                                 f"{built} cross attention: pass --cross-attention {saved} (fairseq-train) or "
                                 f"--model-overrides \"{{'cross_attention': '{saved}'}}\" (fairseq-generate, "
                                 f"fairseq-interactive)")
        return super().load_state_dict(state_dict, strict=strict, model_cfg=model_cfg, args=args)

    @classmethod
    def build_encoder(cls, cfg, src_dict, embed_tokens):
        # cfg: fairseq's TransformerConfig, which keeps the unknown (encoder_attention, ...) attributes.
        attention = attention_config_from(cfg)
        encoder = (SoftmaxTransformerEncoder(cfg, src_dict, embed_tokens) if attention.encoder_attention == "softmax"
                   else RFATransformerEncoder(cfg, src_dict, embed_tokens, attention))
        if attention.sentence_index:
            add_sentence_index(encoder.embed_positions, separator_index(src_dict, "source"), written=False)
        return encoder

    @classmethod
    def build_decoder(cls, cfg, tgt_dict, embed_tokens):
        attention = attention_config_from(cfg)
        if attention.decoder_attention == "softmax":
            decoder = SoftmaxTransformerDecoder(cfg, tgt_dict, embed_tokens, no_encoder_attn=cfg.no_cross_attention,
                                                decoding_attention=attention.decoding_attention)
        else:  # fairseq's TransformerConfig.from_namespace keeps unknown (rfa_*) attributes.
            decoder = RFATransformerDecoder(
                cfg, tgt_dict, embed_tokens, rfa=rfa_config_from(cfg), no_encoder_attn=cfg.no_cross_attention,
                cross_attention=attention.cross_attention, decoding_attention=attention.decoding_attention)
        if attention.sentence_index:
            decoder.sentence_separator = separator_index(tgt_dict, "target")
            decoder.sentence_alignment = not attention.no_sentence_alignment
            add_sentence_index(decoder.embed_positions, decoder.sentence_separator, written=True)
        return decoder


def training_sentence_min(task, separator: int, quantile: float = SENTENCE_MIN_QUANTILE) -> float:
    """Sentence-aligned decoding's floor from ``task``'s train split: the ``quantile`` of its sentences'
    :func:`sentence_length_ratios` (at most SCANNED pairs, evenly spread). Without a train split (a checkpoint that
    kept none, decoded without its training data) or a pair of the same sentence count in it: SENTENCE_MIN, with a
    warning."""
    try:
        task.load_dataset("train")
    except FileNotFoundError:
        logger.warning(f"no train split in {task.cfg.data} to set --sentence-min from: {SENTENCE_MIN}")
        return SENTENCE_MIN
    pairs = task.dataset("train")
    ratios = torch.cat([sentence_length_ratios(pairs.src[i], pairs.tgt[i], separator)
                        for i in range(0, len(pairs), max(1, len(pairs) // SCANNED))])
    if ratios.numel() == 0:
        logger.warning(f"no training pair in {task.cfg.data} has as many sentences on both sides: --sentence-min "
                       f"{SENTENCE_MIN}")
        return SENTENCE_MIN
    floor = float(torch.quantile(ratios, quantile))
    logger.info(f"--sentence-min {floor:.3f}: the {quantile:.1%} quantile of {ratios.numel()} training "
                "sentences' target over source lengths")
    return floor


@register_model_architecture("rfa_transformer", "rfa_transformer")
def rfa_base_architecture(args):
    fill_defaults(RFAConfig, args)
    fill_defaults(TranslationAttentionConfig, args)
    base_architecture(args)


def _rfa_twin(fairseq_arch):
    """Register ``rfa_`` + the name of fairseq's ``fairseq_arch``: its settings, then the RFA defaults."""
    @register_model_architecture("rfa_transformer", "rfa_" + fairseq_arch.__name__)
    def architecture(args):
        fairseq_arch(args)
        rfa_base_architecture(args)


for _arch in (transformer_iwslt_de_en, transformer_wmt_en_de, transformer_vaswani_wmt_en_de_big,
              transformer_vaswani_wmt_en_fr_big):
    _rfa_twin(_arch)
