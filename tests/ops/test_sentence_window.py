"""ops/sentence_window.py: the windows of source sentences that cross attention reads (--cross-sentence-window), as a
full mask and as the per-sentence spans a decoding step gathers with, against the definition written out."""
import pytest
import torch

from rfa_fairseq.ops.sentence_window import window_mask, window_spans


def numbered(sizes, pads, left=True):
    """A source's sentence numbers: ``sizes`` tokens per sentence, ``pads`` -1s before (``left``) or after."""
    numbers = [j for j, n in enumerate(sizes) for _ in range(n)]
    return [-1] * pads + numbers if left else numbers + [-1] * pads


def batch(left):
    rows = [numbered([3, 1, 4, 2], 0, left), numbered([5, 2], 3, left), numbered([2, 2, 2, 2, 2], 0, left)[:10]]
    return torch.tensor(rows)  # [3, 10]; the second has 2 sentences, the third 5


def definition(source, j, width):
    """The positions source sentence ``j`` reads, written out: non-pads within ``width`` of j clamped to the last."""
    last = max(source)
    return [i for i, n in enumerate(source) if n >= 0 and abs(n - min(j, last)) <= width]


@pytest.mark.parametrize("left", [True, False], ids=["left-pad", "right-pad"])
@pytest.mark.parametrize("width", [0, 1, 3])
def test_the_mask_and_the_table_are_the_definition(left, width):
    source = batch(left)
    target = torch.tensor([[0, 0, 1, 2, 3, 4, 6]] * 3)  # 4 and 6 are past the second source's last sentence
    mask = window_mask(source, target, width)
    spans, widest = window_spans(source, width)
    assert spans.shape == (3, 5, 2) and widest == (spans[..., 1] - spans[..., 0]).max()
    for b, row in enumerate(source.tolist()):
        for t, j in enumerate(target[b].tolist()):
            assert mask[b, t].nonzero().flatten().tolist() == definition(row, j, width)
        for j in range(8):  # a step clamps its number to the table's last row
            first, end = spans[b, min(j, spans.size(1) - 1)].tolist()
            assert list(range(first, end)) == definition(row, j, width)


def test_pads_between_a_sources_tokens_are_refused():
    with pytest.raises(ValueError, match="pads between its tokens"):
        window_spans(torch.tensor([[0, 0, -1, 1, 1]]), 1)


def test_a_window_as_wide_as_the_document_is_the_padding_mask():
    source = batch(True)
    mask = window_mask(source, torch.zeros(3, 4, dtype=torch.long), width=10)
    assert torch.equal(mask, source.ge(0)[:, None].expand(-1, 4, -1))
