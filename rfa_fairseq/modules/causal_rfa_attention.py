"""CausalRFAttention: RFA / RFA-Gate self-attention for decoders and language models.

Drop-in for fairseq's MultiheadAttention in a decoder layer's ``self_attn`` slot (same call
signature), Time x Batch x Channel. Causality is structural (the recurrence only looks back), so
the decoder's future mask adds nothing and is only checked for shape.

With an incremental state the module keeps one fp32 state per layer, ``[S | z]`` ``[B, H, F, K + 1]``
(``S [B, H, F, K]``, ``z [B, H, F]``: the layout of every op in ``ops``), as ``{"state": ...,
"reorder_buffer": ...}`` under this module's key; its size does not depend on the tokens before. One
token is a recurrent step; several (a prompt, a stateful language model's next block) go through
the chunked form from the state and leave their final state there.

``rfa_fairseq.inference`` converts the module into its decoding form: one linear layer ``in_proj``
for q, k, v and the gate, and the ``gaussian`` feature map precomputed (``ops.gaussian_step_weights``).
"""
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from ..ops import chunk_causal_rfa, gaussian_step_features, recurrent_causal_rfa_step
from ..ops.causal_rfa import DEFAULT_CHUNK_SIZE, DEFAULT_RECOMPUTE_SEGMENT, GATE_FORMS
from ..ops.causal_rfa.fla import BACKENDS, fla_causal_rfa, fla_chosen
from ..ops.causal_rfa.window import WindowState, empty_window_state, window_causal_rfa, window_causal_rfa_step
from ..ops.denominator import DEFAULT_EPS, as_dtype, compute_dtype
from ..validation import non_negative_int, one_of
from .beam import BeamLayout
from .heads import merge_heads, split_heads
from .random_feature_map import RandomFeatureMap
from .rfa_attention_base import IncrementalState, RFAttentionBase, init_projection


