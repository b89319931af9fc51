"""SoftmaxSelfAttention (rfa_fairseq/modules/softmax_attention.py): fairseq's softmax self-attention, its
decoding cache kept in place, steps and beam reorders equal to fairseq's MultiheadAttention with the same weights."""
import pytest
import torch
from fairseq.modules import MultiheadAttention

from rfa_fairseq.modules import SoftmaxSelfAttention
from rfa_fairseq.modules import softmax_attention


def pair(seed=0):
    torch.manual_seed(seed)
    ours = SoftmaxSelfAttention(32, 4, self_attention=True).eval()
    fairseq = MultiheadAttention(32, 4, self_attention=True).eval()
    fairseq.load_state_dict(ours.state_dict())
    return ours, fairseq


@pytest.mark.parametrize("room", [3, 128], ids=["grows", "room"])
def test_steps_and_reorders_equal_fairseq(monkeypatch, room):
    """Ten steps of 6 rows, a pad at one row's step 2, a beam reorder after each step (rows taken from others,
    and after step 5 two rows leave): every step's output equals fairseq's, whose cache is concatenated."""
    monkeypatch.setattr(softmax_attention, "ROOM", room)
    ours, fairseq = pair()
    g = torch.Generator().manual_seed(1)
    mine, theirs, rows = {}, {}, 6
    for step in range(10):
        x = torch.randn(1, rows, 32, generator=g)
        pad = torch.zeros(rows, 1, dtype=torch.bool)
        pad[1, 0] = step == 2
        with torch.no_grad():
            a, _ = ours(x, x, x, key_padding_mask=pad, incremental_state=mine, need_weights=False)
            b, _ = fairseq(x, x, x, key_padding_mask=pad, incremental_state=theirs, need_weights=False)
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        kept = rows - 2 if step == 5 else rows
        order = torch.randint(0, rows, (kept,), generator=g)
        ours.reorder_incremental_state(mine, order)
        fairseq.reorder_incremental_state(theirs, order)
        rows = kept
    cache = ours._get_input_buffer(mine)
    assert cache["length"] == 10 and cache["keys"].shape == (4, 4, -(-10 // room) * room, 8)


def test_outside_decoding_it_is_fairseqs_module():
    ours, fairseq = pair(2)
    x = torch.randn(7, 3, 32)
    mask = torch.triu(torch.full((7, 7), float("-inf")), 1)
    with torch.no_grad():
        torch.testing.assert_close(ours(x, x, x, attn_mask=mask)[0], fairseq(x, x, x, attn_mask=mask)[0])


def test_a_step_of_several_tokens_or_with_weights_is_refused():
    ours, _ = pair()
    x = torch.randn(2, 3, 32)
    with pytest.raises(ValueError, match="decodes one token a step"):
        ours(x, x, x, incremental_state={}, need_weights=False)
    with pytest.raises(ValueError, match="decodes one token a step"):
        ours(x[:1], x[:1], x[:1], incremental_state={})
