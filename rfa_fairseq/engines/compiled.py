"""Decoding steps as the project's own compiled layers (``--compiled-step``; CPU, float32 or int8 weights).

At a few rows a decoding step is bound by its operators' dispatch and by the bytes of the weights it reads, not by
attention's arithmetic. :class:`CompiledStep` runs :meth:`RFATransformerDecoder.forward_step` as one C++ call
(``compiled_step.cpp``: per layer the causal RFA block, the cross-attention block, the FFN, then the output projection),
reading the modules' weights, copied once when the engine is made (``int8``: the products by weight matrices of at
least ``int8_min_weights`` numbers in int8, one scale per output, packed once: by a loop of compiled_step.cpp's own
(AVX-512 VNNI or AVX2) up to the products where oneDNN's kernels pay (``OWN_MACS``), by oneDNN above; the causal states
in float16, half the bytes a step reads and writes).
The modules stay the model and each block's reference (tests/engines/test_compiled_step.py).

With ``--task rfa_translation`` the whole beam search is one C++ call (:meth:`CompiledStep.generate`, fairseq's
hypotheses: tests/tasks/test_translation.py), after fairseq's encoder.

The beam's reorder is folded into the step: each causal layer defers ``new_order``
(``parents`` in its buffer) and the step gathers the parents' rows as it reads the state, writing the advanced state
into the spare buffer beside it. The first step starts each causal state at zero and has each cross attention cache
its source as the module does in its first step (:meth:`CompiledStep._first_step`). A step the engine does not run
(autograd, another device or dtype) runs eagerly; a model it cannot run (another feature map, adaptive softmax,
fairseq's optional scalings) is refused when the engine is made, naming what it lacks."""
import math
import time
from pathlib import Path
from typing import Optional

import torch
from fairseq import utils
from torch import Tensor, nn

from ..extensions import build
from ..models import rfa_decoder
from ..models.sentence_index import sentence_embedding
from ..modules import CausalRFAttention, CrossRFAttention, SoftmaxCrossAttention

# the kinds of cross attention, as compiled_step.cpp numbers them
SOFTMAX, WINDOW, RFA = 0, 1, 2


def load():
    """The compiled module, or None where it cannot be built (one warning)."""
    return build(Path(__file__).with_name("compiled_step.cpp"), "rfa_compiled_step")


def _linear(weights: dict, name: str, module: nn.Linear):
    weights[name + ".weight"] = module.weight.detach().float().contiguous()
    if module.bias is not None:
        weights[name + ".bias"] = module.bias.detach().float().contiguous()


def _norm(weights: dict, numbers: dict, name: str, module: nn.LayerNorm):
    _linear(weights, name, module)
    numbers[name + ".eps"] = float(module.eps)


def _features(attention) -> Tensor:
    """The gaussian kernel's projection ``[H, K, D]`` (sigma folded in) of an attention module's feature map."""
    feature_map = attention.feature_map
    if feature_map.kernel != "gaussian":
        raise ValueError(f"--compiled-step computes the gaussian kernel's features, not --rfa-kernel "
                         f"{feature_map.kernel}")
    projection, _ = feature_map.inference_weights(torch.float32)  # [H, K, 2 D]: the matrix twice
    return projection[..., :feature_map.num_features].contiguous()


def _gelu(layer: nn.Module) -> float:
    """1.0 where a layer's FFN activation is gelu, 0.0 where relu."""
    activations = {utils.get_activation_fn(name): name for name in ("relu", "gelu")}
    if layer.activation_fn not in activations:
        raise ValueError("--compiled-step compiles the FFN activations relu and gelu only")
    return float(activations[layer.activation_fn] == "gelu")


