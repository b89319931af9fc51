"""fairseq attention modules against the naive ops on their own projections, incremental state
and beam reordering, and the random feature draw protocol."""
import pytest
import torch

from rfa_fairseq.modules import CausalRFAttention, CrossRFAttention, RandomFeatureMap
from rfa_fairseq.modules.heads import merge_heads, split_heads
from rfa_fairseq.ops import naive_causal_rfa, naive_cross_rfa, quadratic_is_cheaper
from rfa_fairseq.modules.random_feature_map import draw_seed
from rfa_test_utils import causal_state

C, H = 24, 3


def fmap(module_id=0, D=40, kernel="gaussian"):
    return RandomFeatureMap(H, C // H, D, kernel=kernel, module_id=module_id)


def _left_pad_mask(lengths, T):
    return torch.arange(T)[None, :] < (T - torch.tensor(lengths))[:, None]


@pytest.mark.parametrize("recompute", [True, False], ids=["recompute", "store"])
@pytest.mark.parametrize("gate", [False, True], ids=["rfa", "gate"])
def test_causal_module_matches_naive_with_padding(gate, recompute):
    torch.manual_seed(0)
    attn = CausalRFAttention(C, H, fmap(), gate=gate, chunk_size=5, recompute=recompute).double().eval()
    x = torch.randn(13, 4, C, dtype=torch.float64, requires_grad=True)
    mask = _left_pad_mask([13, 9, 4, 1], 13)
    out, weights = attn(x, x, x, key_padding_mask=mask)
    assert weights is None
    q, k, v, log_g = attn._inputs(x, mask)[:4]
    ref = attn.out_proj(merge_heads(naive_causal_rfa(q, k, v, log_g)[0]))
    torch.testing.assert_close(out, ref, rtol=1e-9, atol=1e-9)
    params = [p for p in attn.parameters() if p.requires_grad] + [x]
    g1 = torch.autograd.grad(out.square().sum(), params)
    g2 = torch.autograd.grad(ref.square().sum(), params)
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-9)


def test_causal_module_rejects_cross_use():
    attn = CausalRFAttention(C, H, fmap())
    x, y = torch.randn(5, 2, C), torch.randn(7, 2, C)
    with pytest.raises(ValueError, match="self-attention"):
        attn(x, y, y)


@pytest.mark.parametrize("Tq,S", [(6, 9), (40, 50)], ids=["quadratic-form", "summary-form"])
@pytest.mark.parametrize("recompute", [True, False], ids=["recompute", "store"])
@pytest.mark.parametrize("weights", [False, True], ids=["", "weights"])
def test_cross_module_matches_naive_with_padding(recompute, weights, Tq, S):
    """The module against the naive loop on its own projections, at lengths where it takes the
    quadratic form and where it takes the summary (``quadratic_is_cheaper``)."""
    torch.manual_seed(1)
    attn = CrossRFAttention(C, H, fmap(1), kdim=16, recompute=recompute).double().eval()
    assert quadratic_is_cheaper(S, 2 * 40, C // H, Tq=Tq) == (Tq == 6)
    query = torch.randn(Tq, 3, C, dtype=torch.float64, requires_grad=True)
    enc = torch.randn(S, 3, 16, dtype=torch.float64, requires_grad=True)
    mask = _left_pad_mask([S, 5, 2], S)
    out, w = attn(query, enc, enc, key_padding_mask=mask, need_weights=weights)
    assert (w is not None) == weights
    q = attn.feature_map(split_heads(attn.q_proj(query), H))
    k = attn.feature_map(split_heads(attn.k_proj(enc), H))
    v = split_heads(attn.v_proj(enc), H)
    ref = attn.out_proj(merge_heads(naive_cross_rfa(q, k, v, mask)))
    torch.testing.assert_close(out, ref, rtol=1e-9, atol=1e-9)
    params = [p for p in attn.parameters() if p.requires_grad] + [query, enc]
    g1 = torch.autograd.grad(out.square().sum(), params)
    g2 = torch.autograd.grad(ref.square().sum(), params)
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-9)


def test_cross_module_attention_weights():
    torch.manual_seed(1)
    attn = CrossRFAttention(C, H, fmap(1), kdim=16).double().eval()
    query = torch.randn(6, 3, C, dtype=torch.float64)
    enc = torch.randn(9, 3, 16, dtype=torch.float64)
    mask = _left_pad_mask([9, 5, 2], 9)
    _, w = attn(query, enc, enc, key_padding_mask=mask, need_weights=True)
    assert w.shape == (3, 6, 9)
    assert torch.all(w.masked_select(mask[:, None, :].expand_as(w)) == 0)
    _, wh = attn(query, enc, enc, key_padding_mask=mask, need_head_weights=True)
    assert wh.shape == (H, 3, 6, 9)
    torch.testing.assert_close(wh.mean(0), w)


