"""CausalRFAttention: RFA / RFA-Gate self-attention for decoders and language models.

Drop-in for fairseq's MultiheadAttention in a decoder layer's ``self_attn`` slot (same call signature), Time x Batch x
Channel. Causality is structural (the recurrence only looks back): the decoder's future mask is only checked for shape.

One linear layer, ``in_proj``, computes q, k, v and the gate's logit; a short convolution (``short_conv``) may mix each
of q, k, v with the few before it. With an incremental state the module keeps its op's state under its key,
``{"state": [S | z]}`` (and ``"conv"``, the convolution's last inputs), beside spare buffers for beam reorders; their
size does not depend on the tokens before. One token is a recurrent step (pads masked in it, nothing read back to the
host); several (a prompt, a stateful language model's next block) go through the chunked form from the state and leave
their final state there."""
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from ..ops import chunk_causal_rfa, fla_causal_rfa, recurrent_causal_rfa_step
from ..ops.causal_rfa import DEFAULT_CHUNK_SIZE, DEFAULT_RECOMPUTE_SEGMENT, GATE_FORMS
from ..ops.causal_rfa.fla import BACKENDS, fla_chosen
from ..ops.denominator import DEFAULT_EPS, compute_dtype
from ..validation import non_negative_int, one_of
from .beam import BeamLayout, reorder_rows_
from .heads import merge_heads
from .random_feature_map import RandomFeatureMap
from .rfa_attention_base import IncrementalState, RFAttentionBase, init_projection


def deferrable(state: Optional[Tensor]) -> bool:
    """Whether beam search's reorder of ``state`` can wait for the next step: a float32 CPU state, no autograd."""
    return (state is not None and state.dtype == torch.float32 and state.device.type == "cpu"
            and not torch.is_grad_enabled() and not state.requires_grad)


