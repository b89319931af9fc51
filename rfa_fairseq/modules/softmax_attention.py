"""fairseq's softmax cross attention, its weights and numbers, with a leaner decoding cache: one copy of the source
per sentence, not per beam; with a :class:`SentenceWindow` it reads only the source sentences near the one being
written (``--cross-sentence-window``)."""
from dataclasses import dataclass
from typing import Optional

import torch
from fairseq.modules import MultiheadAttention
from torch import Tensor

from ..ops.sentence_window import window_mask, window_spans


@dataclass
class SentenceWindow:
    """What the decoder passes its layers for cross attention in place of the source's padding mask: sentence numbers
    of the source ``[B, Ts]`` (-1: pads; None after the first decoding step) and of the target inputs ``[B, Tt]``."""
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
        """``query [Tt, B, C]`` reads ``key [Ts, B, C]`` in its window: a full pass masks; a decoding step gathers
        the window's W keys and values, one copy per source cached in the first step (``[S, H, Ts, K]``)."""
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