class CausalRFAttention(BeamLayout, RFAttentionBase):
    """Causal random feature attention, optionally gated (RFA-Gate).

    Args:
        embed_dim: model dimension ``C``; num_heads: ``H`` (``K = C / H``).
        feature_map: the :class:`RandomFeatureMap` shared by queries and keys.
        gate: learn ``g_t = sigmoid(w_g . x_t + b_g)`` per head and step.
        gate_form: ``"convex"``, the paper's ``S_t = g_t S_{t-1} + (1 - g_t) phi(k_t) v_t^T``, or
            ``"decay"``, ``S_t = g_t S_{t-1} + phi(k_t) v_t^T`` (the RFA slides, GLA).
        gate_bias: the initial ``b_g`` (2: ``g`` starts near 0.88, about eight tokens of memory;
            0, the paper's: near 0.5, about two tokens).
        recompute: under autograd, keep only the input ``x`` of a multi-token call for the backward
            pass, which computes the projections, feature maps and chunked form again.
        recompute_segment: under autograd, a sequence of more tokens than this is recomputed by segments,
            each checkpoint keeping its input and entering state (``[B, H, F, K + 1]``), so training memory
            grows with the length by the input alone. 0: no segments.
        local_window: ``W > 0``: each query weighs its last ``W`` keys by the exact kernel, older keys by their
            features (``ops/causal_rfa/window.py``); the incremental state then also keeps those keys and values.
        backend: the kernels of a multi-token call: ``torch`` (the chunked form, any device), ``fla``
            (fla-core's Triton kernels, ``ops/causal_rfa/fla.py``; their memory is linear in the length, so no
            segments are recomputed) or ``auto`` (fla where ``ops.causal_rfa.fla.fla_chosen`` says). One-token
            steps and the local window are torch's on every backend.
    """

    STATE_KEY = "causal_rfa"

    def __init__(self, embed_dim: int, num_heads: int, feature_map: RandomFeatureMap, gate: bool = False,
                 bias: bool = True, eps: float = DEFAULT_EPS, chunk_size: int = DEFAULT_CHUNK_SIZE,
                 recompute: bool = False, gate_form: str = "convex", gate_bias: float = 2.0,
                 recompute_segment: int = DEFAULT_RECOMPUTE_SEGMENT, local_window: int = 0, backend: str = "torch"):
        super().__init__(embed_dim, num_heads, feature_map, bias=bias, eps=eps, recompute=recompute)
        if gate_form not in GATE_FORMS:
            raise ValueError(f"gate_form must be one of {GATE_FORMS}, got {gate_form!r}")
        non_negative_int("recompute_segment", recompute_segment)
        self.local_window = non_negative_int("local_window", local_window)
        self.backend = one_of("backend", backend, BACKENDS)
        if self.backend == "fla" and self.local_window:
            raise ValueError("the fla backend has no local window: use --rfa-backend torch or auto with "
                             "--rfa-local-window")
        self.chunk_size, self.recompute_segment = chunk_size, recompute_segment
        self.gated, self.convex = gate, gate_form == "convex"
        self.gate_proj = nn.Linear(embed_dim, num_heads) if gate else None
        if self.gate_proj is not None:
            init_projection(self.gate_proj)
            nn.init.constant_(self.gate_proj.bias, gate_bias)
        # The decoding form's (see the module docstring); never saved.
        self.in_proj: Optional[nn.Linear] = None
        self.register_buffer("step_projection", None, persistent=False)
        self.register_buffer("step_phase", None, persistent=False)

    def _heads(self, x: Tensor, key_padding_mask: Optional[Tensor]):
        """The heads ``q, k, v [B, H, T, K]`` (before the feature map), ``log g [B, H, T]`` (or
        None) and the padding ``[B, 1, T]`` (or None)."""
        if self.in_proj is not None:
            qkvg = self.in_proj(x).split([self.embed_dim] * 3 + [self.num_heads] * self.gated, dim=-1)
        else:
            qkvg = [p(x) for p in (self.q_proj, self.k_proj, self.v_proj, self.gate_proj) if p is not None]
        q, k, v = (split_heads(y, self.num_heads) for y in qkvg[:3])
        log_g = pad = None
        if self.gated:
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

    def _project(self, x: Tensor, key_padding_mask: Optional[Tensor], random_matrix: Optional[Tensor] = None):
        """The inputs of the ops: phi(q), phi(k) (0 at the pads), v and log g (or None)."""
        q, k, v, log_g, pad = self._heads(x, key_padding_mask)
        return (*self._features(q, k, pad, random_matrix), v, log_g)

    def _segment(self, x: Tensor, key_padding_mask: Optional[Tensor], random_matrix: Optional[Tensor],
                 state: Optional[Tensor], output_final_state: bool):
        """Layer input in; attention heads (before ``out_proj``) and the final state out, by the chunked form."""
        if self.local_window:
            q, k, v, log_g, pad = self._heads(x, key_padding_mask)
            fm = self.feature_map
            return window_causal_rfa(fm.scale(q), fm.scale(k), v, log_g, fm.kernel, fm.matrix(random_matrix),
                                     self.local_window, state, output_final_state, pad, eps=self.eps,
                                     convex=self.convex, chunk_size=self.chunk_size)
        q, k, v, log_g = self._project(x, key_padding_mask, random_matrix)
        if self._fla(x):
            return fla_causal_rfa(q, k, v, log_g, state, output_final_state, eps=self.eps, convex=self.convex)
        return chunk_causal_rfa(q, k, v, log_g, state, output_final_state, eps=self.eps, convex=self.convex,
                                chunk_size=self.chunk_size)

    def _fla(self, x: Tensor) -> bool:
        return not self.local_window and fla_chosen(self.backend, x.device, self.gated)

    def _tokens(self, x: Tensor, key_padding_mask: Optional[Tensor], state: Optional[Tensor] = None,
                output_final_state: bool = False) -> Tuple[Tensor, Optional[Tensor]]:
        """Tokens ``x [T, B, C]`` at once from ``state`` (training, scoring, prompts). Under autograd, with
        ``recompute`` or past ``recompute_segment`` tokens, one checkpoint per segment keeps only its input
        (a view of ``x``) and entering state; the backward pass recomputes the rest from a copy of this
        step's random matrix. Keeping ``x`` rather than the heads brings training memory to softmax's
        (fairseq's attention keeps ``x``, ``q``, ``k``, ``v`` and its output; this, ``x`` and the output)."""
        T = x.size(0)
        segment = T if self._fla(x) else self.recompute_segment or T
        if not torch.is_grad_enabled() or not (self.recompute or T > segment):
            return self._segment(x, key_padding_mask, None, state, output_final_state)
        random_matrix = self.feature_map.matrix_for_recompute()
        masks = [None] * -(-T // segment) if key_padding_mask is None else key_padding_mask.split(segment, dim=1)
        outs = []
        for x_, m_ in zip(x.split(segment, dim=0), masks):
            out, state = checkpoint(self._segment, x_, m_, random_matrix, state, True, use_reentrant=False,
                                    preserve_rng_state=False)
            outs.append(out)
        return (outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)), (state if output_final_state else None)

    def _step(self, x: Tensor, state: Optional[Tensor]) -> Tuple[Tensor, Tensor]:
        """One token ``x [B, C]``: ``out [B, H, K]`` and the state, advanced in place without
        autograd (the state was made by this module: a step, the chunked form or a reorder)."""
        if self.local_window:
            q, k, v, log_g, _ = self._heads(x.unsqueeze(0), None)
            fm, B, H = self.feature_map, x.size(0), self.num_heads
            if state is None:
                state = empty_window_state(B, H, fm.output_dim, self.head_dim, self.local_window, v)
            return window_causal_rfa_step(fm.scale(q)[:, :, 0], fm.scale(k)[:, :, 0], v[:, :, 0],
                                          None if log_g is None else log_g[:, :, 0], fm.kernel, fm.matrix(), state,
                                          eps=self.eps, convex=self.convex, inplace=not torch.is_grad_enabled())
        if self.step_projection is not None:  # the decoding form of the gaussian kernel: views of in_proj's output
            B, C, H, K = x.size(0), self.embed_dim, self.num_heads, self.head_dim
            y = self.in_proj(x)
            q, k = gaussian_step_features(y[:, :2 * C].view(B, 2, H, K), self.step_projection, self.step_phase).unbind(1)
            v = y[:, 2 * C:3 * C].view(B, H, K)
            log_g = F.logsigmoid(as_dtype(y[:, 3 * C:], compute_dtype(y))) if self.gated else None
        else:
            q, k, v, log_g = self._project(x.unsqueeze(0), None)
            q, k, v = q[:, :, 0], k[:, :, 0], v[:, :, 0]
            log_g = None if log_g is None else log_g[:, :, 0]
        return recurrent_causal_rfa_step(q, k, v, log_g, state, eps=self.eps, convex=self.convex,
                                         inplace=not torch.is_grad_enabled())

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
        """query: ``[T, B, C]``; key_padding_mask: ``[B, T]`` (True = pad). With ``incremental_state``,
        the tokens continue this module's state there and leave it advanced. Returns ``([T, B, C], None)``:
        there is no attention matrix to return (``need_weights`` is accepted for compatibility)."""
        if (key is not None and key is not query) or (value is not None and value is not query):
            raise ValueError("CausalRFAttention is self-attention: key and value must be the query tensor")
        if static_kv or before_softmax:
            raise ValueError("CausalRFAttention supports neither static_kv nor before_softmax")
        if self.training and self.in_proj is not None:
            raise RuntimeError("this module was converted for inference (rfa_fairseq.inference) and cannot train: "
                               "load the checkpoint again")
        T = query.size(0)
        if attn_mask is not None and tuple(attn_mask.shape[-2:]) != (T, T):
            raise ValueError(f"attn_mask must be the {T}x{T} causal mask, got shape {tuple(attn_mask.shape)}")
        if incremental_state is None:
            return self.out_proj(merge_heads(self._tokens(query, key_padding_mask)[0])), None
        buffer = self._get_input_buffer(incremental_state)
        state = buffer.get("state")
        if self.local_window and state is not None:
            state = WindowState(state, buffer["window_keys"], buffer["window_values"], buffer["window_start"])
        if T == 1 and key_padding_mask is None:  # a decoding step: [B, H, K] is [1, B, C] by a view
            out, state = self._step(query[0], state)
            out = out.view(query.shape)
        else:
            out, state = self._tokens(query, key_padding_mask, state, True)
            out = merge_heads(out)
        if self.local_window:
            state, buffer["window_keys"], buffer["window_values"], buffer["window_start"] = state
        buffer["state"] = state
        self._set_input_buffer(incremental_state, buffer)
        return self.out_proj(out), None

    def reorder_incremental_state(self, incremental_state: IncrementalState, new_order: Tensor):
        """Beam search: keep the state rows that the surviving hypotheses continue.

        Without autograd the rows are gathered into a buffer kept beside the state (the two then swap
        roles; into its front when finished sentences shrink the batch), so a step allocates no
        state-sized memory (which the operating system would zero page by page). With one hypothesis
        per sentence an order that keeps the batch size keeps every row in place (``modules/beam.py``)."""
        buffer = self._get_input_buffer(incremental_state)
        state = buffer.get("state")
        if state is None:
            return incremental_state
        rows = new_order.numel()
        if self.beam_size == 1 and rows == state.size(0):
            return incremental_state
        for name in ("window_keys", "window_values"):
            if name in buffer:
                buffer[name] = buffer[name].index_select(0, new_order)
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
