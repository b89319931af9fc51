"""The RFA decoder of both model families (fairseq's TransformerDecoder with RFA layers: only the builders are
overridden, and two forwards added), and the translation model's softmax decoder (``--decoder-attention softmax``)."""
import math
from typing import Optional

import torch
from torch import Tensor, nn
from fairseq.models.transformer import TransformerDecoderBase
from fairseq.modules.transformer_layer import TransformerDecoderLayerBase

from ..config import RFAConfig
from ..modules import CausalRFAttention, CrossRFAttention, RandomFeatureMap, SoftmaxCrossAttention
from ..modules.random_feature_map import feature_map_id
from ..modules.rfa_attention_base import IncrementalState
from ..modules.softmax_attention import SentenceWindow
from .sentence_index import sentence_embedding, sentence_numbers
from .wrapping import wrap_layer

# Bump when the RFA part of the state dict changes; upgrade_state_dict_named converts old ones.
RFA_CHECKPOINT_VERSION = 1
# The log probability of </s> where sentence-aligned decoding forbids it: exp(-80) ~ 2e-35, still above float32's zero
FORBIDDEN_EOS = -80.0
# Sentence-aligned decoding ends a sentence (<sep>, or </s> after the last) at (a, b): a x its source sentence's tokens
# (with its <sep> or </s>) + b, which no training sentence of either Multi30k direction reaches (a loop's stop); none
# before the decoder's sentence_min x them (--sentence-min; SENTENCE_MIN where the model kept none and no training
# data is at hand: the floor chosen on Multi30k de->en's valid split, and the one of checkpoints saved before).
SENTENCE_LENGTH, SENTENCE_MIN = (2.0, 10.0), 0.5


class SoftmaxTransformerDecoderLayer(TransformerDecoderLayerBase):
    """fairseq's decoder layer, its cross attention a :class:`SoftmaxCrossAttention` (same weights, leaner caches)."""

    def build_encoder_attention(self, embed_dim, cfg):
        return SoftmaxCrossAttention(  # the arguments of fairseq's builder
            embed_dim, cfg.decoder.attention_heads, kdim=cfg.encoder.embed_dim, vdim=cfg.encoder.embed_dim,
            dropout=cfg.attention_dropout, encoder_decoder_attention=True, q_noise=self.quant_noise,
            qn_block_size=self.quant_noise_block_size, xformers_att_config=cfg.encoder.xformers_att_config)


class RFATransformerDecoderLayer(SoftmaxTransformerDecoderLayer):
    """A fairseq decoder layer with RFA self-attention, its cross attention RFA or ``"softmax"`` (the parent's)."""

    def __init__(self, cfg, rfa: RFAConfig, layer_idx: int, no_encoder_attn: bool = False,
                 add_bias_kv: bool = False, add_zero_attn: bool = False, cross_attention: str = "rfa"):
        # The attention builders run inside the parent constructor and need these.
        self.rfa, self.layer_idx, self.cross_attention = rfa, layer_idx, cross_attention
        super().__init__(cfg, no_encoder_attn, add_bias_kv=add_bias_kv, add_zero_attn=add_zero_attn)
        # Implicit RFA attention weights cost O(source length) per step: only for the layer fairseq aligns with.
        self.need_attn = False

    def _feature_map(self, cfg, num_features: int, module_id: int) -> RandomFeatureMap:
        heads, rfa = cfg.decoder.attention_heads, self.rfa
        return RandomFeatureMap(num_heads=heads, head_dim=cfg.decoder.embed_dim // heads, num_features=num_features,
                                kernel=rfa.rfa_kernel, random_matrix=rfa.rfa_random_matrix,
                                init_sigma=rfa.rfa_init_sigma, module_id=module_id, fixed=rfa.rfa_fixed_features)

    def build_self_attention(self, embed_dim, cfg, add_bias_kv=False, add_zero_attn=False):
        if add_bias_kv or add_zero_attn or cfg.cross_self_attention:
            raise ValueError("RFA decoders' self-attention supports neither add_bias_kv, add_zero_attn nor "
                             "--cross-self-attention")
        rfa = self.rfa
        return CausalRFAttention(
            embed_dim, cfg.decoder.attention_heads,
            self._feature_map(cfg, rfa.rfa_causal_feature_dim, feature_map_id(self.layer_idx, cross=False)),
            gate=rfa.rfa_gate, gate_form=rfa.rfa_gate_form, gate_bias=rfa.rfa_gate_bias, eps=rfa.rfa_eps,
            chunk_size=rfa.rfa_chunk_size, recompute=rfa.rfa_recompute, recompute_segment=rfa.rfa_recompute_segment,
            backend=rfa.rfa_backend, gate_bias_last=rfa.rfa_gate_bias_last, short_conv=rfa.rfa_short_conv)

    def build_encoder_attention(self, embed_dim, cfg):
        if self.cross_attention == "softmax":
            return super().build_encoder_attention(embed_dim, cfg)
        return CrossRFAttention(
            embed_dim, cfg.decoder.attention_heads,
            self._feature_map(cfg, self.rfa.rfa_cross_feature_dim, feature_map_id(self.layer_idx, cross=True)),
            kdim=cfg.encoder.embed_dim, eps=self.rfa.rfa_eps, recompute=self.rfa.rfa_recompute)