def _cross_state(saved):
    """The per-sentence tensors of a cross-attention decoding state (the summary, or the keys'
    features and values)."""
    return [saved["state"]] if "state" in saved else [saved["k"], saved["v"]]


@pytest.mark.parametrize("S", [7, 12], ids=["full-pass-quadratic", "full-pass-summary"])
def test_cross_incremental_beam_sharing_and_reorder(S):
    """One source summary per sentence, equal to the full forward (which takes the quadratic form
    for the shorter source), left alone when beams move within their sentences and indexed by
    sentence when sentences finish; asked for weights, the state keeps the keys."""
    torch.manual_seed(2)
    beam, bsz = 3, 4
    attn = CrossRFAttention(C, H, fmap(1)).eval()
    enc = torch.randn(S, bsz, C)
    mask = _left_pad_mask([S, 3, 5, 6], S)
    enc_b = enc.repeat_interleave(beam, dim=1)  # sentence-major, as fairseq's generator lays it out
    mask_b = mask.repeat_interleave(beam, dim=0)
    attn.set_beam_size(beam)
    state = {}
    with torch.no_grad():
        steps = [torch.randn(1, bsz * beam, C) for _ in range(3)]
        out0, _ = attn(steps[0], enc_b, enc_b, key_padding_mask=mask_b, incremental_state=state)
        full0, _ = attn(steps[0], enc_b, enc_b, key_padding_mask=mask_b)
        torch.testing.assert_close(out0, full0, rtol=1e-5, atol=1e-6)
        saved = attn._get_input_buffer(state)
        before = _cross_state(saved)
        assert [t.shape for t in before] == [(bsz, H, 80, C // H + 1)]  # one per sentence, not per beam
        within = torch.arange(bsz * beam).view(bsz, beam).flip(1).reshape(-1)  # reorder beams inside sentences
        attn.reorder_incremental_state(state, within)
        assert all(a is b for a, b in zip(_cross_state(attn._get_input_buffer(state)), before))  # no copy
        # drop sentence 1: the generator keeps rows of sentences 0, 2, 3 (with beams reordered)
        keep = torch.tensor([0, 2, 3])
        new_order = (keep[:, None] * beam + torch.tensor([2, 0, 1])[None, :]).reshape(-1)
        attn.reorder_incremental_state(state, new_order)
        q = steps[1][:, : len(new_order)]
        out1, _ = attn(q, enc_b[:, new_order], enc_b[:, new_order], key_padding_mask=mask_b[new_order],
                       incremental_state=state)
        full1, _ = attn(q, enc_b[:, new_order], enc_b[:, new_order], key_padding_mask=mask_b[new_order])
        torch.testing.assert_close(out1, full1, rtol=1e-5, atol=1e-6)
        for a, b in zip(_cross_state(attn._get_input_buffer(state)), before):
            assert torch.equal(a, b[keep])
        # alignment weights asked for mid-decode: the state is rebuilt with the keys
        _, w = attn(q, enc_b[:, new_order], enc_b[:, new_order], key_padding_mask=mask_b[new_order],
                    incremental_state=state, need_weights=True)
        _, w_full = attn(q, enc_b[:, new_order], enc_b[:, new_order], key_padding_mask=mask_b[new_order],
                         need_weights=True)
        torch.testing.assert_close(w, w_full, rtol=1e-5, atol=1e-6)
        assert "k" in attn._get_input_buffer(state)


@pytest.mark.parametrize("gate", [False, True], ids=["rfa", "gate"])
def test_causal_decoding_state_is_one_packed_tensor_updated_in_place(gate):
    """Single steps from an empty state: the state is one ``[B, H, F, K + 1]`` tensor (fp32, or
    fp64 for this fp64 module), the same tensor from the first step on (updated in place without
    autograd), and the outputs equal the full (chunked) forward; a prompt after single steps
    continues from the same state."""
    torch.manual_seed(4)
    attn = CausalRFAttention(C, H, fmap(), gate=gate, chunk_size=4).double().eval()
    x = torch.randn(12, 3, C, dtype=torch.float64)
    full, _ = attn(x)
    state, tensors = {}, set()
    with torch.no_grad():
        for t in range(12):
            out, _ = attn(x[t : t + 1], incremental_state=state)
            torch.testing.assert_close(out[0], full[t], rtol=1e-10, atol=1e-12, msg=lambda m: f"step {t}: {m}")
            saved = attn._get_input_buffer(state)
            assert sorted(saved) == ["state"]
            assert saved["state"].shape == (3, H, 80, C // H + 1) and saved["state"].dtype == torch.float64
            tensors.add(saved["state"].data_ptr())
        assert len(tensors) == 1, "a decoding step allocated a new state"
        state = {}
        attn(x[:1], incremental_state=state)
        out, _ = attn(x[1:5], incremental_state=state)
    torch.testing.assert_close(out, full[1:5], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("kernel", ["gaussian", "arccos"])
@pytest.mark.parametrize("gate", [False, "convex", "decay"], ids=["rfa", "gate", "decay"])
def test_inference_computation_agrees_with_the_training_one(gate, kernel):
    """In evaluation mode without autograd the gaussian map runs from weights precomputed from sigma and the
    random matrix (RandomFeatureMap.inference_weights): whole-sequence outputs with padding and steps equal
    those computed with autograd on, and the weights follow a change of sigma."""
    torch.manual_seed(5)
    attn = CausalRFAttention(C, H, fmap(kernel=kernel), gate=bool(gate), gate_form=gate or "convex",
                             chunk_size=4).double().eval()
    x = torch.randn(10, 3, C, dtype=torch.float64)
    mask = _left_pad_mask([10, 7, 3], 10)
    for _ in range(2):
        ref = attn(x, key_padding_mask=mask)[0]
        with torch.no_grad():
            torch.testing.assert_close(attn(x, key_padding_mask=mask)[0], ref, rtol=1e-12, atol=1e-12)
            state = {}
            steps = torch.cat([attn(x[t:t + 1], incremental_state=state)[0] for t in range(10)])
        torch.testing.assert_close(steps, attn(x)[0], rtol=1e-10, atol=1e-12)
        with torch.no_grad():
            attn.feature_map.sigma.mul_(1.5)
    if kernel == "gaussian":  # arccos features scale with sigma, and the ratio does not see it
        assert (attn(x)[0] - steps).abs().max() > 1e-3


@pytest.mark.parametrize("gate", [False, True], ids=["rfa", "gate"])
def test_checkpoints_with_separate_projections_load_into_in_proj(gate):
    """The layout of earlier versions (q_proj, k_proj, v_proj, gate_proj) loads, strictly, into in_proj."""
    torch.manual_seed(1)
    ref = CausalRFAttention(C, H, fmap(), gate=gate)
    old = {k: v for k, v in ref.state_dict().items() if not k.startswith("in_proj")}
    names = ["q_proj", "k_proj", "v_proj", "gate_proj"][:3 + gate]
    for part in ("weight", "bias"):
        for name, t in zip(names, ref.in_proj.state_dict()[part].split([C, C, C, H][:3 + gate])):
            old[f"{name}.{part}"] = t
    attn = CausalRFAttention(C, H, fmap(), gate=gate)
    attn.load_state_dict(old)
    assert torch.equal(attn.in_proj.weight, ref.in_proj.weight) and torch.equal(attn.in_proj.bias, ref.in_proj.bias)


@pytest.mark.parametrize("grad", [False, True], ids=["no-grad", "grad"])
@pytest.mark.parametrize("padding", [False, True], ids=["plain", "padding"])
def test_steps_equal_a_whole_sequence_pass(grad, padding):
    """Token by token through the incremental state (a step each; with a padding mask, the chunked
    form from the state) equals one pass over the whole sequence, under autograd or not."""
    torch.manual_seed(6)
    attn = CausalRFAttention(C, H, fmap(), gate=True).double().eval()
    x = torch.randn(6, 2, C, dtype=torch.float64)
    with torch.no_grad():
        full = attn(x)[0]
    with torch.set_grad_enabled(grad):
        state, outs = {}, []
        for t in range(6):
            mask = torch.zeros(2, 1, dtype=torch.bool) if padding else None
            outs.append(attn(x[t : t + 1], key_padding_mask=mask, incremental_state=state)[0])
    torch.testing.assert_close(torch.cat(outs), full, rtol=1e-9, atol=1e-10)


def test_causal_incremental_reorder_follows_new_order():
    torch.manual_seed(3)
    attn = CausalRFAttention(C, H, fmap(), gate=True).eval()
    attn.set_beam_size(2)
    x = torch.randn(6, 4, C)
    order = torch.tensor([2, 2, 0, 3])
    with torch.no_grad():
        state = {}
        for t in range(5):
            attn(x[t : t + 1], incremental_state=state)
        before = attn._get_input_buffer(state)["state"].clone()
        attn.reorder_incremental_state(state, order)
        # on the CPU without autograd the gather waits for the next step's pass over the state
        assert torch.equal(causal_state(attn._get_input_buffer(state)), before[order])
        step, _ = attn(x[5:6, order], incremental_state=state)
        # reference: decode the reordered history from scratch
        ref_state = {}
        xs = x[:, order]
        for t in range(6):
            ref, _ = attn(xs[t : t + 1], incremental_state=ref_state)
    torch.testing.assert_close(step, ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("short_conv", [0, 3], ids=["", "conv"])
@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
def test_causal_reorders_over_many_steps_follow_the_histories(grad, short_conv):
    """Beam-search-like decoding: a reorder after every step (permutations with repeated rows,
    the identity, and finally a batch that shrinks). Each row's output must equal a from-scratch
    decode of the history that row now continues. Without autograd the reorder gathers into a
    buffer and the two swap roles: two blocks of memory serve the whole decode, the shrunk batch
    included (its state is gathered into the front of the buffer), and the buffer never aliases
    the live state."""
    torch.manual_seed(5)
    attn = CausalRFAttention(C, H, fmap(), gate=True, short_conv=short_conv).eval()
    attn.set_beam_size(2)  # more than one hypothesis per sentence: any order may come
    N, steps = 4, 12
    x = torch.randn(steps, N, C)
    orders = [torch.tensor(o) for o in ([1, 1, 0, 3], [0, 1, 2, 3], [1, 0, 2, 3], [3, 3, 3, 0], [0, 0, 2, 3],
                                        [2, 0, 1, 1], [0, 1, 2, 3], [0, 1, 3, 3], [1, 2, 2, 0], [3, 2, 1, 0],
                                        [0, 0, 3])]
    history = [[i] for i in range(N)]  # history[row] = the input columns of x that row has seen
    buffers = set()
    with torch.set_grad_enabled(grad):
        state = {}
        for t in range(steps):
            rows = len(history)
            out, _ = attn(x[t : t + 1, :rows], incremental_state=state)
            for r in range(rows):
                ref_state, cols = {}, history[r] + [r]
                for s, col in enumerate(cols[1:]):
                    ref, _ = attn(x[s : s + 1, col : col + 1], incremental_state=ref_state)
                torch.testing.assert_close(out[:, r : r + 1], ref, rtol=1e-5, atol=1e-6,
                                           msg=lambda m: f"step {t}, row {r}: {m}")
            buf = attn._get_input_buffer(state)
            # the buffer exists from the first reorder on, the shrunk batch's (after step 10) too
            assert ("spare_state" in buf) == (not grad and t >= 1), f"step {t}: {sorted(buf)}"
            if "spare_state" in buf:
                assert buf["spare_state"].data_ptr() != buf["state"].data_ptr()
                buffers.update((buf["spare_state"].data_ptr(), buf["state"].data_ptr()))
            if t < len(orders):
                order = orders[t]
                history = [history[o] + [o] for o in order.tolist()]
                attn.reorder_incremental_state(state, order)
    assert len(buffers) == (0 if grad else 2)


def test_causal_reorder_after_a_multi_token_prefix():
    """A prefix fed in one call (chunked form), then reorders and single steps: still each row
    continues the right history."""
    torch.manual_seed(8)
    attn = CausalRFAttention(C, H, fmap(), gate=True, chunk_size=2).eval()
    attn.set_beam_size(3)
    x = torch.randn(7, 3, C)
    orders = [torch.tensor([2, 2, 0]), torch.tensor([1, 0, 0]), torch.tensor([0, 2, 1])]
    with torch.no_grad():
        state = {}
        attn(x[:4], incremental_state=state)
        cols = [[r] * 4 for r in range(3)]  # cols[r][s]: the column of x row r saw at step s
        for t, order in zip(range(4, 7), orders):
            attn.reorder_incremental_state(state, order)
            cols = [cols[o] for o in order.tolist()]
            out, _ = attn(x[t : t + 1], incremental_state=state)
            for r in range(3):
                ref_state = {}
                for s, col in enumerate(cols[r] + [r]):
                    ref, _ = attn(x[s : s + 1, col : col + 1], incremental_state=ref_state)
                torch.testing.assert_close(out[:, r : r + 1], ref, rtol=1e-5, atol=1e-6,
                                           msg=lambda m: f"step {t}, row {r}: {m}")
            cols = [c + [r] for r, c in enumerate(cols)]


def test_causal_reorder_at_beam_one_copies_nothing():
    """With one hypothesis per sentence (fairseq's beam 1) a reorder that keeps the batch size is
    the identity: the state is left as it is, without reading the order. A shrinking batch is
    still gathered."""
    attn = CausalRFAttention(C, H, fmap()).eval()
    with torch.no_grad():
        state = {}
        for _ in range(3):
            attn(torch.randn(1, 3, C), incremental_state=state)
        S = attn._get_input_buffer(state)["state"]
        attn.reorder_incremental_state(state, torch.arange(3))
        saved = attn._get_input_buffer(state)
        assert saved["state"] is S and "parents" not in saved
        attn.reorder_incremental_state(state, torch.tensor([2, 0]))
        torch.testing.assert_close(causal_state(attn._get_input_buffer(state)), S[[2, 0]], rtol=0, atol=0)


def test_random_feature_draws_are_seeded_per_step_and_module():
    torch.manual_seed(11)
    a, b, c = fmap(0), fmap(0), fmap(1)
    assert torch.equal(a.random_matrix, b.random_matrix)
    assert not torch.equal(a.random_matrix, c.random_matrix)
    x = torch.randn(2, H, 5, C // H)
    a.train()
    a.set_num_updates(1)
    a(x)
    first = a.random_matrix.clone()
    a.set_num_updates(2)
    a(x)
    assert not torch.equal(first, a.random_matrix)
    b.train()
    b.set_num_updates(2)
    b(x)
    assert torch.equal(a.random_matrix, b.random_matrix), "same seed, step and module: same draw"
    a.eval()
    a.set_num_updates(3)
    a(x)
    assert torch.equal(a.random_matrix, b.random_matrix), "evaluation never redraws"
    other = fmap(5)
    a.load_state_dict(other.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(a(x), other.eval()(x), rtol=0, atol=0)


def test_fixed_features_keep_the_first_draw_through_training(lm_model):
    """``fixed`` (--rfa-fixed-features): the draw made at construction (the same as an unfixed
    map's first) survives every training step; the decoder builds its maps from the flag."""
    torch.manual_seed(11)
    fixed, moving = RandomFeatureMap(H, C // H, 40, fixed=True), fmap(0)
    first = fixed.random_matrix.clone()
    assert torch.equal(first, moving.random_matrix)
    x = torch.randn(2, H, 5, C // H)
    for m in (fixed, moving):
        m.train()
        for step in (1, 2, 3):
            m.set_num_updates(step)
            m(x)
    assert torch.equal(fixed.random_matrix, first) and not torch.equal(moving.random_matrix, first)
    assert "fixed" in repr(fixed)
    maps = lambda *flags: [m for m in lm_model(*flags)[1].modules() if isinstance(m, RandomFeatureMap)]  # noqa: E731
    assert all(m.fixed for m in maps("--rfa-fixed-features")) and not any(m.fixed for m in maps())


def test_draw_seeds_are_distinct_and_in_range():
    """The seed of a draw is a function of (run seed, update, module) alone: distinct for every
    combination on a grid, and a valid torch seed."""
    grid = [(s, u, m) for s in (0, 1, 2, 2**40 + 1) for u in range(50) for m in range(12)]
    seeds = [draw_seed(*key) for key in grid]
    assert len(set(seeds)) == len(grid)
    assert all(0 <= x < 2**63 for x in seeds)
    assert draw_seed(1, 2, 3) == draw_seed(1, 2, 3) != draw_seed(1, 3, 2)


def test_cross_beam_search_needs_whole_sentences():
    """The beam layout is what fairseq's generator says (set_beam_size), not checked against the
    rows: a batch that cannot hold whole sentences is refused by name, and beam 1 keeps one state
    per row."""
    torch.manual_seed(4)
    attn = CrossRFAttention(C, H, fmap(1)).eval()
    enc = torch.randn(5, 4, C)
    query = torch.randn(1, 4, C)
    attn.set_beam_size(3)
    with torch.no_grad(), pytest.raises(ValueError, match="beam 3 needs a batch of whole sentences.*got 4 rows"):
        attn(query, enc, enc, incremental_state={})
    attn.set_beam_size(1)
    with torch.no_grad():
        state = {}
        out, _ = attn(query, enc, enc, incremental_state=state)
        full, _ = attn(query, enc, enc)
    assert all(t.shape[0] == 4 for t in _cross_state(attn._get_input_buffer(state)))
    torch.testing.assert_close(out, full, rtol=1e-5, atol=1e-6)


def test_decoder_builds_no_future_mask(translation_model):
    _, model = translation_model()
    assert model.decoder.buffered_future_mask(torch.zeros(4096, 1, 8)) is None
