"""CrossRFAttention: RFA for the decoder's attention over the encoder output, a drop-in for fairseq's
MultiheadAttention in a decoder layer's ``encoder_attn`` slot, Time x Batch x Channel.

In decoding the source is summarised once into a state ``[S | z]`` ``[Bs, H, F, K + 1]`` (padding excluded), read at
O(F K) per query and head. A whole target at once (training, scoring) takes whichever of that summary and the
``[Tq, S]`` feature products costs fewer multiply-adds (``ops.quadratic_is_cheaper``): the same numbers either way.

Beam search (``modules/beam.py``): one state per sentence, which its beams read as one group of queries; reordering
is a no-op while the batch keeps its sentences, an index by sentence when finished ones are dropped."""
from typing import Dict, Optional, Tuple

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from ..ops import cross_rfa_apply, cross_rfa_quadratic, cross_rfa_state, cross_rfa_weights, quadratic_is_cheaper
from .beam import BeamLayout
from .heads import merge_heads, split_heads
from .rfa_attention_base import IncrementalState, RFAttentionBase


class CrossRFAttention(BeamLayout, RFAttentionBase):
    """Non-causal random feature attention from decoder queries (``embed_dim``) to encoder keys/values (``kdim``).
    ``recompute``: under autograd, without a decoding state or weights asked for, keep only the heads ``q, k, v`` for
    the backward pass."""

    STATE_KEY = "cross_rfa"

    def _source_state(self, key: Tensor, value: Tensor, key_padding_mask: Optional[Tensor], rows: int,
                      keep_keys: bool) -> Dict[str, Optional[Tensor]]:
        """What the queries read, from one copy of each source (every ``rows``-th row): the ``state``, or
        with ``keep_keys`` (weights asked for) the keys' features ``k``, the values ``v`` and the mask."""
        key, value = key[:, ::rows], value[:, ::rows]
        if key_padding_mask is not None:
            key_padding_mask = key_padding_mask[::rows]
        k = self.feature_map(split_heads(self.k_proj(key), self.num_heads))
        v = split_heads(self.v_proj(value), self.num_heads)
        if keep_keys:
            return {"k": k, "v": v, "key_padding_mask": key_padding_mask}
        return {"state": cross_rfa_state(k, v, key_padding_mask)}

    def forward(self, query: Tensor, key: Optional[Tensor], value: Optional[Tensor],
                key_padding_mask: Optional[Tensor] = None, incremental_state: Optional[IncrementalState] = None,
                need_weights: bool = False, static_kv: bool = True, attn_mask: Optional[Tensor] = None,
                before_softmax: bool = False, need_head_weights: bool = False) -> Tuple[Tensor, Optional[Tensor]]:
        """query: ``[Tq, B, C]``; key, value: ``[S, B, kdim]``; key_padding_mask: ``[B, S]``. Returns
        ``[Tq, B, C]`` and, if ``need_weights``, the implicit attention weights ``phi(q).phi(k_j) /
        max(phi(q).z, eps)``: ``[B, Tq, S]`` averaged over heads, or ``[H, B, Tq, S]`` with ``need_head_weights``."""
        if attn_mask is not None or before_softmax:
            raise ValueError("CrossRFAttention supports neither attn_mask nor before_softmax")
        need_weights = need_weights or need_head_weights
        saved = self.get_incremental_state(incremental_state, self.STATE_KEY)  # None without a decoding state
        from_source = saved is None or (need_weights and "k" not in saved)
        if key is None and from_source:
            raise ValueError("CrossRFAttention needs the encoder output (in decoding, on the first step)")
        value = key if value is None else value
        if incremental_state is None and not need_weights:
            heads = (split_heads(self.q_proj(query), self.num_heads), split_heads(self.k_proj(key), self.num_heads),
                     split_heads(self.v_proj(value), self.num_heads))
            if self.recompute and torch.is_grad_enabled():
                out = checkpoint(self._whole, *heads, key_padding_mask, query.dtype,
                                 self.feature_map.matrix_for_recompute(), use_reentrant=False, preserve_rng_state=False)
            else:
                out = self._whole(*heads, key_padding_mask, query.dtype)
            return self.out_proj(merge_heads(out)), None
        if from_source:
            rows = self.rows_per_source(query.size(1)) if incremental_state is not None else 1
            saved = self._source_state(key, value, key_padding_mask, rows, keep_keys=need_weights)
            self._set_input_buffer(incremental_state, saved)  # a no-op without a decoding state
        q = self.feature_map(split_heads(self.q_proj(query), self.num_heads))
        out = (cross_rfa_apply(q, saved["state"], eps=self.eps, out_dtype=query.dtype) if "state" in saved
               else cross_rfa_quadratic(q, saved["k"], saved["v"], saved["key_padding_mask"], self.eps, query.dtype))
        if not need_weights:
            return self.out_proj(merge_heads(out)), None
        weights = cross_rfa_weights(q, saved["k"], saved["key_padding_mask"], eps=self.eps)  # saved: the keys
        return self.out_proj(merge_heads(out)), weights.transpose(0, 1) if need_head_weights else weights.mean(dim=1)

    def _whole(self, q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Optional[Tensor], out_dtype: torch.dtype,
               random_matrix: Optional[Tensor] = None) -> Tensor:
        """Heads in, attention out ``[B, H, Tq, K]`` (without a decoding state or weights)."""
        phi_q, phi_k = (self.feature_map(t, random_matrix) for t in (q, k))
        if quadratic_is_cheaper(k.shape[2], phi_q.shape[-1], v.shape[-1], Tq=q.shape[2]):
            return cross_rfa_quadratic(phi_q, phi_k, v, key_padding_mask, self.eps, out_dtype)
        return cross_rfa_apply(phi_q, cross_rfa_state(phi_k, v, key_padding_mask), self.eps, out_dtype)

    def reorder_incremental_state(self, incremental_state: IncrementalState, new_order: Tensor):
        saved = self.get_incremental_state(incremental_state, self.STATE_KEY)
        # Nothing to move before the first step, nor while beams are reordered within their sentences.
        if saved is not None and next(iter(saved.values())).size(0) * self.beam_size != new_order.numel():
            index = self.source_order(new_order)
            saved = {name: None if t is None else t.index_select(0, index) for name, t in saved.items()}
            self._set_input_buffer(incremental_state, saved)
        return incremental_state