class SoftmaxTransformerDecoder(TransformerDecoderBase):
    """fairseq's transformer decoder (``--decoder-attention softmax``) with :class:`SoftmaxTransformerDecoderLayer`
    layers. Decoding steps return cross-attention weights only with ``decoding_attention`` (its flag's help: why)."""

    def __init__(self, cfg, dictionary, embed_tokens, no_encoder_attn=False, output_projection=None,
                 decoding_attention: bool = False):
        self.decoding_attention = decoding_attention
        # set by the model's builder: <sep>'s indexes (--sentence-index), --cross-sentence-window, and whether
        # decoding writes one sentence per source sentence (--sentence-index without --no-sentence-alignment)
        self.sentence_separator = self.source_separator = None
        self.cross_sentence_window, self.sentence_alignment, self.sentence_min = -1, False, SENTENCE_MIN
        self._stateful = None  # the modules that keep decoding state (reorder_incremental_state_scripting)
        self.step_engine = None  # runs decoding steps in place of the modules: an engine of rfa_fairseq/engines/
        super().__init__(cfg, dictionary, embed_tokens, no_encoder_attn=no_encoder_attn,
                         output_projection=output_projection)

    def reorder_incremental_state_scripting(self, incremental_state, new_order):
        """fairseq's beam-search reorder over the stateful modules, listed once (fairseq's walks all at every step)."""
        if self._stateful is None:
            self._stateful = [m for m in self.modules() if hasattr(m, "reorder_incremental_state")]
        for module in self._stateful:
            incremental_state = module.reorder_incremental_state(incremental_state, new_order) or incremental_state
        source = self.get_incremental_state(incremental_state, "sentences")
        if source is not None and source["last"].size(0) != new_order.numel():  # sentences left (beams share one)
            self.set_incremental_state(incremental_state, "sentences", {k: v[new_order] for k, v in source.items()})

    def forward(self, prev_output_tokens, encoder_out=None, incremental_state=None, features_only=False, **kwargs):
        out = super().forward(prev_output_tokens, encoder_out, incremental_state, features_only, **kwargs)
        return self.align_sentences(out, prev_output_tokens, encoder_out, incremental_state)

    def align_sentences(self, out, prev_output_tokens, encoder_out, incremental_state):
        """Sentence-aligned decoding (``sentence_alignment``): a step's separators per row against its source's
        (counted once, with the source sentences' lengths, in ``incremental_state``); where fewer, ``</s>`` is
        forbidden, else ``<sep>``, both in a sentence short of ``sentence_min``; one at SENTENCE_LENGTH must end:
        ``out`` gets ``forbid_eos``, ``forbid_sep`` and ``end`` ``[B]`` for :meth:`get_normalized_probs`."""
        if not self.sentence_alignment or incremental_state is None or encoder_out is None:
            return out
        source = self.get_incremental_state(incremental_state, "sentences")
        if source is None:
            source = self.source_sentences(encoder_out)
            self.set_incremental_state(incremental_state, "sentences", source)
        is_sep = prev_output_tokens.eq(self.sentence_separator)
        written, position = is_sep.sum(1), torch.arange(is_sep.size(1), device=is_sep.device)
        start = torch.where(is_sep, position, 0).amax(1)  # the last <sep>
        n = source["length"].gather(1, torch.minimum(written, source["last"])[:, None])[:, 0]
        current, more = position.size(0) - 1 - start, written < source["last"]  # the sentence's tokens so far
        short, end = current < n * self.sentence_min, current >= n * SENTENCE_LENGTH[0] + SENTENCE_LENGTH[1]
        out[1].update(forbid_eos=more | short, forbid_sep=~more | short, end=end)
        return out

    def source_sentences(self, encoder_out) -> dict:
        """The sources' last sentence numbers ``last [B]`` and their sentences' tokens (with their ``<sep>`` or
        ``</s>``) ``length [B, J]``."""
        src = encoder_out["src_tokens"][0]
        number = sentence_numbers(src, self.source_separator, written=False)
        length = torch.zeros(number.size(0), int(number.max()) + 1, device=src.device).scatter_add_(
            1, number, src.ne(self.padding_idx).float())
        return {"last": number[:, -1], "length": length}

    def get_normalized_probs(self, net_output, log_probs: bool, sample=None):
        """fairseq's, then the tokens a decoding step forbids (:meth:`align_sentences`): ``<sep>`` at -inf, ``</s>``
        at FORBIDDEN_EOS (below any candidate a search keeps, yet a choice at fairseq's length limit, where every
        other token is at -inf: a hypothesis still ends there, and sampling still has a token to draw); where a
        sentence must ``end``, every other token but a forbidden ``</s>`` at -inf (the ending keeps its score)."""
        probs = super().get_normalized_probs(net_output, log_probs, sample)
        extra = net_output[1] if len(net_output) > 1 else None
        if isinstance(extra, dict) and "forbid_eos" in extra:
            last, zero = probs[:, -1], float("-inf") if log_probs else 0.0
            # rows that must end: all at -inf but the ending (rows that need not: the ending written back as it was)
            end = torch.where(extra["forbid_eos"], self.sentence_separator, self.dictionary.eos())[:, None]
            keep = last.gather(1, end)
            last.masked_fill_(extra["end"][:, None], zero).scatter_(1, end, keep)
            last[:, self.dictionary.eos()].masked_fill_(
                extra["forbid_eos"], FORBIDDEN_EOS if log_probs else math.exp(FORBIDDEN_EOS))
            last[:, self.sentence_separator].masked_fill_(extra["forbid_sep"], zero)
        return probs

    def extract_features_scriptable(self, prev_output_tokens, encoder_out=None, incremental_state=None,
                                    full_context_alignment: bool = False, alignment_layer=None, alignment_heads=None):
        if incremental_state is not None and alignment_layer is None and not self.decoding_attention:
            alignment_layer = self.num_layers  # past the last layer: none returns its weights
        if self.cross_sentence_window >= 0 and encoder_out is not None:  # fairseq's layers pass it to cross attention
            target = sentence_numbers(prev_output_tokens, self.sentence_separator, written=True)
            first = incremental_state is None or prev_output_tokens.size(1) == 1  # the step that caches the windows
            encoder_out = dict(encoder_out, encoder_padding_mask=[self.sentence_window(
                encoder_out if first else None, target if incremental_state is None else target[:, -1:])])
        return super().extract_features_scriptable(prev_output_tokens, encoder_out, incremental_state,
                                                   full_context_alignment, alignment_layer, alignment_heads)

    def sentence_window(self, encoder_out, target: Tensor) -> SentenceWindow:
        """The cross attention's windows for the target inputs' sentence numbers ``target [B, Tt]``; the source's are
        counted from ``encoder_out`` (its tokens, -1 at its pads) unless it is None (a step that reads its cache)."""
        source = None
        if encoder_out is not None:
            source = sentence_numbers(encoder_out["src_tokens"][0], self.source_separator, written=False)
            source = source.masked_fill(encoder_out["encoder_padding_mask"][0], -1)
        return SentenceWindow(source, target, self.cross_sentence_window)

    def build_decoder_layer(self, cfg, no_encoder_attn=False):
        return wrap_layer(SoftmaxTransformerDecoderLayer(cfg, no_encoder_attn), cfg)


