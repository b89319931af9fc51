"""``--sentence-index``: each token's place in a document (``scripts/make_documents.py``'s ``<sep>`` between sentences)
added to its input, so that cross attention can find the source sentence the decoder is writing. A source token's
number counts the separators before it; a target input's counts those written up to and including it (after a
``<sep>`` the decoder writes the next sentence). The embedding is fairseq's sinusoids at that number less their value
at 0: sentence 0, and text without separators, gets nothing (a model trained on sentences is unchanged by the flag)."""
import functools
import math

import torch
from torch import Tensor, nn

SEPARATOR = "<sep>"


def separator_index(dictionary, side: str) -> int:
    index = dictionary.index(SEPARATOR)
    if index == dictionary.unk():
        raise ValueError(f"--sentence-index counts {SEPARATOR} tokens, and the {side} dictionary has none: prepare the "
                         "documents with scripts/make_documents.py and a joined dictionary")
    return index


@functools.lru_cache(maxsize=None)
def _frequencies(half: int, device: torch.device) -> Tensor:
    return torch.exp(torch.arange(half, device=device) * -(math.log(10000.0) / max(half - 1, 1)))


def sentence_embedding(index: Tensor, dim: int) -> Tensor:
    """Sentence numbers ``[...]`` to ``[..., dim]`` float32 (fairseq's sinusoidal layout: sines, then cosines)."""
    angle = index.unsqueeze(-1).float() * _frequencies(dim // 2, index.device)
    return nn.functional.pad(torch.cat([angle.sin(), angle.cos() - 1], -1), (0, dim % 2))


def sentence_numbers(tokens: Tensor, separator: int, written: bool) -> Tensor:
    """``[B, T]`` tokens to their sentence numbers: separators before each (``written``: up to and including it)."""
    is_sep = tokens.eq(separator).long()
    return is_sep.cumsum(1) - (0 if written else is_sep)


def sentence_length_ratios(source: Tensor, target: Tensor, separator: int) -> Tensor:
    """A training pair's (each side ending with ``</s>``, its sentences split by separators) target sentences' tokens
    (without their separator or ``</s>``) over their source sentences' (with it): the share of its source sentence's
    length at which sentence-aligned decoding may end each (``sentence_min``). Empty where the sentence counts
    differ."""
    def lengths(tokens):
        ends = torch.cat([tokens.eq(separator).nonzero().flatten(), tokens.new_tensor([tokens.numel() - 1])])
        return torch.diff(ends, prepend=ends.new_tensor([-1])).double()
    src, tgt = lengths(source), lengths(target)
    return (tgt - 1) / src if src.numel() == tgt.numel() else src.new_zeros(0)


def add_sentence_index(embed_positions: nn.Module, separator: int, written: bool):
    """Make fairseq's positional embedding return positions + sentence embeddings (its weights and keys unchanged).
    With ``incremental_state`` fairseq passes the whole prefix and takes the last position: so does the hook."""
    if embed_positions is None:
        raise ValueError("--sentence-index adds to the positional embeddings: drop --no-token-positional-embeddings")

    def hook(module, args, kwargs, positions):
        index = sentence_numbers(args[0], separator, written)
        if kwargs.get("incremental_state") is not None:
            index = index[:, -1:]
        return positions + sentence_embedding(index, positions.size(-1)).to(positions.dtype)
    embed_positions.register_forward_hook(hook, with_kwargs=True)
