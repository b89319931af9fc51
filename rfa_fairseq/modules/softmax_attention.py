"""fairseq's softmax cross attention, its weights and numbers, with a leaner decoding cache and, with a
:class:`SentenceWindow`, only the source sentences near the one being written (``--cross-sentence-window``)."""
from dataclasses import dataclass
from typing import Optional, Tuple

import torch
from fairseq.modules import MultiheadAttention
from torch import Tensor

from ..ops.sentence_window import window_mask, window_spans


@dataclass
class SentenceWindow:
    """What the decoder passes its layers for cross attention in place of the source's padding mask: sentence numbers
    of the source ``[B, Ts]`` (-1: pads; None after the first decoding step) and of the target inputs ``[B, Tt]``.
    A decoding step's first layer leaves in ``gather`` what every layer's gather reads (the same windows)."""
    source: Optional[Tensor]
    target: Tensor
    width: int
    gather: Optional[Tuple[Tensor, ...]] = None


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
        the window's W keys and values, one copy per source cached in the first step (``[S, H, Ts, 2K]``)."""
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
        if "window_kv" not in cache:  # the first step: one copy per source (a beam's rows are copies of one row)
            if window.source is None:
                raise ValueError("SentenceWindow: the first decoding step needs the source's sentence numbers")
            beam = self.beam_size if self.beam_size > 1 and key.size(1) == B else 1
            key = key.view(key.size(0), -1, beam, key.size(2))[:, :, 0]
            kv = torch.cat([proj(key).view(key.size(0), -1, H, K) for proj in (self.k_proj, self.v_proj)], -1)
            cache["window_kv"] = kv.permute(1, 2, 0, 3).contiguous()  # [S, H, Ts, 2K]: keys | values
            cache["window_spans"], width = window_spans(window.source[::beam], window.width)
            cache["window_offsets"] = torch.arange(width, device=key.device).repeat(key.size(1), 1)
            self._set_input_buffer(incremental_state, cache)
        if window.gather is None:
            window.gather = self._window_rows(cache, window.target[:, -1])
        rows, bias, at, valid = window.gather
        kv = cache["window_kv"].view(-1, 2 * K).index_select(0, rows).view(B * H, -1, 2 * K)
        scores = torch.baddbmm(bias, q.view(B * H, 1, K), kv[..., :K].transpose(1, 2))  # [B H, 1, W]
        probs = torch.softmax(scores.float(), -1).type_as(scores)
        out = self.out_proj(torch.bmm(probs, kv[..., K:]).view(1, B, H * K))
        if not (need_weights or need_head_weights):
            return out, None
        probs = probs.view(B, H, -1) * valid[:, None]
        weights = probs.new_zeros(B, H, cache["window_kv"].size(2)).scatter_add_(2, at[:, None].expand(-1, H, -1), probs)
        return out, weights.transpose(0, 1)[:, :, None] if need_head_weights else weights.mean(1)[:, None]

    def _window_rows(self, cache, target: Tensor) -> Tuple[Tensor, ...]:
        """For a step's rows' sentence numbers ``target [B]``: the rows of the cached ``[S H Ts, 2K]`` keys and
        values that each row and head reads (``[B H W]``: the window, then what follows it up to the widest window's
        length W), the scores' bias ``[B H, 1, W]`` (-inf past the window), and the positions ``at [B, W]`` and
        their validity, for the weights."""
        spans, offsets, Ts = cache["window_spans"], cache["window_offsets"][0], cache["window_kv"].size(2)
        B, H, device = target.size(0), self.num_heads, target.device
        source = torch.arange(B, device=device) // (B // spans.size(0))  # each row's source
        first, end = spans[source, target.clamp(max=spans.size(1) - 1)].unbind(-1)
        at = first.clamp(max=Ts - offsets.numel())[:, None] + offsets  # [B, W]
        valid = (at >= first[:, None]) & (at < end[:, None])
        rows = ((source[:, None] * H + torch.arange(H, device=device)) * Ts)[:, :, None] + at[:, None]
        bias = torch.zeros(B, H, 1, at.size(1), device=device).masked_fill_(~valid[:, None, None], float("-inf"))
        return rows.flatten(), bias.view(B * H, 1, -1), at, valid