class RFATransformerDecoder(SoftmaxTransformerDecoder):
    """fairseq's transformer decoder with :class:`RFATransformerDecoderLayer` layers (``rfa``, ``cross_attention``)."""

    def __init__(self, cfg, dictionary, embed_tokens, rfa: RFAConfig, no_encoder_attn=False,
                 output_projection=None, cross_attention: str = "rfa", decoding_attention: bool = False):
        self.rfa, self.cross_attention, self._layers_built = rfa, cross_attention, 0
        super().__init__(cfg, dictionary, embed_tokens, no_encoder_attn=no_encoder_attn,
                         output_projection=output_projection, decoding_attention=decoding_attention)
        self.register_buffer("rfa_version", torch.tensor([RFA_CHECKPOINT_VERSION]))

    def build_decoder_layer(self, cfg, no_encoder_attn=False):
        self._layers_built += 1
        return wrap_layer(RFATransformerDecoderLayer(cfg, self.rfa, self._layers_built - 1, no_encoder_attn,
                                                     cross_attention=self.cross_attention), cfg)

    def forward(self, prev_output_tokens, encoder_out=None, incremental_state=None, features_only=False,
                stream_state: Optional[IncrementalState] = None, **kwargs):
        """fairseq's forward; with ``stream_state`` (a stateful LM: a dict in fairseq's incremental-state layout,
        ``{}`` at a stream's start), ``prev_output_tokens [B, T]`` is the next block of B text streams: every causal
        RFA layer continues its state there (not detached), positions restart at the block. A decoding step that asks
        only for the output is the step engine's (the first one too, where the engine runs it), else after the first
        :meth:`forward_step`."""
        if stream_state is None:
            first = not incremental_state  # the first step caches the source (a step engine's, or the eager pass)
            if (incremental_state is not None and not (features_only or kwargs or self.decoding_attention)
                    and (not first or prev_output_tokens.size(1) == 1)):
                # the position table's row of the last token, as fairseq's embeddings count in decoding
                tokens, position = prev_output_tokens[:, -1:], self.padding_idx + prev_output_tokens.size(1)
                if self.embed_positions is not None and position >= self._position_table().size(0):
                    self.embed_positions(prev_output_tokens, incremental_state={})  # a too short sinusoidal table grows
                sentence = None if self.sentence_separator is None else prev_output_tokens.eq(
                    self.sentence_separator).sum(1)
                out = None if self.step_engine is None else self.step_engine(tokens, position, encoder_out,
                                                                             incremental_state, sentence)
                if out is None and first:
                    return super().forward(prev_output_tokens, encoder_out, incremental_state, features_only)
                if out is None:
                    out = self.forward_step(tokens, torch.full((1,), position, device=tokens.device), encoder_out,
                                            incremental_state, sentence)
                return self.align_sentences((out, {"attn": [None], "inner_states": None}), prev_output_tokens,
                                            encoder_out, incremental_state)
            return super().forward(prev_output_tokens, encoder_out, incremental_state, features_only, **kwargs)
        if incremental_state is not None or encoder_out is not None or kwargs.get("return_all_hiddens"):
            raise ValueError("stream_state continues text streams in a language model: it takes neither an "
                             "incremental state, an encoder output nor return_all_hiddens")
        positions = None if self.embed_positions is None else self.embed_positions(prev_output_tokens)
        x = self._embed(prev_output_tokens, positions)
        pad = prev_output_tokens.eq(self.padding_idx)  # pads neither write nor decay the state
        for layer in self.layers:
            x, _, _ = layer(x, None, None, stream_state, self_attn_padding_mask=pad)
        x = self._features(x)
        return (x if features_only else self.output_layer(x)), {"attn": [None], "inner_states": [x]}

    def forward_step(self, tokens: Tensor, position: Tensor, encoder_out, incremental_state: IncrementalState,
                     sentence: Optional[Tensor] = None) -> Tensor:
        """One decoding step after the first: ``tokens [B, 1]`` at ``position`` (``[1]``: ``padding_idx`` + the tokens
        so far), the layers' states in ``incremental_state``, with ``--sentence-index`` the rows' sentence numbers
        ``sentence [B]``; returns ``[B, 1, V]``. Graph-ready: writes the causal states in place, reads the source only
        through the cross attention's state (``encoder_out``, unread, makes fairseq's layer run cross attention), reads
        nothing back to the host, keeps nothing it allocates."""
        positions = None
        if self.embed_positions is not None:
            positions = self._position_table().index_select(0, position)  # [1, C], the same for every row
            if sentence is not None:
                positions = positions + sentence_embedding(sentence, positions.size(-1)).to(positions.dtype)[:, None]
        x = self._embed(tokens, positions)
        enc = encoder_out["encoder_out"][0] if encoder_out is not None and encoder_out["encoder_out"] else None
        window = None  # --cross-sentence-window: the windows were cached in the first step
        if self.cross_sentence_window >= 0 and enc is not None:
            window = self.sentence_window(None, sentence[:, None])
        pad = tokens.eq(self.padding_idx)
        for layer in self.layers:
            x, _, _ = layer(x, enc, window, incremental_state, self_attn_padding_mask=pad)
        return self.output_layer(self._features(x))

    def _position_table(self) -> Tensor:
        ep = self.embed_positions
        return ep.weight if isinstance(ep, nn.Embedding) else ep.weights  # learned, or sinusoidal

    def _embed(self, tokens: Tensor, positions: Optional[Tensor]) -> Tensor:
        """fairseq's embedding of ``tokens [B, T]`` with ``positions`` (broadcast to ``[B, T, C]``): ``[T, B, C]``."""
        x = self.embed_scale * self.embed_tokens(tokens)
        if self.quant_noise is not None:
            x = self.quant_noise(x)
        if self.project_in_dim is not None:
            x = self.project_in_dim(x)
        if positions is not None:
            x = x + positions
        if self.layernorm_embedding is not None:
            x = self.layernorm_embedding(x)
        return self.dropout_module(x).transpose(0, 1)

    def _features(self, x: Tensor) -> Tensor:
        """The last layer's ``[T, B, C]`` to fairseq's features ``[B, T, C']``."""
        if self.layer_norm is not None:
            x = self.layer_norm(x)
        x = x.transpose(0, 1)
        return x if self.project_out_dim is None else self.project_out_dim(x)

    def buffered_future_mask(self, tensor):
        """None: RFA is causal by construction, and fairseq's T x T mask would only cost O(T^2) memory."""
        return None

    def extract_features_scriptable(self, prev_output_tokens, encoder_out=None, incremental_state=None,
                                    full_context_alignment: bool = False, alignment_layer=None, alignment_heads=None):
        if full_context_alignment:
            raise NotImplementedError("RFA decoder self-attention is always causal: full_context_alignment "
                                      "(alignment supervision) is not supported")
        return super().extract_features_scriptable(prev_output_tokens, encoder_out, incremental_state,
                                                   full_context_alignment, alignment_layer, alignment_heads)

    def upgrade_state_dict_named(self, state_dict, name):
        state_dict = super().upgrade_state_dict_named(state_dict, name)
        prefix = f"{name}." if name else ""
        version_key = prefix + "rfa_version"
        if version_key not in state_dict:
            attn = prefix + "layers.0.self_attn."
            if attn + "k_proj.weight" in state_dict and attn + "feature_map.sigma" not in state_dict:
                raise RuntimeError("this checkpoint holds a softmax-attention decoder; an RFA architecture cannot load "
                                   "it without an explicit conversion (its attention has no random features): "
                                   "rfa-convert-from-softmax --input SOFTMAX.pt --output RFA.pt [--rfa-gate] writes "
                                   "the RFA model with every shared weight copied, ready for --finetune-from-model")
            state_dict[version_key] = torch.tensor([RFA_CHECKPOINT_VERSION])
        elif int(state_dict[version_key][0]) > RFA_CHECKPOINT_VERSION:
            raise RuntimeError(f"checkpoint RFA format version {int(state_dict[version_key][0])} is newer than this "
                               f"rfa_fairseq ({RFA_CHECKPOINT_VERSION}); upgrade rfa_fairseq")
        return state_dict
