"""Language modelling: model ``rfa_transformer_lm`` and its architectures."""
from dataclasses import dataclass

from fairseq import options
from fairseq.models import register_model, register_model_architecture
from fairseq.models.transformer import TransformerConfig
from fairseq.models.transformer_lm import (DEFAULT_MAX_TARGET_POSITIONS, TransformerLanguageModel,
                                           TransformerLanguageModelConfig, base_lm_architecture,
                                           transformer_lm_baevski_wiki103)
from fairseq.modules import AdaptiveInput, CharacterTokenEmbedder
from fairseq.utils import safe_getattr

from ..config import RFAConfig, fill_defaults, rfa_config_from
from ..validation import divisible_heads, flag
from ..inference import InferenceConfig, InferenceMixin
from .rfa_decoder import RFATransformerDecoder


@dataclass
class RFATransformerLanguageModelConfig(TransformerLanguageModelConfig, RFAConfig, InferenceConfig):
    pass


@register_model("rfa_transformer_lm", dataclass=RFATransformerLanguageModelConfig)
class RFATransformerLanguageModel(InferenceMixin, TransformerLanguageModel):
    """Decoder-only transformer LM whose self-attention is causal RFA / RFA-Gate."""

    @classmethod
    def build_model(cls, args, task):
        rfa = rfa_config_from(args)  # validate the --rfa-* flags before building anything
        divisible_heads(args.decoder_embed_dim, args.decoder_attention_heads,
                        "--decoder-embed-dim", "--decoder-attention-heads")
        if args.decoder_layers_to_keep:
            args.decoder_layers = len(args.decoder_layers_to_keep.split(","))
        if safe_getattr(args, "max_target_positions", None) is None:
            args.max_target_positions = safe_getattr(args, "tokens_per_sample", DEFAULT_MAX_TARGET_POSITIONS)
        model = cls(RFATransformerDecoder(
            TransformerConfig.from_namespace(args), task.target_dictionary, cls.build_lm_input_embedding(args, task),
            rfa=rfa, no_encoder_attn=True))
        model.read_inference_flags(args)
        return model

    @classmethod
    def build_lm_input_embedding(cls, args, task):
        """The input embedding exactly as fairseq's TransformerLanguageModel builds it."""
        if args.character_embeddings:
            return CharacterTokenEmbedder(
                task.source_dictionary, eval(args.character_filters), args.character_embedding_dim,
                args.decoder_embed_dim, args.char_embedder_highway_layers)
        if args.adaptive_input:
            embed = AdaptiveInput(
                len(task.source_dictionary), task.source_dictionary.pad(), args.decoder_input_dim,
                args.adaptive_input_factor, args.decoder_embed_dim,
                options.eval_str_list(args.adaptive_input_cutoff, type=int),
                args.quant_noise_pq, args.quant_noise_pq_block_size)
        else:
            embed = cls.build_embedding(args, task.source_dictionary, args.decoder_input_dim)
        if args.tie_adaptive_weights:
            if not args.adaptive_input:
                raise ValueError("--tie-adaptive-weights requires --adaptive-input")
            for one, other in (("adaptive_input_factor", "adaptive_softmax_factor"),
                               ("adaptive_softmax_cutoff", "adaptive_input_cutoff"),
                               ("decoder_input_dim", "decoder_output_dim")):
                if getattr(args, one) != getattr(args, other):
                    raise ValueError(f"--tie-adaptive-weights requires {flag(one)} == {flag(other)}")
        return embed


# ``rfa_transformer_lm`` itself takes the dataclass's defaults; the named architectures fill them.
@register_model_architecture("rfa_transformer_lm", "rfa_transformer_lm_wiki103")
def rfa_transformer_lm_wiki103(args):
    """Baevski and Auli's adaptive-input WikiText-103 model (16 layers, 1024 dims, 8 heads)."""
    transformer_lm_baevski_wiki103(args)
    fill_defaults(RFAConfig, args)
    base_lm_architecture(args)


@register_model_architecture("rfa_transformer_lm", "rfa_transformer_lm_wiki103_small")
def rfa_transformer_lm_wiki103_small(args):
    """Ours: the wiki103 recipe (adaptive input and softmax, tied weights, dropout 0.3) at the smaller sizes below."""
    for name, value in (("decoder_layers", 6), ("decoder_embed_dim", 512), ("decoder_ffn_embed_dim", 2048),
                        ("decoder_attention_heads", 8)):
        setattr(args, name, safe_getattr(args, name, value))
    rfa_transformer_lm_wiki103(args)
