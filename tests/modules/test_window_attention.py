"""CausalRFAttention with a local exact window (``local_window``) against the naive window op on its own
projections: a padded batch with gradients, steps after a multi-token prefix, beam reordering, and a
stateful language model's blocks with the state (and the window's keys) carried between them."""
import pytest
import torch

from rfa_fairseq.modules import CausalRFAttention, RandomFeatureMap
from rfa_fairseq.modules.heads import merge_heads
from rfa_fairseq.ops import naive_window_causal_rfa

C, H = 24, 3


def attention(window=4, **kw):
    torch.manual_seed(0)
    return CausalRFAttention(C, H, RandomFeatureMap(H, C // H, 20), gate=True, chunk_size=5, local_window=window,
                             **kw).double().eval()


def reference(attn, x, mask=None):
    (q, k), v, log_g, pad = attn._heads(x, mask)
    fm = attn.feature_map
    o, _ = naive_window_causal_rfa(fm.scale(q), fm.scale(k), v, log_g, kernel=fm.kernel, random_matrix=fm.random_matrix,
                                   window=attn.local_window, pad=pad, convex=attn.convex)
    return attn.out_proj(merge_heads(o))


@pytest.mark.parametrize("training", [dict(), dict(recompute=True), dict(recompute_segment=6)],
                         ids=["store", "recompute", "segments"])
def test_module_matches_the_naive_window_with_padding(training):
    attn = attention(**training)
    x = torch.randn(17, 3, C, dtype=torch.float64, requires_grad=True)
    mask = torch.arange(17)[None, :] < torch.tensor([0, 5, 12])[:, None]  # left padding
    out, _ = attn(x, key_padding_mask=mask)
    ref = reference(attn, x, mask)
    torch.testing.assert_close(out, ref, rtol=1e-9, atol=1e-9)
    params = [p for p in attn.parameters() if p.requires_grad] + [x]
    for a, b in zip(torch.autograd.grad(out.square().sum(), params), torch.autograd.grad(ref.square().sum(), params)):
        torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-9)


def test_steps_after_a_prefix_and_beam_reorders_follow_the_histories():
    """A 6-token prefix, then steps; after step 9 the beam keeps rows (1, 1, 0): each row then continues
    the history it took, as the full pass over that history says. Every state tensor, the ring's position
    included, alternates between two places."""
    attn = attention()
    attn.set_beam_size(3)
    x = torch.randn(14, 3, C, dtype=torch.float64)
    state = {}
    with torch.no_grad():
        outs = [attn(x[:6], incremental_state=state)[0]] + [attn(x[t:t + 1], incremental_state=state)[0]
                                                             for t in range(6, 10)]
        torch.testing.assert_close(torch.cat(outs), attn(x[:10])[0], rtol=1e-10, atol=1e-10)
        order = torch.tensor([1, 1, 0])
        attn.reorder_incremental_state(state, order)
        history = torch.cat([x[:10, order], x[10:]])
        steps, places = [], []
        for t in range(10, 14):
            steps.append(attn(history[t:t + 1], incremental_state=state)[0])
            places.append({n: b.data_ptr() for n, b in attn._get_input_buffer(state).items()})
            attn.reorder_incremental_state(state, torch.arange(3))
        assert set(places[0]) == {"state", "keys", "values", "slot"} | {"spare_" + n for n in ("state", "keys",
                                                                                                 "values", "slot")}
        assert places[1] != places[0] and places[2] == places[0] and places[3] == places[1]
        torch.testing.assert_close(torch.cat(steps), attn(history)[0][10:], rtol=1e-10, atol=1e-10)


def test_blocks_with_the_carried_state_equal_one_pass():
    """A stateful language model's blocks (padding masks given, several tokens a call) from the carried state,
    with gradients into the last block and the state it starts from."""
    attn = attention(window=7)
    x = torch.randn(30, 2, C, dtype=torch.float64)
    state, no_pad = {}, lambda n: torch.zeros(2, n, dtype=torch.bool)  # noqa: E731
    with torch.no_grad():
        first = [attn(x[a:b], key_padding_mask=no_pad(b - a), incremental_state=state)[0] for a, b in ((0, 3), (3, 12))]
    last, _ = attn(x[12:], key_padding_mask=no_pad(18), incremental_state=state)
    torch.testing.assert_close(torch.cat(first + [last]), reference(attn, x), rtol=1e-9, atol=1e-9)
    buffer = attn._get_input_buffer(state)
    assert buffer["keys"].shape == (2, H, 7, C // H) and buffer["values"].shape == (2, H, 7, C // H + 1)
    assert torch.autograd.grad(last.sum(), attn.feature_map.sigma)[0].abs().sum() > 0
