"""CausalRFAttention: RFA / RFA-Gate self-attention for decoders and language models.

Drop-in for fairseq's MultiheadAttention in a decoder layer's ``self_attn`` slot (same call
signature). Layout: Time x Batch x Channel in and out. Causality is structural (the recurrence
only looks back), so the decoder's future mask adds nothing and is only checked for shape.

Incremental decoding keeps one state per layer, ``S [B, H, F, K]`` and ``z [B, H, F]`` packed as
one fp32 tensor ``[S | z]`` of shape ``[B, H, F, K + 1]`` (the layout of every op in ``ops``): its
size does not depend on how many tokens have been decoded. It lives in fairseq's incremental
state as ``{"state": ..., "reorder_buffer": ...}`` under this module's key (with, for the
inference step, the feature map's ``projection`` and ``phase``, made at a generation's first step).

A stateful language model (``tasks/stateful_lm.py``) gives each module a :class:`CarriedState`:
whole-sequence calls then start from the state the previous block of the same text left behind
and leave their own final state there, detached (truncated backpropagation through time).
"""
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from ..memory import trim_free_memory
from ..ops import chunk_causal_rfa, gaussian_recurrent_step, gaussian_step_weights, recurrent_causal_rfa_step
from ..ops.causal_rfa import DEFAULT_CHUNK_SIZE, DEFAULT_RECOMPUTE_SEGMENT, GATE_FORMS
from ..ops.denominator import DEFAULT_EPS, compute_dtype
from ..validation import non_negative_int
from .heads import merge_heads, split_heads
from .random_feature_map import RandomFeatureMap
from .rfa_attention_base import IncrementalState, RFAttentionBase, init_projection


class CarriedState:
    """The state a stateful language model carries from one block of its text streams to the next.

    ``state``: the state ``[B, H, F, K + 1]`` (fp32, detached; one row per stream) left by the
    last block, or None before the first. ``random_matrix``: the feature map's draw the state was
    built with. phi(q) can only read a state written with phi(k) of the same draw (with two
    independent draws the sum of phi(q).phi(k) estimates no kernel), so while a state is carried
    the module keeps that draw: in training the draw is renewed whenever the state starts afresh
    (the task starts every stream at the start of each epoch), not at every update.
    """

    def __init__(self):
        self.state: Optional[Tensor] = None
        self.random_matrix: Optional[Tensor] = None


def _drop_fused_projection(module, state_dict, prefix, local_metadata):
    """state_dict hook of a module with a fused ``in_proj``: its numbers are the separate layers'."""
    for key in [k for k in state_dict if k.startswith(prefix + "in_proj.")]:
        del state_dict[key]


def _fused_projection_loads_through_its_views(module, incompatible_keys):
    """load_state_dict hook, likewise: loading the separate layers writes ``in_proj`` through its views."""
    fused = [k for k in incompatible_keys.missing_keys if k.split(".")[-2:-1] == ["in_proj"]]
    for key in fused:
        incompatible_keys.missing_keys.remove(key)


