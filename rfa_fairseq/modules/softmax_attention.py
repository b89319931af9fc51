"""fairseq's softmax attention, its weights and numbers, with leaner decoding caches: SoftmaxCrossAttention keeps
one copy of the source per sentence, not per beam; SoftmaxSelfAttention (``--rfa-softmax-layers``) writes a step into
room kept ahead (``ROOM`` tokens more when full) and gathers the filled part in a beam reorder (``beam.reorder_rows_``):
one copy of the cache a step, where fairseq's ``torch.cat`` and reorder make two.
"""
import torch
from fairseq.modules import MultiheadAttention

from .beam import reorder_rows_

ROOM = 128  # tokens of room added to a full cache


class SoftmaxCrossAttention(MultiheadAttention):
    """fairseq's ``MultiheadAttention(encoder_decoder_attention=True)``, whose ``set_beam_size`` (one copy of the
    source's keys and values per sentence, where fairseq's transformer caches one per beam: at long sources most of
    the decoding state) takes effect in incremental decoding only: fairseq's would apply it in every call, so a
    model that trains or scores after a beam search (validation BLEU) would attend to another sentence's source."""

    def forward(self, query, key, value, key_padding_mask=None, incremental_state=None, *args, **kwargs):
        beam = self.beam_size
        if incremental_state is None:
            self.beam_size = 1  # a whole target (training, scoring) has one row per sentence, not beams
        try:
            return super().forward(query, key, value, key_padding_mask, incremental_state, *args, **kwargs)
        finally:
            self.beam_size = beam


class SoftmaxSelfAttention(MultiheadAttention):
    """fairseq's ``MultiheadAttention(self_attention=True)``; its decoding cache: ``keys``, ``values`` ``[B, H, room,
    K]``, ``pads`` ``[B, room]`` (True: a pad) and ``length`` (the filled part), each beside a ``spare_`` buffer."""

    def forward(self, query, key, value, key_padding_mask=None, incremental_state=None, need_weights=True,
                static_kv=False, attn_mask=None, before_softmax=False, need_head_weights=False):
        if incremental_state is None:
            return super().forward(query, key, value, key_padding_mask, incremental_state, need_weights, static_kv,
                                   attn_mask, before_softmax, need_head_weights)
        if query.size(0) != 1 or not (key is query is value) or need_weights or need_head_weights or static_kv \
                or attn_mask is not None or before_softmax:
            raise ValueError("SoftmaxSelfAttention decodes one token a step, attending to itself and the tokens "
                             "before (no weights returned, no mask but padding), as fairseq's decoder layer calls it")
        B, H, K = query.size(1), self.num_heads, self.head_dim
        cache = self._get_input_buffer(incremental_state)
        n = cache.get("length", 0)
        if n == 0 or n == cache["keys"].size(2):  # full: ROOM more
            for name, size in (("keys", (B, H, n + ROOM, K)), ("values", (B, H, n + ROOM, K)), ("pads", (B, n + ROOM))):
                room = query.new_empty(size, dtype=torch.bool if name == "pads" else query.dtype)
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
        """Beam search: the filled part of the rows that the surviving hypotheses continue (``beam.reorder_rows_``)."""
        cache = self._get_input_buffer(incremental_state)
        n = cache.get("length", 0)
        if n:
            reorder_rows_(cache, ("keys", "values", "pads"), new_order, lambda name, t: filled(t, name, n))
            self._set_input_buffer(incremental_state, cache)
        return incremental_state


def filled(cache: torch.Tensor, name: str, length: int) -> torch.Tensor:
    """The first ``length`` tokens of the cache tensor ``name``: a view."""
    return cache.narrow(-1 if name == "pads" else -2, 0, length)
