"""rfa_fairseq/modules/softmax_attention.py: SoftmaxSelfAttention, fairseq's softmax self-attention, its decoding cache
kept in place, steps and beam reorders equal to fairseq's MultiheadAttention with the same weights; SoftmaxCrossAttention
with a SentenceWindow, its steps and reorders equal to its full pass, and fairseq's where the window is the document."""
import pytest
import torch
from fairseq.modules import MultiheadAttention

from rfa_fairseq.modules import SoftmaxCrossAttention, SoftmaxSelfAttention
from rfa_fairseq.modules import softmax_attention
from rfa_fairseq.modules.softmax_attention import SentenceWindow


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


def cross_pair(seed=0):
    torch.manual_seed(seed)
    ours = SoftmaxCrossAttention(32, 4, kdim=32, vdim=32, encoder_decoder_attention=True).eval()
    fairseq = MultiheadAttention(32, 4, kdim=32, vdim=32, encoder_decoder_attention=True).eval()
    fairseq.load_state_dict(ours.state_dict())
    return ours, fairseq


SOURCE = torch.tensor([[-1, -1, 0, 0, 0, 1, 1, 2, 2, 2], [0, 0, 1, 1, 2, 2, 3, 3, 4, 4]])  # 2 sources, left-padded


def test_a_window_wider_than_the_document_is_fairseqs_cross_attention():
    ours, fairseq = cross_pair()
    g = torch.Generator().manual_seed(3)
    query, key = torch.randn(6, 2, 32, generator=g), torch.randn(10, 2, 32, generator=g)
    target = torch.randint(0, 5, (2, 6), generator=g)
    with torch.no_grad():
        a, a_weights = ours(query, key, key, key_padding_mask=SentenceWindow(SOURCE, target, 9))
        b, b_weights = fairseq(query, key, key, key_padding_mask=SOURCE.lt(0), static_kv=True)
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(a_weights, b_weights, rtol=1e-5, atol=1e-6)
        state = {}
        for t in range(query.size(0)):  # decoding steps: the first caches the windows
            window = SentenceWindow(SOURCE if t == 0 else None, target[:, t:t + 1], 9)
            out, weights = ours(query[t:t + 1], key, key, key_padding_mask=window, incremental_state=state,
                                static_kv=True, need_weights=True)
            torch.testing.assert_close(out, b[t:t + 1], rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(weights, b_weights[:, t:t + 1], rtol=1e-5, atol=1e-6)


def test_steps_and_beam_reorders_equal_the_full_pass():
    """Beam 2 over 2 sources; each step gives each row a sentence number (past the last too); reorders within
    sentences, then the first source leaves. Every step, output and weights, equals the full pass of its rows."""
    ours, _ = cross_pair(1)
    ours.set_beam_size(2)
    g = torch.Generator().manual_seed(4)
    keys = torch.randn(10, 2, 32, generator=g)
    orders = [torch.tensor([1, 1, 2, 3]), torch.tensor([0, 1, 3, 2]), torch.tensor([2, 3]), torch.tensor([1, 0])]
    state, live, narrowed = {}, torch.tensor([0, 1]), False
    with torch.no_grad():
        for t in range(6):
            rows = 2 * live.numel()
            query, target = torch.randn(1, rows, 32, generator=g), torch.randint(0, 7, (rows, 1), generator=g)
            source, key = SOURCE[live].repeat_interleave(2, 0), keys[:, live].repeat_interleave(2, 1)
            window = SentenceWindow(source if t == 0 else None, target, 1)
            out, weights = ours(query, key, key, key_padding_mask=window, incremental_state=state, static_kv=True,
                                need_weights=True)
            full, full_weights = ours(query, key, key, key_padding_mask=SentenceWindow(source, target, 1))
            torch.testing.assert_close(out, full, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(weights, full_weights, rtol=1e-5, atol=1e-6)
            wide, _ = ours(query, key, key, key_padding_mask=SentenceWindow(source, target, 9))
            narrowed |= not torch.allclose(out, wide)
            if t < len(orders):
                ours.reorder_incremental_state(state, orders[t])
                live = live[orders[t].view(-1, 2)[:, 0] // 2]
    cache = ours._get_input_buffer(state)
    assert narrowed and cache["window_keys"].shape == (1, 4, 10, 8) and cache["window_spans"].shape == (1, 5, 2)
