"""fairseq attention modules against the naive ops on their own projections, incremental state
and beam reordering, and the random feature draw protocol."""
import pytest
import torch

from rfa_fairseq.modules import CausalRFAttention, CrossRFAttention, RandomFeatureMap
from rfa_fairseq.modules.heads import merge_heads, split_heads
from rfa_fairseq.ops import naive_causal_rfa, naive_cross_rfa
from rfa_fairseq.ops.causal_rfa import key_rows

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
    q, k, v, log_g = attn._project(x, mask)
    ref = attn.out_proj(merge_heads(naive_causal_rfa(q, k, v, log_g)))
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


@pytest.mark.parametrize("recompute", [True, False], ids=["recompute", "store"])
@pytest.mark.parametrize("weights", [False, True], ids=["", "weights"])
def test_cross_module_matches_naive_with_padding(recompute, weights):
    torch.manual_seed(1)
    attn = CrossRFAttention(C, H, fmap(1), kdim=16, recompute=recompute).double().eval()
    query = torch.randn(6, 3, C, dtype=torch.float64, requires_grad=True)
    enc = torch.randn(9, 3, 16, dtype=torch.float64, requires_grad=True)
    mask = _left_pad_mask([9, 5, 2], 9)
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
    """The per-sentence tensors of a cross-attention decoding state, whichever form it holds."""
    return [saved[name] for name in ("Sz", "kT", "v1") if name in saved]


@pytest.mark.parametrize("decode_kernel", ["cpp", "torch"])
@pytest.mark.parametrize("S,form", [(7, "kT"), (12, "Sz")], ids=["short_source", "long_source"])
def test_cross_incremental_beam_sharing_and_reorder(S, form, decode_kernel, monkeypatch):
    """A short source is kept as keys and values (fewer numbers than the summary: F = 80, K = 8
    here, so below 720 / 89 = 8.1 tokens), a longer one as the summary; either way one per
    sentence, equal to the full forward, and reordered by sentence. The decoding steps read the
    state with the compiled readout (cpp) or the PyTorch ops (torch)."""
    from rfa_fairseq import kernels

    calls = []
    original = kernels.cross_readout
    monkeypatch.setattr(kernels, "cross_readout", lambda *a, **kw: calls.append(1) or original(*a, **kw))
    torch.manual_seed(2)
    beam, bsz = 3, 4
    attn = CrossRFAttention(C, H, fmap(1), decode_kernel=decode_kernel).eval()
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
        assert form in saved and ({"Sz", "kT"} - {form}).isdisjoint(saved)
        before = _cross_state(saved)
        assert all(t.shape[0] == bsz for t in before)  # one source state per sentence, not per beam
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
        assert all(t.shape[0] == 3 for t in _cross_state(attn._get_input_buffer(state)))
        # alignment weights asked for mid-decode: the state is rebuilt with the summary and keys
        _, w = attn(q, enc_b[:, new_order], enc_b[:, new_order], key_padding_mask=mask_b[new_order],
                    incremental_state=state, need_weights=True)
        _, w_full = attn(q, enc_b[:, new_order], enc_b[:, new_order], key_padding_mask=mask_b[new_order],
                         need_weights=True)
        torch.testing.assert_close(w, w_full, rtol=1e-5, atol=1e-6)
        assert "Sz" in attn._get_input_buffer(state)
    assert len(calls) == (3 if decode_kernel == "cpp" else 0)  # the decoding steps, not the full forwards


def _causal_buffer(saved):
    """The state tensor of a causal decoding state, whichever form it holds."""
    assert ("keys" in saved) != ("Sz" in saved), sorted(saved)
    return saved["keys"] if "keys" in saved else saved["Sz"]


def _causal_values(saved, gated):
    """The numbers of a causal decoding state that mean something: all of the summary, or the
    rows of the keys in use (the rest of the keys buffer is unused memory)."""
    if "keys" in saved:
        return key_rows(saved["keys"], gated)[: saved["len"]]
    return saved["Sz"]


