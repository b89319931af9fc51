"""fairseq's softmax attention, its weights and numbers, with leaner decoding caches: SoftmaxCrossAttention keeps
one copy of the source per sentence, not per beam, and with a :class:`SentenceWindow` reads only the source sentences
near the one being written (``--cross-sentence-window``); SoftmaxSelfAttention (``--rfa-softmax-layers``) writes a
step into room kept ahead (``ROOM`` tokens more when full) and gathers the filled part in a beam reorder
(``beam.reorder_rows_``): one copy of the cache a step, where fairseq's ``torch.cat`` and reorder make two.
"""
from dataclasses import dataclass
from typing import Optional

import torch
from fairseq.modules import MultiheadAttention
from torch import Tensor

from ..ops.sentence_window import window_mask, window_spans
from .beam import reorder_rows_

ROOM = 128  # tokens of room added to a full cache


@dataclass
class SentenceWindow:
    """``--cross-sentence-window``: what the decoder passes to its layers in place of the source's padding mask (a
    layer hands it on to its cross attention): each source token's sentence number ``source [B, Ts]`` (-1: a pad;
    None in decoding steps after the first, which read the windows cached then), each target input's ``target [B,
    Tt]``, and the window's ``width`` K (ops/sentence_window.py)."""
    source: Optional[Tensor]
    target: Tensor
    width: int


class SoftmaxCrossAttention(MultiheadAttention):
    """fairseq's ``MultiheadAttention(encoder_decoder_attention=True)``, whose ``set_beam_size`` (one copy of the
    source's keys and values per sentence, where fairseq's transformer caches one per beam: at long sources most of
    the decoding state) takes effect in incremental decoding only: fairseq's would apply it in every call, so a
    model that trains or scores after a beam search (validation BLEU) would attend to another sentence's source.
    Given a :class:`SentenceWindow` as ``key_padding_mask`` it reads only each target position's window."""

    def forward(self, query, key, value, key_padding_mask=None, incremental_state=None, *args, **kwargs):
        if isinstance(key_padding_mask, SentenceWindow):
            return self._windowed(query, key, key_padding_mask, incremental_state, kwargs.get("need_weights", True),
                                  kwargs.get("need_head_weights", False))
        beam = self.beam_size
        if incremental_state is None:
            self.beam_size = 1  # a whole target (training, scoring) has one row per sentence, not beams
        try:
            return super().forward(query, key, value, key_padding_mask, incremental_state, *args, **kwargs)
        finally:
            self.beam_size = beam

    def _windowed(self, query: Tensor, key: Tensor, window: SentenceWindow, incremental_state, need_weights: bool,
                  need_head_weights: bool):
        """``query [Tt, B, C]`` reads the source ``key [Ts, B, C]`` (keys and values alike) in its window: a full
        pass masks the whole product; a decoding step (``Tt`` = 1) gathers the window's W keys and values, cached in
        the first step per source (``window_keys``, ``window_values`` ``[S, H, Ts, K]``; ``window_spans`` ``[S, J,
        2]``; ``window_offsets``, ``0 .. W - 1`` ``[S, W]``), each beam's row reading its sentence's copy."""
        T, B, H, K = query.size(0), query.size(1), self.num_heads, self.head_dim
        q = (self.q_proj(query) * self.scaling).view(T, B, H, K)
        if incremental_state is None:
            keys, values = (proj(key).view(key.size(0), B, H, K) for proj in (self.k_proj, self.v_proj))
            scores = torch.einsum("tbhk,sbhk->bhts", q, keys)
            allowed = window_mask(window.source, window.target, window.width)
            scores = scores.masked_fill(~allowed[:, None], float("-inf"))
            probs = torch.softmax(scores.float(), -1).type_as(scores)
            out = torch.einsum("bhts,sbhk->tbhk", self.dropout_module(probs), values)
            weights = probs.transpose(0, 1) if need_weights or need_head_weights else None  # [H, B, Tt, Ts]
            return self.out_proj(out.reshape(T, B, H * K)), (
                weights if need_head_weights or weights is None else weights.mean(0))
        cache = self._get_input_buffer(incremental_state)
        if "window_keys" not in cache:  # the first step: one copy per source (a beam's rows are copies of one row)
            if window.source is None:
                raise ValueError("SentenceWindow: the first decoding step needs the source's sentence numbers")
            beam = self.beam_size if self.beam_size > 1 and key.size(1) == B else 1
            key = key.view(key.size(0), -1, beam, key.size(2))[:, :, 0]
            for name, proj in (("window_keys", self.k_proj), ("window_values", self.v_proj)):
                cache[name] = proj(key).view(key.size(0), -1, H, K).permute(1, 2, 0, 3).contiguous()
            cache["window_spans"], width = window_spans(window.source[::beam], window.width)
            cache["window_offsets"] = torch.arange(width, device=key.device).repeat(key.size(1), 1)
            self._set_input_buffer(incremental_state, cache)
        spans, offsets, Ts = cache["window_spans"], cache["window_offsets"][0], cache["window_keys"].size(2)
        source = torch.arange(B, device=query.device) // (B // spans.size(0))  # each row's source
        first, end = spans[source, window.target[:, -1].clamp(max=spans.size(1) - 1)].unbind(-1)
        at = first.clamp(max=Ts - offsets.numel())[:, None] + offsets  # [B, W]: the window, then what follows
        valid = (at >= first[:, None]) & (at < end[:, None])
        rows = ((source[:, None] * H + torch.arange(H, device=query.device)) * Ts)[:, :, None] + at[:, None]
        keys, values = (cache[name].view(-1, K).index_select(0, rows.flatten()).view(B * H, -1, K)
                        for name in ("window_keys", "window_values"))
        scores = torch.bmm(keys, q.view(B * H, K, 1)).view(B, H, -1).masked_fill(~valid[:, None], float("-inf"))
        probs = torch.softmax(scores.float(), -1).type_as(scores)
        out = self.out_proj(torch.bmm(probs.view(B * H, 1, -1), values).view(1, B, H * K))
        if not (need_weights or need_head_weights):
            return out, None
        weights = probs.new_zeros(B, H, Ts).scatter_add_(2, at[:, None].expand(-1, H, -1), probs * valid[:, None])
        return out, weights.transpose(0, 1)[:, :, None] if need_head_weights else weights.mean(1)[:, None]


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