class CausalRFAttention(RFAttentionBase):
    """Causal random feature attention, optionally gated (RFA-Gate).

    Args:
        embed_dim: model dimension ``C``; num_heads: ``H`` (``K = C / H``).
        feature_map: the :class:`RandomFeatureMap` shared by queries and keys.
        gate: learn ``g_t = sigmoid(w_g . x_t + b_g)`` per head and step.
        gate_form: ``"convex"``, the paper's ``S_t = g_t S_{t-1} + (1 - g_t) phi(k_t) v_t^T``, or
            ``"decay"``, ``S_t = g_t S_{t-1} + phi(k_t) v_t^T`` (the RFA slides, GLA).
        gate_bias: the initial ``b_g`` (2: ``g`` starts near 0.88, about eight tokens of memory;
            0, the paper's: near 0.5, about two tokens).
        recompute: under autograd, keep only the input ``x`` of a whole-sequence call for the
            backward pass, and compute the projections, feature maps and chunked form again
            there, instead of keeping their intermediates. Decoding is not affected.
        recompute_segment: under autograd, a whole sequence longer than this many tokens is
            recomputed in any case, and segment by segment: each segment's checkpoint keeps its
            input and the state entering it (``[B, H, F, K + 1]``), and the backward pass
            recomputes one segment at a time, so training memory grows with the length by the
            input alone. 0: no segments (a long sequence is recomputed only with ``recompute``,
            and then whole).
    """

    STATE_KEY = "causal_rfa"

    def __init__(self, embed_dim: int, num_heads: int, feature_map: RandomFeatureMap, gate: bool = False,
                 bias: bool = True, eps: float = DEFAULT_EPS, chunk_size: int = DEFAULT_CHUNK_SIZE,
                 recompute: bool = False, gate_form: str = "convex", gate_bias: float = 2.0,
                 recompute_segment: int = DEFAULT_RECOMPUTE_SEGMENT):
        super().__init__(embed_dim, num_heads, feature_map, bias=bias, eps=eps, recompute=recompute)
        if gate_form not in GATE_FORMS:
            raise ValueError(f"gate_form must be one of {GATE_FORMS}, got {gate_form!r}")
        non_negative_int("recompute_segment", recompute_segment)
        self.chunk_size, self.recompute_segment = chunk_size, recompute_segment
        self.convex = gate_form == "convex"
        self.gate_proj = nn.Linear(embed_dim, num_heads) if gate else None
        if self.gate_proj is not None:
            init_projection(self.gate_proj)
            nn.init.constant_(self.gate_proj.bias, gate_bias)
        self.carry: Optional[CarriedState] = None  # set by a stateful task, see CarriedState
        self.beam_size = 1  # hypotheses per sentence: fairseq's generator says so for beams above 1
        self.in_proj: Optional[nn.Linear] = None  # q, k, v and the gate in one layer: fuse_projections_

    def _input_projections(self):
        return [p for p in (self.q_proj, self.k_proj, self.v_proj, self.gate_proj) if p is not None]

    @torch.no_grad()
    def fuse_projections_(self):
        """For inference: one linear layer ``in_proj`` computes q, k, v and the gate in evaluation
        mode. A decoding step is a handful of rows, so each layer call costs about as much as its
        weight is large plus a fixed overhead (with int8 layers, also quantizing the input): one
        call instead of four pays the overhead once. The separate layers' parameters become views
        of the fused ones, so the two stay one set of numbers while neither is moved to another
        device or dtype; training mode uses the separate layers, and ``state_dict`` leaves
        ``in_proj`` out, so checkpoints keep their keys."""
        if self.in_proj is not None:
            return
        projs = self._input_projections()
        sizes = [p.out_features for p in projs]
        w = projs[0].weight
        fused = nn.Linear(self.embed_dim, sum(sizes), device=w.device, dtype=w.dtype)
        fused.weight.copy_(torch.cat([p.weight for p in projs]))
        fused.bias.copy_(torch.cat([p.weight.new_zeros(n) if p.bias is None else p.bias for p, n in zip(projs, sizes)]))
        for p, w_, b_ in zip(projs, fused.weight.split(sizes), fused.bias.split(sizes)):
            p.weight = nn.Parameter(w_, requires_grad=p.weight.requires_grad)
            if p.bias is not None:
                p.bias = nn.Parameter(b_, requires_grad=p.bias.requires_grad)
        self.in_proj, self.in_proj_sizes = fused, sizes
        self.register_state_dict_post_hook(_drop_fused_projection)
        self.register_load_state_dict_post_hook(_fused_projection_loads_through_its_views)

    def _heads(self, x: Tensor, key_padding_mask: Optional[Tensor]):
        """The heads ``q, k, v [B, H, T, K]`` (before the feature map), ``log g [B, H, T]`` (or
        None) and the padding ``[B, 1, T]`` (or None)."""
        if self.in_proj is not None and not self.training:
            qkvg = self.in_proj(x).split(self.in_proj_sizes, dim=-1)
        else:
            qkvg = [p(x) for p in self._input_projections()]
        q, k, v = (split_heads(y, self.num_heads) for y in qkvg[:3])
        log_g = pad = None
        if self.gate_proj is not None:
            log_g = F.logsigmoid(qkvg[3].to(compute_dtype(qkvg[3]))).permute(1, 2, 0)  # [B, H, T], fp32 (fp64 for fp64)
        if key_padding_mask is not None:
            # A padded step neither writes (k = 0) nor decays (log g = 0) the state.
            pad = key_padding_mask.to(torch.bool)[:, None, :]
            if log_g is not None:
                log_g = log_g.masked_fill(pad, 0.0)
        return q, k, v, log_g, pad

    def _features(self, q: Tensor, k: Tensor, pad: Optional[Tensor], random_matrix: Optional[Tensor] = None):
        """phi(q), phi(k) ``[B, H, T, F]``, with phi(k) = 0 at the pads. Queries and keys share
        the map, so they go through it as one batch."""
        B = q.size(0)
        qk = self.feature_map(torch.cat([q, k], dim=0), random_matrix)
        q, k = qk[:B], qk[B:]
        if pad is not None:
            k = k.masked_fill(pad.unsqueeze(-1), 0.0)
        return q, k

    def _project(self, x: Tensor, key_padding_mask: Optional[Tensor]):
        """The inputs of the ops: phi(q), phi(k) (0 at the pads), v and log g (or None)."""
        q, k, v, log_g, pad = self._heads(x, key_padding_mask)
        q, k = self._features(q, k, pad)
        return q, k, v, log_g

    def _chunked(self, q: Tensor, k: Tensor, v: Tensor, log_g: Optional[Tensor], pad: Optional[Tensor],
                 random_matrix: Optional[Tensor] = None, state: Optional[Tensor] = None, return_state: bool = False):
        """Heads in, attention out: features, then the chunked form from ``state`` (or zeros);
        with ``return_state``, ``(out, the final state)``."""
        q, k = self._features(q, k, pad, random_matrix)
        return chunk_causal_rfa(q, k, v, log_g, state=state, return_state=return_state, eps=self.eps,
                                chunk_size=self.chunk_size, convex=self.convex)

    def _segment(self, x: Tensor, key_padding_mask: Optional[Tensor], random_matrix: Optional[Tensor],
                 state: Optional[Tensor], return_state: bool = True):
        """Layer input in, attention out (heads, before ``out_proj``): projections, features and the
        chunked form from ``state``."""
        return self._chunked(*self._heads(x, key_padding_mask), random_matrix, state, return_state)

    def _whole(self, x: Tensor, key_padding_mask: Optional[Tensor], random_matrix: Optional[Tensor] = None,
               state: Optional[Tensor] = None, return_state: bool = False):
        """The whole sequence ``x [T, B, C]`` at once (training, scoring). Under autograd, with
        ``recompute`` or for a sequence longer than ``recompute_segment``, through checkpoints, one
        per segment, that keep only the segment's input (a view of ``x``) and the entering state
        for the backward pass: the projections, features and chunked form are computed again
        there, from a copy of this step's random matrix. Keeping the input rather than the heads
        is what brings the layer's training memory to softmax's: fairseq's attention keeps ``x``,
        ``q``, ``k``, ``v`` and its output; this keeps ``x`` and the output."""
        T = x.size(0)
        segment = self.recompute_segment or T
        if not torch.is_grad_enabled() or not (self.recompute or T > segment):
            if torch.is_grad_enabled():
                trim_free_memory()
            return self._segment(x, key_padding_mask, random_matrix, state, return_state)
        if random_matrix is None:
            random_matrix = self.feature_map.matrix_for_recompute()
        masks = [None] * -(-T // segment) if key_padding_mask is None else key_padding_mask.split(segment, dim=1)
        outs = []
        for x_, m_ in zip(x.split(segment, dim=0), masks):
            # Training's peak is at the end of the forward pass, with the holes the segments' freed
            # temporaries leave in malloc's heap; the backward pass frees more than it takes, so it
            # is not trimmed (--rfa-malloc-trim, rfa_fairseq/memory.py).
            trim_free_memory()
            out, state = checkpoint(self._segment, x_, m_, random_matrix, state, use_reentrant=False,
                                    preserve_rng_state=False)
            outs.append(out)
        out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
        return (out, state) if return_state else out

    def forward(
        self,
        query: Tensor,
        key: Optional[Tensor] = None,
        value: Optional[Tensor] = None,
        key_padding_mask: Optional[Tensor] = None,
        incremental_state: Optional[IncrementalState] = None,
        need_weights: bool = False,
        static_kv: bool = False,
        attn_mask: Optional[Tensor] = None,
        before_softmax: bool = False,
        need_head_weights: bool = False,
    ) -> Tuple[Tensor, Optional[Tensor]]:
        """query: ``[T, B, C]``; key_padding_mask: ``[B, T]`` (True = pad).

        Three modes: a decoding step (``incremental_state``), a block of a carried stream
        (``self.carry``, set by a stateful task), or a whole sequence. Returns ``([T, B, C], None)``:
        RFA has no attention matrix to return for self-attention (``need_weights`` is accepted for
        compatibility and yields None).
        """
        if (key is not None and key is not query) or (value is not None and value is not query):
            raise ValueError("CausalRFAttention is self-attention: key and value must be the query tensor")
        if static_kv or before_softmax:
            raise ValueError("CausalRFAttention supports neither static_kv nor before_softmax")
        T = query.size(0)
        if attn_mask is not None and tuple(attn_mask.shape[-2:]) != (T, T):
            raise ValueError(f"attn_mask must be the {T}x{T} causal mask, got shape {tuple(attn_mask.shape)}")
        if incremental_state is not None and T == 1 and key_padding_mask is None and self._takes_gaussian_step():
            return self.out_proj(self._decode_token(incremental_state, query)), None
        if incremental_state is not None:
            out = self._decode(incremental_state, *self._project(query, key_padding_mask))
        elif self.carry is not None:
            out = self._continue_streams(query, key_padding_mask)
        else:
            out = self._whole(query, key_padding_mask)
        return self.out_proj(merge_heads(out)), None

    def _continue_streams(self, x: Tensor, key_padding_mask: Optional[Tensor]) -> Tensor:
        """A block of each carried stream: start from the state the previous block left and leave
        this block's final state, detached, with the random draw it was written with (see
        :class:`CarriedState`)."""
        carry = self.carry
        if carry.state is None:
            carry.random_matrix = self.feature_map.matrix_for_recompute()  # this step's draw
        elif carry.state.size(0) != x.size(1):
            raise ValueError(f"the carried RFA state has {carry.state.size(0)} rows but this batch has {x.size(1)}: "
                             "each row of a stateful batch continues one text stream")
        out, state = self._whole(x, key_padding_mask, carry.random_matrix, carry.state, return_state=True)
        carry.state = state.detach()
        return out

    def _takes_gaussian_step(self) -> bool:
        """Whether a decoding step can take :meth:`_decode_token`: at inference (the fused
        projection, evaluation mode, no autograd) with the ``gaussian`` kernel."""
        return (self.in_proj is not None and not self.training and not torch.is_grad_enabled()
                and self.feature_map.kernel == "gaussian")

    def _decode_token(self, incremental_state: IncrementalState, x: Tensor) -> Tensor:
        """One token ``x [1, B, C]`` of fairseq-generate, without padding: :meth:`_decode` in
        fewer ops (``ops.gaussian_recurrent_step``), read from the fused projection's output
        ``[q | k | v | gate logit]`` by views. The step's projection is made from the feature map
        at a generation's first step and kept beside the state, so a new generation always reads
        the module's current matrix. Returns ``[1, B, C]``, before ``out_proj``."""
        B, C, H, K = x.size(1), self.embed_dim, self.num_heads, self.head_dim
        y = self.in_proj(x[0])
        buffer = self._get_input_buffer(incremental_state)
        if "projection" not in buffer:
            buffer["projection"], buffer["phase"] = gaussian_step_weights(
                self.feature_map.random_matrix, self.feature_map.sigma, compute_dtype(y))
        o, buffer["state"] = gaussian_recurrent_step(
            y[:, :2 * C].view(B, 2, H, K), y[:, 2 * C:3 * C].view(B, H, K),
            None if self.gate_proj is None else y[:, 3 * C:], buffer.get("state"),
            buffer["projection"], buffer["phase"], eps=self.eps, convex=self.convex)
        self._set_input_buffer(incremental_state, buffer)
        return o.view(1, B, C)

    def _decode(self, incremental_state: IncrementalState, q: Tensor, k: Tensor, v: Tensor,
                log_g: Optional[Tensor]) -> Tensor:
        """Advance this layer's state by the new tokens (their features ``q``, ``k``) and read them
        out: one token by the recurrent step, several (a prompt) by the chunked form."""
        buffer = self._get_input_buffer(incremental_state)
        state = buffer.get("state")
        if q.size(2) == 1:
            # The state was made by this module (a step, the chunked form or a reorder's gather),
            # so without autograd it is ours to update in place.
            o, state = recurrent_causal_rfa_step(q[:, :, 0], k[:, :, 0], v[:, :, 0],
                                                 None if log_g is None else log_g[:, :, 0], state,
                                                 eps=self.eps, inplace=not torch.is_grad_enabled(), convex=self.convex)
            out = o.unsqueeze(2)
        else:
            out, state = chunk_causal_rfa(q, k, v, log_g, state=state, return_state=True, eps=self.eps,
                                          chunk_size=self.chunk_size, convex=self.convex)
        buffer["state"] = state
        self._set_input_buffer(incremental_state, buffer)
        return out

    def set_beam_size(self, beam_size: int):
        """Called through the model by fairseq's SequenceGenerator (see reorder_incremental_state)."""
        self.beam_size = beam_size

    def reorder_incremental_state(self, incremental_state: IncrementalState, new_order: Tensor):
        """Beam search: keep the state rows that the surviving hypotheses continue.

        As fairseq's MultiheadAttention does for its key/value cache, but without autograd the
        rows are gathered into a buffer kept beside the state (the two then swap roles), so a
        decoding step allocates no new state-sized memory. When finished sentences shrink the
        batch, the smaller state is gathered into the front of the larger buffer, so shrinking
        allocates nothing either (a fresh state-sized tensor is mapped and zeroed page by page by
        the operating system). With one hypothesis per sentence (beam 1, as fairseq's generator
        says through ``set_beam_size``) an order that keeps the batch size keeps every row where
        it is, and nothing is copied; the order itself is never read on the host.
        """
        buffer = self._get_input_buffer(incremental_state)
        state = buffer.get("state")
        if state is None:
            return incremental_state
        rows = new_order.numel()
        if self.beam_size == 1 and rows == state.size(0):
            return incremental_state
        if torch.is_grad_enabled() or state.requires_grad:
            buffer["state"] = state.index_select(0, new_order)
            buffer.pop("reorder_buffer", None)
        else:
            memory = buffer.pop("reorder_buffer", None)  # flat: room for at least as many rows as the state had
            numel = rows * state[0].numel()
            if memory is None or memory.numel() < numel:
                memory = state.new_empty(numel)
            buffer["state"] = torch.index_select(state, 0, new_order, out=memory[:numel].view((rows,) + state.shape[1:]))
            buffer["reorder_buffer"] = state.reshape(-1)  # the old rows are no longer needed
        self._set_input_buffer(incremental_state, buffer)
        return incremental_state