def _layer(layer: nn.Module, window: bool):
    """One decoder layer's weights and settings, as compiled_step.cpp's Decoder reads them (``window``: its softmax
    cross attention reads the sentence window's span)."""
    for name in ("c_attn", "attn_ln", "ffn_layernorm", "w_resid"):
        if getattr(layer, name, None) is not None:
            raise ValueError(f"--compiled-step: fairseq's optional {name} (--scale-*) is not compiled")
    attention = layer.self_attn
    if not isinstance(attention, CausalRFAttention):
        raise ValueError("--compiled-step runs RFA decoders (not --decoder-attention softmax)")
    if attention.conv is not None:
        raise ValueError("--compiled-step: --rfa-short-conv is not compiled")
    weights, numbers = {"self_attn.projection": _features(attention)}, {
        "normalize_before": float(layer.normalize_before), "gelu": _gelu(layer),
        "self_attn.gated": float(attention.gated), "self_attn.convex": float(attention.convex),
        "self_attn.eps": float(attention.eps)}
    for name in ("self_attn.in_proj", "self_attn.out_proj", "fc1", "fc2"):
        _linear(weights, name, layer.get_submodule(name))
    for name in ("self_attn_layer_norm", "final_layer_norm"):
        _norm(weights, numbers, name, getattr(layer, name))
    cross = layer.encoder_attn
    if cross is not None:
        for name in ("q_proj", "out_proj"):
            _linear(weights, f"encoder_attn.{name}", getattr(cross, name))
        _norm(weights, numbers, "encoder_attn_layer_norm", layer.encoder_attn_layer_norm)
        numbers["encoder_attn.heads"] = float(cross.num_heads)
        if isinstance(cross, CrossRFAttention):
            weights["encoder_attn.projection"] = _features(cross)
            numbers.update({"encoder_attn.kind": RFA, "encoder_attn.scaling": 1.0, "encoder_attn.eps": cross.eps})
        elif isinstance(cross, SoftmaxCrossAttention):
            numbers.update({"encoder_attn.kind": WINDOW if window else SOFTMAX, "encoder_attn.scaling": cross.scaling,
                            "encoder_attn.eps": 0.0})
        else:
            raise ValueError(f"--compiled-step: cross attention {type(cross).__name__} is not compiled")
    return weights, numbers


