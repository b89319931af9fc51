"""``--cross-sentence-window K``: a target position in sentence ``j`` reads the source sentences ``j - K .. j + K``,
``j`` clamped to the source's last (sentence numbers: models/sentence_index.py; a source's pads are -1). The full pass
masks (``window_mask``, the reference); a decoding step gathers a span per source and number (``window_spans``)."""
from typing import Tuple

import torch
from torch import Tensor


def window_mask(source: Tensor, target: Tensor, width: int) -> Tensor:
    """``source [B, Ts]``, ``target [B, Tt]`` sentence numbers: ``[B, Tt, Ts]``, True where target t reads source s."""
    current = torch.minimum(target, source.amax(1, keepdim=True))
    return (source[:, None, :] - current[:, :, None]).abs().le(width) & source.ge(0)[:, None, :]


def window_spans(source: Tensor, width: int) -> Tuple[Tensor, int]:
    """``source [S, Ts]``'s windows for sentence numbers ``0 .. J - 1`` (J: the batch's most sentences; past a source's
    last, its last sentence's window, as ``window_mask``), one span each (tokens lie between pads): ``spans [S, J, 2]``
    (``[first, last + 1)``) and the widest window's length, read to the host once per source batch."""
    numbers = torch.arange(int(source.amax()) + 1, device=source.device).expand(source.size(0), -1)
    allowed = window_mask(source, numbers, width)
    count, first = allowed.sum(-1), allowed.to(torch.uint8).argmax(-1)  # argmax: the first of the maxima
    span = torch.arange(source.size(1), device=source.device)
    if not torch.equal(allowed, (span >= first[..., None]) & (span < (first + count)[..., None])):
        raise ValueError("--cross-sentence-window: a source has pads between its tokens (fairseq pads at one end)")
    return torch.stack([first, first + count], -1), int(count.amax())
