"""rfa_fairseq/modules/softmax_attention.py: SoftmaxCrossAttention with a SentenceWindow, its steps and beam reorders
equal to its full pass, and to fairseq's MultiheadAttention with the same weights where the window is the document."""
import torch
from fairseq.modules import MultiheadAttention

from rfa_fairseq.modules import SoftmaxCrossAttention
from rfa_fairseq.modules.softmax_attention import SentenceWindow


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
    assert narrowed and cache["window_kv"].shape == (1, 4, 10, 16) and cache["window_spans"].shape == (1, 5, 2)