class CausalRFAttention(BeamLayout, RFAttentionBase):
    """Causal random feature attention, optionally gated (RFA-Gate: ``g_t = sigmoid(w_g . x_t + b_g)`` per head and
    step, ``b_g`` starting at ``gate_bias`` (spread over the heads from it to ``gate_bias_last`` where given), in the
    form ``gate_form``: ``ops.naive_causal_rfa``). ``embed_dim``: ``C``; ``num_heads``: ``H`` (``K = C / H``);
    ``feature_map``: shared by queries and keys. The other arguments are the
    ``--rfa-*`` flags of ``config.py``: ``recompute`` and ``recompute_segment`` act on multi-token calls under autograd
    (:meth:`_tokens`), ``backend`` picks a multi-token call's kernels (``fla_chosen``; one-token steps are torch's),
    ``short_conv`` is the width of :meth:`_convolve` (0: none)."""

    STATE_KEY = "causal_rfa"

    def __init__(self, embed_dim: int, num_heads: int, feature_map: RandomFeatureMap, gate: bool = False,
                 eps: float = DEFAULT_EPS, chunk_size: int = DEFAULT_CHUNK_SIZE, recompute: bool = False,
                 gate_form: str = "convex", gate_bias: float = 2.0, recompute_segment: int = DEFAULT_RECOMPUTE_SEGMENT,
                 backend: str = "torch", gate_bias_last: Optional[float] = None, short_conv: int = 0):
        super().__init__(embed_dim, num_heads, feature_map, eps=eps, recompute=recompute)
        self.gated, self.convex = gate, one_of("gate_form", gate_form, GATE_FORMS) == "convex"
        self.recompute_segment = non_negative_int("recompute_segment", recompute_segment)
        self.backend, self.chunk_size = one_of("backend", backend, BACKENDS), chunk_size
        self.short_conv = non_negative_int("short_conv", short_conv)
        self.conv = nn.Conv1d(3 * embed_dim, 3 * embed_dim, short_conv, groups=3 * embed_dim) if short_conv else None
        self.state_names = ["state", "conv"] if short_conv else ["state"]  # the incremental buffer's tensors
        projections = [self.q_proj, self.k_proj, self.v_proj]
        if gate:
            gate_proj = nn.Linear(embed_dim, num_heads)
            init_projection(gate_proj)
            with torch.no_grad():  # head h: a memory of about 1 + e^bias tokens
                gate_proj.bias.copy_(torch.linspace(gate_bias, gate_bias if gate_bias_last is None else gate_bias_last,
                                                    num_heads))
            projections.append(gate_proj)
        del self.q_proj, self.k_proj, self.v_proj
        # one layer, their outputs side by side and their weights copied (skip_init: no random draw, so the draws
        # after it are those of the separate layers' initialisation)
        self.in_proj = nn.utils.skip_init(nn.Linear, embed_dim, sum(m.out_features for m in projections))
        with torch.no_grad():
            self.in_proj.weight.copy_(torch.cat([m.weight for m in projections]))
            self.in_proj.bias.copy_(torch.cat([m.bias for m in projections]))

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        """Checkpoints with separate ``q_proj``, ``k_proj``, ``v_proj`` (and ``gate_proj``) load into ``in_proj``."""
        for part in ("weight", "bias"):
            keys = [f"{prefix}{name}.{part}" for name in ("q_proj", "k_proj", "v_proj", "gate_proj")[:3 + self.gated]]
            if all(key in state_dict for key in keys):
                state_dict[f"{prefix}in_proj.{part}"] = torch.cat([state_dict.pop(key) for key in keys])
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def _convolve(self, qkv: Tensor, pad: Optional[Tensor], past: Optional[Tensor]) -> Tuple[Tensor, Tensor]:
        """The short convolution over time, a filter per channel: ``out[t] = bias + sum_j w[j] qkv[t - W + 1 + j]``
        for ``qkv [T, B, 3C]`` after ``past [B, W - 1, 3C]``, the inputs before (None: zeros). Pads (``pad [B, T]``)
        at the start are zero inputs, as a sequence's start is; pads at the end are left out of the last W - 1 inputs,
        which it returns beside the output (a one-token call at a pad keeps ``past``)."""
        if pad is not None:
            qkv = qkv.masked_fill(pad.t().unsqueeze(-1), 0.0)
        T, B, D = qkv.shape
        past = qkv.new_zeros(B, self.short_conv - 1, D) if past is None else past
        inputs = torch.cat([past.transpose(0, 1), qkv])  # [W - 1 + T, B, 3C]
        out = F.conv1d(inputs.permute(1, 2, 0), self.conv.weight, self.conv.bias, groups=D).permute(2, 0, 1)
        if pad is None:
            return out, inputs[T:].transpose(0, 1)
        end = T - pad.flip(1).cumprod(1).sum(1)  # [B]: the tokens up to the last one that is not a pad
        rows = end[:, None] + torch.arange(self.short_conv - 1, device=end.device)  # the last W - 1 inputs' rows
        return out, inputs.transpose(0, 1).gather(1, rows[:, :, None].expand(-1, -1, D))

    def _inputs(self, x: Tensor, key_padding_mask: Optional[Tensor], random_matrix: Optional[Tensor] = None,
                past: Optional[Tensor] = None):
        """What this module's op takes, from ``x [T, B, C]`` by one projection (and the convolution from ``past``):
        ``q, k [B, H, T, F]`` (phi(k) = 0 at the pads), ``v [B, H, T, K]``, ``log g [B, H, T]`` (or None; 0 at the
        pads) and the convolution's last inputs (or None)."""
        T, B, C = x.shape
        y = self.in_proj(x)
        qkv = y[..., :3 * C]
        if self.conv is not None:
            qkv, past = self._convolve(qkv, None if key_padding_mask is None else key_padding_mask.bool(), past)
        qkv = qkv.view(T, B, 3, self.num_heads, self.head_dim).permute(2, 1, 3, 0, 4)
        # the gate's log [B, H, T], fp32 (fp64 for fp64)
        log_g = F.logsigmoid(y[..., 3 * C:].to(compute_dtype(y))).permute(1, 2, 0) if self.gated else None
        q, k = self.feature_map(qkv[:2], random_matrix)  # queries and keys share the map: one call
        if key_padding_mask is not None:  # a padded step neither writes (k = 0) nor decays (log g = 0) the state
            pad = key_padding_mask.unsqueeze(1).bool()
            log_g = None if log_g is None else log_g.masked_fill(pad, 0.0)
            k = k.masked_fill(pad.unsqueeze(-1), 0.0)
        return q, k, qkv[2], log_g, past

    def _segment(self, x: Tensor, key_padding_mask: Optional[Tensor], random_matrix: Optional[Tensor],
                 state, past, output_final_state: bool):
        """Layer input in; attention heads (before ``out_proj``), the final state and the convolution's last inputs
        out, by the chunked form."""
        q, k, v, log_g, past = self._inputs(x, key_padding_mask, random_matrix, past)
        op, kw = (fla_causal_rfa, {}) if self._fla(x) else (chunk_causal_rfa, dict(chunk_size=self.chunk_size))
        return *op(q, k, v, log_g, state, output_final_state, eps=self.eps, convex=self.convex, **kw), past

    def _fla(self, x: Tensor) -> bool:
        return fla_chosen(self.backend, x.device, self.gated)

    def _tokens(self, x: Tensor, key_padding_mask: Optional[Tensor], state: Optional[Tensor] = None,
                past: Optional[Tensor] = None, output_final_state: bool = False):
        """Tokens ``x [T, B, C]`` at once from ``state`` and ``past`` (training, scoring, prompts): the heads, the final
        state (or None) and the convolution's last inputs (or None). Under autograd, with ``recompute`` or past
        ``recompute_segment`` tokens, one checkpoint per segment keeps only its input (a view of ``x``) and entering
        state and past; the backward pass recomputes the rest from a copy of this step's random matrix.
        Keeping ``x`` rather than the heads brings training memory to softmax's (fairseq's attention keeps ``x``,
        ``q``, ``k``, ``v`` and its output; this, ``x`` and the output)."""
        T = x.size(0)
        segment = T if self._fla(x) else self.recompute_segment or T
        if not torch.is_grad_enabled() or not (self.recompute or T > segment):
            return self._segment(x, key_padding_mask, None, state, past, output_final_state)
        random_matrix = self.feature_map.matrix_for_recompute()
        masks = [None] * -(-T // segment) if key_padding_mask is None else key_padding_mask.split(segment, dim=1)
        outs = []
        for x_, m_ in zip(x.split(segment, dim=0), masks):
            out, state, past = checkpoint(self._segment, x_, m_, random_matrix, state, past, True, use_reentrant=False,
                                          preserve_rng_state=False)
            outs.append(out)
        return (outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)), (state if output_final_state else None), past

    def _step(self, x: Tensor, key_padding_mask: Optional[Tensor], state, past) -> Tuple[Tensor, Tensor, Tensor]:
        """One token ``x [1, B, C]``: ``out [B, C]`` (the heads side by side), the state, advanced in place without
        autograd (the state was made by this module: a step, the chunked form or a reorder), and the convolution's
        last inputs. :meth:`_inputs` in fewer operators (they set a step's time)."""
        B, C, H, K = x.size(1), self.embed_dim, self.num_heads, self.head_dim
        pad = None if key_padding_mask is None else key_padding_mask.bool()  # [B, 1]: a pad neither writes nor decays
        y = self.in_proj(x[0])  # [B, 3C (+ H)]
        qkv = y[:, :3 * C] if pad is None or self.conv is None else y[:, :3 * C].masked_fill(pad, 0.0)
        if self.conv is not None:  # :meth:`_convolve` of one token in fewer operators: its last W inputs at once
            past = qkv.new_zeros(B, self.short_conv - 1, 3 * C) if past is None else past
            inputs = torch.cat([past, qkv[:, None]], 1)  # [B, W, 3C]
            qkv = (inputs * self.conv.weight[:, 0].t()).sum(1) + self.conv.bias
            past = inputs[:, 1:] if pad is None else torch.where(pad[:, :, None], past, inputs[:, 1:])
        q, k = self.feature_map(qkv[:, :2 * C].view(B, 2, H, 1, K)).squeeze(-2).unbind(1)  # [B, H, F] each
        log_g = F.logsigmoid(y[:, 3 * C:].to(compute_dtype(y))) if self.gated else None  # [B, H]
        if pad is not None:
            k = k.masked_fill(pad[:, :, None], 0.0)
            log_g = None if log_g is None else log_g.masked_fill(pad, 0.0)
        v = qkv[:, 2 * C:].view(B, H, K)
        out, state = recurrent_causal_rfa_step(q, k, v, log_g, state, eps=self.eps, convex=self.convex,
                                               inplace=not torch.is_grad_enabled())
        return out.view(B, C), state, past

    def forward(self, query: Tensor, key: Optional[Tensor] = None, value: Optional[Tensor] = None,
                key_padding_mask: Optional[Tensor] = None, incremental_state: Optional[IncrementalState] = None,
                need_weights: bool = False, static_kv: bool = False, attn_mask: Optional[Tensor] = None,
                before_softmax: bool = False, need_head_weights: bool = False) -> Tuple[Tensor, Optional[Tensor]]:
        """query: ``[T, B, C]``; key_padding_mask: ``[B, T]`` (True = pad); returns ``([T, B, C], None)``."""
        if (key is not None and key is not query) or (value is not None and value is not query):
            raise ValueError("CausalRFAttention is self-attention: key and value must be the query tensor")
        if static_kv or before_softmax:
            raise ValueError("CausalRFAttention supports neither static_kv nor before_softmax")
        T = query.size(0)
        if attn_mask is not None and tuple(attn_mask.shape[-2:]) != (T, T):
            raise ValueError(f"attn_mask must be the {T}x{T} causal mask, got shape {tuple(attn_mask.shape)}")
        if incremental_state is None:
            return self.out_proj(merge_heads(self._tokens(query, key_padding_mask)[0])), None
        buffer = self._get_input_buffer(incremental_state)
        parents = buffer.pop("parents", None)  # a reorder deferred
        if parents is not None:
            reorder_rows_(buffer, self.state_names, parents)
        state, past = buffer.get("state"), buffer.get("conv")
        if T == 1:  # a decoding step
            out, state, past = self._step(query, key_padding_mask, state, past)
        else:
            out, state, past = self._tokens(query, key_padding_mask, state, past, True)
        buffer["state"] = state
        if past is not None:
            buffer["conv"] = past
        self._set_input_buffer(incremental_state, buffer)
        return self.out_proj(out[None] if T == 1 else merge_heads(out)), None

    def reorder_incremental_state(self, incremental_state: IncrementalState, new_order: Tensor):
        """Beam search: the state rows the hypotheses continue (beam 1, same batch: none). On the CPU without autograd
        deferred, ``new_order`` kept in the buffer as ``parents`` (composed with one pending) for the next step to
        gather (the compiled step, in its pass over the state); else ``reorder_rows_`` now."""
        buffer = self._get_input_buffer(incremental_state)
        state, pending = buffer.get("state"), buffer.get("parents")
        rows = None if state is None else state.size(0) if pending is None else pending.numel()
        if state is None or (self.beam_size == 1 and new_order.numel() == rows):
            return incremental_state
        if deferrable(state):
            buffer["parents"] = new_order if pending is None else pending.index_select(0, new_order)
        else:
            reorder_rows_(buffer, self.state_names, new_order)
        self._set_input_buffer(incremental_state, buffer)
        return incremental_state

    def extra_repr(self) -> str:
        gate = f"gate={'convex' if self.convex else 'decay'}" if self.gated else "gate=None"
        return f"heads={self.num_heads}, {gate}, backend={self.backend}"