class CompiledStep:
    """The decoder's step engine (``decoder.step_engine``, called as :class:`StepGraphs` is): the step's scores from
    compiled_step.cpp, or None where the step is to run eagerly."""

    def __init__(self, decoder: nn.Module, int8: bool = False, int8_min_weights: int = 0):
        if not hasattr(decoder, "forward_step"):
            raise ValueError("--compiled-step runs RFA's fixed-size decoding step: it needs an RFA decoder "
                             "(not --decoder-attention softmax, whose cache grows every step)")
        for name in ("adaptive_softmax", "quant_noise"):
            if getattr(decoder, name, None) is not None:
                raise ValueError(f"--compiled-step: the decoder's {name} is not compiled")
        if not isinstance(decoder.embed_tokens, nn.Embedding):
            raise ValueError(f"--compiled-step: the token embedding {type(decoder.embed_tokens).__name__} "
                             "(--adaptive-input, --character-embeddings) is not compiled")
        start = time.perf_counter()
        self.decoder, self.op, self.int8, self.int8_min_weights = decoder, load(), int8, int8_min_weights
        self.state_dtype = torch.float16 if int8 else torch.float32  # int8: the causal states in float16 too
        self.layers = list(decoder.layers)
        self.engine = None if self.op is None else self._build(int8, int8_min_weights)
        self.setup_seconds = time.perf_counter() - start  # loading (first on a machine: building) the C++, packing

    def _build(self, int8: bool, int8_min_weights: int):
        d, weights = self.decoder, {}
        numbers = {"embed_scale": float(d.embed_scale), "padding_idx": float(d.padding_idx)}
        weights["embed_tokens.weight"] = d.embed_tokens.weight.detach().float().contiguous()
        if d.sentence_separator is not None and d.embed_positions is not None:  # a sentence's number < its tokens'
            weights["sentence_table"] = sentence_embedding(torch.arange(d.max_positions() + 1), d.embed_dim).contiguous()
        for name in ("output_projection", "project_in_dim", "project_out_dim"):
            if getattr(d, name, None) is not None:
                _linear(weights, name, getattr(d, name))
        for name in ("layernorm_embedding", "layer_norm"):
            if getattr(d, name, None) is not None:
                _norm(weights, numbers, name, getattr(d, name))
        layers = [_layer(layer, d.cross_sentence_window >= 0) for layer in self.layers]
        return self.op.Decoder(weights, numbers, [w for w, _ in layers], [n for _, n in layers],
                               int8_min_weights if int8 else -1)

    def __call__(self, tokens: Tensor, position: int, encoder_out, incremental_state,
                 sentence: Optional[Tensor] = None) -> Optional[Tensor]:
        rows = tokens.size(0)
        if self.engine is None or torch.is_grad_enabled() or tokens.device.type != "cpu":
            return None
        if not incremental_state:
            self._first_step(rows, encoder_out, incremental_state)
        buffers, caches, parents = [], [], None
        for layer in self.layers:
            buffer = layer.self_attn._get_input_buffer(incremental_state)
            state = buffer.get("state")
            if state is None or state.dtype != self.state_dtype or not state.is_contiguous():
                return None
            cache = self._cache(layer.encoder_attn, incremental_state, encoder_out)
            if cache is None:
                return None
            buffers.append(buffer)
            caches.append(cache)
        states, spares = [], []
        for layer, buffer in zip(self.layers, buffers):  # the advanced states go to the spare buffers
            state, spare, pending = buffer["state"], buffer.get("spare_state"), buffer.pop("parents", None)
            parents = pending if pending is not None else parents
            if spare is None or spare.size(0) < rows or spare.shape[1:] != state.shape[1:]:
                spare = state.new_empty((max(rows, state.size(0)),) + state.shape[1:])
            spare = spare if spare.size(0) == rows else spare[:rows]
            buffer["state"], buffer["spare_state"] = spare, state
            layer.self_attn._set_input_buffer(incremental_state, buffer)
            states.append(state)
            spares.append(spare)
        d = self.decoder
        table = d._position_table() if d.embed_positions is not None else None
        parents = torch.arange(rows) if parents is None else parents
        return self.engine.step(tokens[:, 0], position, table, sentence, parents, states, spares, caches)[:, None]

    def generate(self, search, net_input: dict, max_len: int) -> Optional[list]:
        """fairseq's hypotheses for the sources of ``net_input`` by the beam search of ``search``
        (:class:`tasks.translation.CompiledSearch`, its settings): fairseq's encoder, then the whole search in one C++
        call (``Decoder::generate``); None where the engine does not run it."""
        src = net_input["src_tokens"]
        if self.engine is None or torch.is_grad_enabled() or src.device.type != "cpu":
            return None
        encoder_out, sources = search.model.forward_encoder(net_input)[0], src.size(0)  # a cache row per source
        d, caches, state = self.decoder, [], {}
        d.set_beam_size(1)  # the modules' caches of the rows they are given (a fairseq search sets its beam again)
        self._first_step(sources, encoder_out, state, state_rows=1)  # one zero state, read by every row
        for layer in self.layers:
            caches.append(self._cache(layer.encoder_attn, state, encoder_out))
        initial = [layer.self_attn._get_input_buffer(state)["state"] for layer in self.layers]
        table, sentences = None, {}
        if d.embed_positions is not None:
            if d.padding_idx + max_len + 1 >= d._position_table().size(0):  # a too short sinusoidal table grows
                d.embed_positions(torch.zeros(1, max_len + 1, dtype=torch.long), incremental_state={})
            table = d._position_table()
        bias = torch.zeros(len(d.dictionary))  # what fairseq's search writes into every step's log-probabilities
        bias[search.unk] = -search.unk_penalty
        bias[search.pad] = -math.inf
        if getattr(search, "token_indices_to_suppress", None) is not None:
            bias[search.token_indices_to_suppress] = -math.inf
        numbers = {"sources": sources, "beam": search.beam_size, "max_len": max_len, "min_len": search.min_len,
                   "eos": search.eos, "temperature": search.temperature,
                   "separator": -1 if d.sentence_separator is None else d.sentence_separator}
        if d.sentence_alignment:
            sentences = {name: each.repeat_interleave(search.beam_size, 0)  # each hypothesis its source's
                         for name, each in d.source_sentences(encoder_out).items()}
            numbers.update(sentence_min=d.sentence_min, length_a=rfa_decoder.SENTENCE_LENGTH[0],
                           length_b=rfa_decoder.SENTENCE_LENGTH[1], forbidden_eos=rfa_decoder.FORBIDDEN_EOS)
        found = []
        for hypotheses in self.engine.generate(initial, caches, table, bias, numbers, sentences.get("length"),
                                               sentences.get("last")):
            hypotheses = [{"tokens": tokens, "positional_scores": scores, "attention": torch.empty(0),
                           "alignment": torch.empty(0), "score": total / tokens.numel() ** search.len_penalty
                           if search.normalize_scores else total} for tokens, scores, total in hypotheses]
            order = torch.sort(torch.tensor([float(h["score"]) for h in hypotheses]), descending=True)[1]
            found.append([hypotheses[i] for i in order])  # best first, as fairseq sorts them
        return found

    def _first_step(self, rows: int, encoder_out, incremental_state, state_rows: Optional[int] = None):
        """The caches the first step reads: each causal state at zero (as the eager first step starts it; ``state_rows``
        rows, else ``rows``), each cross attention's source cache made by the module itself, called as the layer calls
        it (its output for a query of zeros unused)."""
        enc = encoder_out["encoder_out"][0] if encoder_out is not None and encoder_out["encoder_out"] else None
        source_mask = None
        if enc is not None:
            source_mask = encoder_out["encoder_padding_mask"][0] if encoder_out["encoder_padding_mask"] else None
            if self.decoder.cross_sentence_window >= 0:  # the windows of the first target sentence's rows
                source_mask = self.decoder.sentence_window(encoder_out, enc.new_zeros(rows, 1, dtype=torch.long))
        for layer in self.layers:
            attn, features = layer.self_attn, layer.self_attn.feature_map
            attn._set_input_buffer(incremental_state, {"state": torch.zeros(
                state_rows or rows, features.num_heads, features.output_dim, features.head_dim + 1,
                dtype=self.state_dtype)})
            if layer.encoder_attn is not None and enc is not None:
                layer.encoder_attn(enc.new_zeros(1, rows, layer.embed_dim), enc, enc, key_padding_mask=source_mask,
                                   incremental_state=incremental_state, static_kv=True, need_weights=False)

    @staticmethod
    def _cache(cross, incremental_state, encoder_out):
        """A cross attention's decoding cache as compiled_step.cpp reads it (``[]`` without one; None: not cached)."""
        if cross is None or encoder_out is None:
            return []
        saved = cross._get_input_buffer(incremental_state)
        if isinstance(cross, CrossRFAttention):
            return [saved["state"]] if "state" in saved else None
        if "window_kv" in saved:
            return [saved["window_kv"], saved["window_spans"].contiguous()]
        if saved.get("prev_key") is None:
            return None
        for name in ("prev_key", "prev_value"):  # fairseq caches a transposed view: copied once, kept in the cache
            if not saved[name].is_contiguous():
                saved[name] = saved[name].contiguous()
        keys, mask = [saved["prev_key"], saved["prev_value"]], saved.get("prev_key_padding_mask")
        return keys if mask is None else keys + [mask.bool().contiguous()]
