"""SoftmaxSelfAttention: fairseq's causal softmax self-attention (``--rfa-softmax-layers``), its decoding cache kept
in place.

fairseq's MultiheadAttention appends each step's key and value to its cache with ``torch.cat`` and gathers the
whole cache again in every beam reorder: two copies of the cache a step, which at long outputs cost more than the
attention. Here a step writes into room kept ahead (``ROOM`` tokens more whenever it is full) and a reorder gathers
the cache into a spare buffer kept beside it (as ``CausalRFAttention`` does): one copy. Outside decoding steps, and
in the numbers of a step, it is fairseq's module with the same weights.
"""
import torch
from fairseq.modules import MultiheadAttention

ROOM = 128  # tokens of room added to a full cache


class SoftmaxSelfAttention(MultiheadAttention):
    """fairseq's ``MultiheadAttention(self_attention=True)`` with the cache of the module docstring, in the
    incremental state as ``keys``, ``values`` ``[B, H, room, K]``, ``pads`` ``[B, room]`` (True: a pad, which no
    query attends to) and ``length``, the filled part, each tensor beside a ``spare_`` buffer for reorders."""

    def forward(self, query, key, value, key_padding_mask=None, incremental_state=None, need_weights=True,
                static_kv=False, attn_mask=None, before_softmax=False, need_head_weights=False):
        if incremental_state is None:
            return super().forward(query, key, value, key_padding_mask, incremental_state, need_weights, static_kv,
                                   attn_mask, before_softmax, need_head_weights)
        if query.size(0) != 1 or key is not query or value is not query or need_weights or need_head_weights \
                or static_kv or attn_mask is not None or before_softmax:
            raise ValueError("SoftmaxSelfAttention decodes one token a step, attending to itself and the tokens "
                             "before (no weights returned, no mask but padding), as fairseq's decoder layer calls it")
        B, H, K = query.size(1), self.num_heads, self.head_dim
        cache = self._get_input_buffer(incremental_state)
        n = cache.get("length", 0)
        if n == 0 or n == cache["keys"].size(2):  # full: ROOM more
            for name, shape, dtype in (("keys", (B, H, n + ROOM, K), query.dtype),
                                       ("values", (B, H, n + ROOM, K), query.dtype), ("pads", (B, n + ROOM), torch.bool)):
                room = query.new_empty(shape, dtype=dtype)
                if n:
                    filled(room, name, n).copy_(cache[name])
                cache[name], cache["spare_" + name] = room, None
        cache["keys"][:, :, n] = self.k_proj(query)[0].view(B, H, K)
        cache["values"][:, :, n] = self.v_proj(query)[0].view(B, H, K)
        cache["pads"][:, n] = False if key_padding_mask is None else key_padding_mask[:, -1]
        cache["length"] = n = n + 1
        keys, values = (cache[name][:, :, :n].view(B * H, n, K) for name in ("keys", "values"))  # views, no copy
        q = (self.q_proj(query) * self.scaling).view(B * H, 1, K)
        weights = torch.bmm(q, keys.transpose(1, 2)).view(B, H, 1, n)
        weights = weights.masked_fill(cache["pads"][:, None, None, :n], float("-inf"))
        probs = self.dropout_module(torch.softmax(weights.float(), dim=-1).type_as(weights))
        out = torch.bmm(probs.view(B * H, 1, n), values).view(1, B, H * K)
        self._set_input_buffer(incremental_state, cache)
        return self.out_proj(out), None

    def reorder_incremental_state(self, incremental_state, new_order):
        """Beam search: the filled part of each cache tensor's rows that the surviving hypotheses continue,
        gathered into its spare buffer (the two then swap roles; into its front when finished sentences shrink the
        batch)."""
        cache = self._get_input_buffer(incremental_state)
        n = cache.get("length", 0)
        if n:
            rows = new_order.numel()
            for name in ("keys", "values", "pads"):
                state, spare = cache[name], cache["spare_" + name]
                if spare is None or spare.size(0) < rows:
                    spare = state.new_empty((rows,) + state.shape[1:])
                torch.index_select(filled(state, name, n), 0, new_order, out=filled(spare[:rows], name, n))
                cache[name], cache["spare_" + name] = spare[:rows], state
            self._set_input_buffer(incremental_state, cache)
        return incremental_state


def filled(cache: torch.Tensor, name: str, length: int) -> torch.Tensor:
    """The first ``length`` tokens of the cache tensor ``name``: a view."""
    return cache.narrow(-1 if name == "pads" else -2, 0, length)