@pytest.mark.parametrize("gate", [False, True], ids=["rfa", "gate"])
def test_causal_decoding_keeps_the_attention_form_then_the_summary(gate):
    """Single steps from an empty state: the attention form for keys_capacity tokens, then the
    summary, in a buffer of one size throughout; the outputs equal the full (chunked) forward."""
    torch.manual_seed(4)
    attn = CausalRFAttention(C, H, fmap(), gate=gate, chunk_size=4).double().eval()
    n = attn.keys_capacity
    assert n == 8  # F = 80, K = 8: 720 numbers per head hold 8 rows of 89 or 90
    x = torch.randn(n + 4, 3, C, dtype=torch.float64)
    full, _ = attn(x)
    state, shapes = {}, set()
    with torch.no_grad():
        for t in range(n + 4):
            out, _ = attn(x[t : t + 1], incremental_state=state)
            torch.testing.assert_close(out[0], full[t], rtol=1e-10, atol=1e-12, msg=lambda m: f"step {t}: {m}")
            saved = attn._get_input_buffer(state)
            assert ("keys" in saved) == (t + 1 <= n), f"step {t}: {sorted(saved)}"
            if "keys" in saved:
                assert saved["len"] == t + 1
            shapes.add(tuple(_causal_buffer(saved).shape))
        assert shapes == {(3, H, 80, C // H + 1)}
        # a prompt (several tokens in one call) after single steps folds the keys first
        state = {}
        attn(x[:1], incremental_state=state)
        out, _ = attn(x[1:5], incremental_state=state)
        assert "Sz" in attn._get_input_buffer(state)
    torch.testing.assert_close(out, full[1:5], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("decode_kernel", ["cpp", "torch"])
def test_causal_incremental_reorder_follows_new_order(decode_kernel):
    torch.manual_seed(3)
    attn = CausalRFAttention(C, H, fmap(), gate=True, decode_kernel=decode_kernel).eval()
    x = torch.randn(6, 4, C)
    order = torch.tensor([2, 2, 0, 3])
    with torch.no_grad():
        state = {}
        for t in range(5):
            attn(x[t : t + 1], incremental_state=state)
        attn.reorder_incremental_state(state, order)
        step, _ = attn(x[5:6, order], incremental_state=state)
        # reference: decode the reordered history from scratch
        ref_state = {}
        xs = x[:, order]
        for t in range(6):
            ref, _ = attn(xs[t : t + 1], incremental_state=ref_state)
    torch.testing.assert_close(step, ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("grad,decode_kernel", [(False, "cpp"), (False, "torch"), (True, "auto")],
                         ids=["no_grad-cpp", "no_grad-torch", "grad"])
def test_causal_reorders_over_many_steps_follow_the_histories(grad, decode_kernel):
    """Beam-search-like decoding: a reorder after every step (permutations with repeated rows,
    the identity, and finally a batch that shrinks). Each row's output must equal a from-scratch
    decode of the history that row now continues. Without autograd the reorder writes into
    spare buffers that swap roles; they must never alias the live state."""
    torch.manual_seed(5)
    attn = CausalRFAttention(C, H, fmap(), gate=True, decode_kernel=decode_kernel).eval()
    N, steps = 4, 12
    x = torch.randn(steps, N, C)
    # swaps, forks and moves of a few rows among them ([1, 0, 2, 3], [0, 0, 2, 3], [0, 1, 3, 3])
    orders = [torch.tensor(o) for o in ([1, 1, 0, 3], [0, 1, 2, 3], [1, 0, 2, 3], [3, 3, 3, 0], [0, 0, 2, 3],
                                        [2, 0, 1, 1], [0, 1, 2, 3], [0, 1, 3, 3], [1, 2, 2, 0], [3, 2, 1, 0],
                                        [0, 0, 3])]
    history = [[i] for i in range(N)]  # history[row] = the input columns of x that row has seen
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
            # the spare exists from the first reorder on, until the batch shrinks (after step 10)
            assert ("spare" in buf) == (not grad and 1 <= t <= 10), f"step {t}: {sorted(buf)}"
            assert ("keys" in buf) == (t + 1 <= attn.keys_capacity), f"step {t}: {sorted(buf)}"
            if "spare" in buf:
                assert buf["spare"].data_ptr() != _causal_buffer(buf).data_ptr()
            if t < len(orders):
                order = orders[t]
                history = [history[o] + [o] for o in order.tolist()]
                attn.reorder_incremental_state(state, order)
                # left pending (not read here), so the next step gathers: the fused kernel, or
                # the PyTorch gather; the shrinking batch goes through the gather-first branch
                assert attn.get_incremental_state(state, attn.STATE_KEY)["order"].numel() == order.numel()


@pytest.mark.parametrize("decode_kernel", ["cpp", "torch"])
def test_causal_reorder_after_a_multi_token_prefix(decode_kernel):
    """A prefix fed in one call (chunked form, its final state is a view of one buffer), then
    reorders and single steps: still each row continues the right history."""
    torch.manual_seed(8)
    attn = CausalRFAttention(C, H, fmap(), gate=True, chunk_size=2, decode_kernel=decode_kernel).eval()
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


@pytest.mark.parametrize("steps", [1, 10], ids=["keys", "summary"])
@pytest.mark.parametrize("decode_kernel", ["cpp", "torch"])
def test_causal_identity_reorder_copies_nothing(steps, decode_kernel):
    attn = CausalRFAttention(C, H, fmap(), decode_kernel=decode_kernel).eval()
    with torch.no_grad():
        state = {}
        for _ in range(steps):
            attn(torch.randn(1, 3, C), incremental_state=state)
        S = _causal_buffer(attn._get_input_buffer(state))
        attn.reorder_incremental_state(state, torch.arange(3))
        assert _causal_buffer(attn._get_input_buffer(state)) is S


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


@pytest.mark.parametrize("kernel", ["gaussian", "arccos"])
def test_feature_map_without_autograd_reuses_a_prepared_matrix_until_something_changes(kernel):
    """Without autograd the module projects on a cached sigma-scaled matrix; it must give the
    reference features, and be made again after a redraw, an update of sigma, a load of other
    weights, or a change of dtype."""
    torch.manual_seed(12)
    m = fmap(kernel=kernel).eval()
    x = torch.randn(2, H, 3, C // H)

    def check():
        with torch.no_grad():
            fast = m(x)
        ref = m(x)  # under autograd: the reference feature_map
        assert ref.requires_grad and not fast.requires_grad
        torch.testing.assert_close(fast, ref, rtol=1e-5, atol=1e-6)
        return m.prepared_matrix(torch.float32)

    first = check()
    with torch.no_grad():
        assert m.prepared_matrix(torch.float32) is first, "reused while nothing changed"
    m.redraw(seed=123)
    second = check()
    assert second is not first
    with torch.no_grad():
        m.sigma.mul_(1.5)
    third = check()
    assert third is not second
    other = fmap(kernel=kernel)
    other.redraw(seed=7)
    m.load_state_dict(other.state_dict())
    fourth = check()
    assert fourth is not third
    with torch.no_grad():
        torch.testing.assert_close(m(x), other.eval()(x), rtol=0, atol=0)
        fp64 = m(x.double())
    assert fp64.dtype == torch.float64 and m.prepared_matrix(torch.float64).dtype == torch.float64
    with torch.inference_mode():
        torch.testing.assert_close(m(x), other(x), rtol=0, atol=0)


@pytest.mark.parametrize("steps", [3, 10], ids=["keys", "summary"])
@pytest.mark.parametrize("decode_kernel", ["cpp", "torch"])
def test_causal_reorders_are_deferred_to_the_next_step_and_compose(steps, decode_kernel):
    """A reorder only records the order (no state-sized copy: the gather happens in the next
    step, next to the update); two reorders before a step act as their composition, and a
    reader of the state sees them applied."""
    torch.manual_seed(13)
    attn = CausalRFAttention(C, H, fmap(), gate=True, decode_kernel=decode_kernel).eval()
    x = torch.randn(steps + 1, 4, C)
    a, b = torch.tensor([1, 1, 3, 0]), torch.tensor([2, 0, 0, 1])
    with torch.no_grad():
        state, ref_state = {}, {}
        for t in range(steps):
            attn(x[t : t + 1], incremental_state=state)
            attn(x[t : t + 1], incremental_state=ref_state)
        saved = attn.get_incremental_state(state, attn.STATE_KEY)
        before = _causal_buffer(saved)
        expected = _causal_values(saved, gated=True).clone()[:, a[b]] if "keys" in saved else before[a[b]]
        values = _causal_values(saved, gated=True).clone()  # (the unused rows of keys are garbage)
        attn.reorder_incremental_state(state, a)
        attn.reorder_incremental_state(state, b)
        held = attn.get_incremental_state(state, attn.STATE_KEY)
        assert _causal_buffer(held) is before, "nothing was gathered yet"
        assert torch.equal(_causal_values(held, gated=True), values), "nothing was gathered yet"
        attn.reorder_incremental_state(ref_state, a[b])
        torch.testing.assert_close(_causal_values(attn._get_input_buffer(state), gated=True), expected,
                                   rtol=0, atol=0)
        out, _ = attn(x[steps : steps + 1], incremental_state=state)
        ref, _ = attn(x[steps : steps + 1], incremental_state=ref_state)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)


def test_cross_beam_size_with_distinct_rows_falls_back_to_per_row_state():
    torch.manual_seed(4)
    attn = CrossRFAttention(C, H, fmap(1)).eval()
    attn.set_beam_size(2)
    enc = torch.randn(5, 4, C)  # four different sources, not beam copies
    query = torch.randn(1, 4, C)
    with torch.no_grad():
        state = {}
        out, _ = attn(query, enc, enc, incremental_state=state)
        full, _ = attn(query, enc, enc)
    assert all(t.shape[0] == 4 for t in _cross_state(attn._get_input_buffer(state)))
    torch.testing.assert_close(out, full, rtol=1e-5, atol=1e-6)


def test_decoder_builds_no_future_mask(translation_model):
    _, model = translation_model()
    assert model.decoder.buffered_future_mask(torch.zeros(4096, 1, 8)) is None


def test_decoder_layers_buffer_call_leaves_the_gather_to_the_fused_step():
    """fairseq's decoder layer calls ``_get_input_buffer`` before every self-attention step and
    does not read it: that call must not gather, so that the fused kernel gathers as it reads."""
    torch.manual_seed(14)
    attn = CausalRFAttention(C, H, fmap(), gate=True, decode_kernel="cpp").eval()
    ref_attn = CausalRFAttention(C, H, fmap(), gate=True, decode_kernel="torch").eval()
    ref_attn.load_state_dict(attn.state_dict())
    x = torch.randn(12, 4, C)
    order = torch.tensor([3, 1, 1, 0])
    with torch.no_grad():
        for steps in (3, 11):  # the attention form, the summary
            state, ref_state = {}, {}
            for t in range(steps):
                attn(x[t : t + 1], incremental_state=state)
                ref_attn(x[t : t + 1], incremental_state=ref_state)
            attn.reorder_incremental_state(state, order)
            ref_attn.reorder_incremental_state(ref_state, order)
            attn._get_input_buffer(state)  # what the layer does
            saved = attn.get_incremental_state(state, attn.STATE_KEY)
            assert "order" in saved, "the unread buffer gathered"
            before = _causal_buffer(saved)
            out, _ = attn(x[steps : steps + 1], incremental_state=state)
            ref, _ = ref_attn(x[steps : steps + 1], incremental_state=ref_state)
            torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
            saved = attn.get_incremental_state(state, attn.STATE_KEY)
            assert "order" not in saved and saved["spare"] is before  # gathered into a new buffer
            torch.testing.assert_close(_causal_values(saved, gated=True),
                                       _causal_values(ref_attn._get_input_buffer(ref_state), gated=True),
                                       rtol=1e-5, atol=1e-6)


def test_decode_kernel_choice_is_checked():
    with pytest.raises(ValueError, match="--rfa-decode-kernel must be one of auto, cpp, torch, got 'c'"):
        CausalRFAttention(C, H, fmap(), decode_kernel="c")
    attn = CausalRFAttention(C, H, fmap(), decode_kernel="cpp").eval()
    x = torch.randn(1, 2, C)
    with pytest.raises(ValueError, match="cpp runs fp32 CPU decoding with autograd off.*with autograd on"):
        attn(x, incremental_state={})
    with torch.no_grad(), pytest.raises(ValueError, match="cpp runs fp32 CPU decoding.*torch.float64"):
        attn.double()(x.double(), incremental_state={})


def test_auto_decode_kernel_warns_once_and_falls_back_when_it_cannot_be_built(monkeypatch, caplog):
    from rfa_fairseq import kernels

    monkeypatch.setattr(kernels, "_loaded", {"module": None, "error": None})

    def no_compiler(*args, **kwargs):
        raise OSError("no C++ compiler")

    monkeypatch.setattr("torch.utils.cpp_extension.load", no_compiler)
    torch.manual_seed(15)
    auto = CausalRFAttention(C, H, fmap(), decode_kernel="auto").eval()
    ref = CausalRFAttention(C, H, fmap(), decode_kernel="torch").eval()
    ref.load_state_dict(auto.state_dict())
    x = torch.randn(3, 2, C)
    with torch.no_grad(), caplog.at_level("WARNING", logger="rfa_fairseq.kernels"):
        state, ref_state = {}, {}
        for t in range(3):
            out, _ = auto(x[t : t + 1], incremental_state=state)
            expected, _ = ref(x[t : t + 1], incremental_state=ref_state)
            torch.testing.assert_close(out, expected, rtol=0, atol=0)
    warnings = [r for r in caplog.records if "could not be built (OSError: no C++ compiler)" in r.getMessage()]
    assert len(warnings) == 1
    with pytest.raises(RuntimeError, match="could not be built.*use --rfa-decode-kernel torch"):
        kernels.load()


def test_feature_map_decode_kernel_runs_the_compiled_map_only_without_autograd(monkeypatch):
    """``decode_kernel`` of the feature map: cpp and auto run the compiled map for fp32 inputs
    without autograd (equal to the PyTorch ops to fp32 rounding), torch never does, and under
    autograd (training) no choice runs it or refuses to run."""
    from rfa_fairseq import kernels

    calls = []
    original = kernels.feature_map

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(kernels, "feature_map", counted)
    torch.manual_seed(16)
    x = torch.randn(3, 5, H, C // H).transpose(1, 2)  # [B, H, T, K], strided
    maps = {}
    for choice in ("cpp", "auto", "torch"):
        maps[choice] = RandomFeatureMap(H, C // H, 40, decode_kernel=choice).eval()
        maps[choice].load_state_dict(maps["cpp"].state_dict())
    with torch.no_grad():
        ref = maps["torch"](x)
        assert calls == []
        for n, choice in enumerate(("cpp", "auto"), start=1):
            torch.testing.assert_close(maps[choice](x), ref, rtol=0, atol=1e-6)
            assert len(calls) == n
        with pytest.raises(ValueError, match="cpp runs fp32 CPU decoding.*torch.float64"):
            maps["cpp"].double()(x.double())
    maps["cpp"].float()
    trained = maps["cpp"](x)
    assert trained.requires_grad and len(calls) == 2, "under autograd the PyTorch ops run"
    torch.testing.assert_close(trained.detach(), ref, rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="--rfa-decode-kernel must be one of auto, cpp, torch, got 'c'"):
        RandomFeatureMap(H, C // H, 40, decode_kernel="c")
