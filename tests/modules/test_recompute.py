"""Training with ``recompute`` (``--rfa-recompute``): the attention keeps only its heads for the backward
pass and computes the features and the chunked form again there. Same outputs and gradients as
keeping everything, a fraction of the memory held between forward and backward, and the random
draw of its own forward even when the buffer is redrawn in place before the backward.

A sequence longer than ``recompute_segment`` (``--rfa-recompute-segment``) is recomputed segment
by segment, the state carried from one to the next: the same outputs, gradients and final state
again, and a backward pass whose peak is one segment's intermediates, not the sequence's."""
import copy

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from rfa_fairseq.modules import CausalRFAttention, CrossRFAttention, RandomFeatureMap

C, H = 64, 4


def fmap(module_id=0, D=32):
    return RandomFeatureMap(H, C // H, D, module_id=module_id)


class _Storages(TorchDispatchMode):
    """Every storage an op writes while the mode is on (weakly), with its size."""

    def __init__(self):
        super().__init__()
        self.made = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                self.made[storage.data_ptr()] = (StorageWeakRef(storage), storage.nbytes())
        return out


def retained_bytes(fn):
    """``fn()`` and the bytes of the storages it made that are still alive after it returned:
    what autograd keeps for the backward pass, plus the output."""
    mode = _Storages()
    with mode:
        out = fn()
    return out, sum(n for ref, n in mode.made.values() if not ref.expired())


class _PeakStorages(_Storages):
    """As _Storages, and the largest total of the storages made under the mode that were alive
    at once (checked after every op)."""

    def __init__(self):
        super().__init__()
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = super().__torch_dispatch__(func, types, args, kwargs)
        self.peak = max(self.peak, sum(n for ref, n in self.made.values() if not ref.expired()))
        return out


def _grads(out, params):
    return torch.autograd.grad(out.square().sum(), params)


@pytest.mark.parametrize("module", ["causal", "gate", "cross"])
def test_recompute_equals_storing_with_a_fraction_of_the_memory(module):
    torch.manual_seed(0)
    if module == "cross":
        store = CrossRFAttention(C, H, fmap(1), recompute=False).train()
        query, enc = torch.randn(64, 2, C, requires_grad=True), torch.randn(80, 2, C, requires_grad=True)
        mask = torch.arange(80)[None, :] >= torch.tensor([[80], [51]])
        inputs = [query, enc]

        def run(attn):
            return attn(query, enc, enc, key_padding_mask=mask)[0]
    else:
        store = CausalRFAttention(C, H, fmap(), gate=module == "gate", chunk_size=16, recompute=False).train()
        x = torch.randn(256, 2, C, requires_grad=True)
        mask = torch.arange(256)[None, :] < torch.tensor([[0], [37]])  # left padding
        inputs = [x]

        def run(attn):
            return attn(x, key_padding_mask=mask)[0]
    recompute = copy.deepcopy(store)
    recompute.recompute = True
    out_store, kept_store = retained_bytes(lambda: run(store))
    out_recompute, kept_recompute = retained_bytes(lambda: run(recompute))
    assert torch.equal(out_store, out_recompute), "the same ops in the same order"
    # causal: 0.16-0.24 of storing with these sizes; cross: 0.35 (its output is a larger share)
    assert kept_recompute < (0.5 if module == "cross" else 0.3) * kept_store, (kept_recompute, kept_store)
    g_store = _grads(out_store, list(store.parameters()) + inputs)
    g_recompute = _grads(out_recompute, list(recompute.parameters()) + inputs)
    for a, b in zip(g_store, g_recompute):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("module", ["causal", "cross"])
def test_recompute_uses_the_random_draw_of_its_own_forward(module):
    """The buffer is redrawn in place at the next training step; a backward pass that runs after
    that (a second forward before the first backward) still differentiates the first draw."""
    torch.manual_seed(0)
    if module == "cross":
        attn = CrossRFAttention(C, H, fmap(1), recompute=True).double().train()
        enc = torch.randn(9, 2, C, dtype=torch.float64)
        call = lambda a, x: a(x, enc, enc)[0]  # noqa: E731
    else:
        attn = CausalRFAttention(C, H, fmap(), gate=True, chunk_size=4, recompute=True).double().train()
        call = lambda a, x: a(x)[0]  # noqa: E731
    x = torch.randn(11, 2, C, dtype=torch.float64, requires_grad=True)
    attn.feature_map.set_num_updates(1)
    out = call(attn, x)
    reference = copy.deepcopy(attn)  # the same draw (its seed is the current step's: no redraw)
    reference.recompute = False
    ref = call(reference, x)
    assert torch.equal(reference.feature_map.random_matrix, attn.feature_map.random_matrix)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    first = attn.feature_map.random_matrix.clone()
    attn.feature_map.set_num_updates(2)
    call(attn, x)  # redraws in place
    assert not torch.equal(first, attn.feature_map.random_matrix)
    proj = lambda m: m.in_proj if hasattr(m, "in_proj") else m.q_proj  # noqa: E731  (causal, cross)
    g = _grads(out, [attn.feature_map.sigma, proj(attn).weight, x])
    g_ref = _grads(ref, [reference.feature_map.sigma, proj(reference).weight, x])
    for a, b in zip(g, g_ref):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_recompute_applies_only_under_autograd_and_not_to_decoding():
    """Without autograd there is nothing to keep: the plain path runs (no checkpoint), and
    incremental decoding never recomputes."""
    torch.manual_seed(0)
    attn = CausalRFAttention(C, H, fmap(), gate=True, recompute=True).eval()
    x = torch.randn(7, 2, C)
    calls = []
    original = attn._segment

    def counted(*a, **kw):
        calls.append(torch.is_grad_enabled())
        return original(*a, **kw)

    attn._segment = counted
    with torch.no_grad():
        plain, _ = attn(x)
    assert calls == [False]
    with_grad, _ = attn(x)
    assert calls == [False, True], "one call in the forward; the recomputation waits for backward"
    # equal up to rounding: without autograd the feature map is the compiled kernel (--rfa-decode-kernel)
    torch.testing.assert_close(plain, with_grad.detach(), rtol=1e-5, atol=1e-6)
    with_grad.sum().backward()
    assert calls == [False, True, True], "computed again in the backward pass"
    state = {}
    attn(x[:1], incremental_state=state)
    assert calls == [False, True, True]


def _causal(gate, segment, recompute=False):
    torch.manual_seed(0)
    return CausalRFAttention(C, H, fmap(), gate=gate, chunk_size=16, recompute=recompute,
                             recompute_segment=segment).double().train()


@pytest.mark.parametrize("gate", [False, True])
@pytest.mark.parametrize("carry", [False, True])
def test_segments_equal_the_whole_sequence(gate, carry):
    """Outputs, gradients (inputs, every parameter, the entering state) and the final state of a
    sequence taken in segments of 48 (not a multiple of the length, nor of the chunk) equal those
    of the sequence taken whole with every intermediate kept."""
    whole, segmented = _causal(gate, 0), _causal(gate, 48)
    x = torch.randn(130, 2, C, dtype=torch.float64, requires_grad=True)
    mask = torch.arange(130)[None, :] < torch.tensor([[0], [37]])  # left padding
    Fd = whole.feature_map.output_dim
    state0 = torch.randn(2, H, Fd, C // H + 1, dtype=torch.float64).abs().requires_grad_() if carry else None
    results = []
    for attn in (whole, segmented):
        out, final, _ = attn._tokens(x, mask, state0, output_final_state=True)
        loss = out.square().sum() + final.square().sum()
        inputs = [x] + ([state0] if carry else [])
        params = [p for name, p in attn.named_parameters() if not name.startswith("out_proj")]  # not used here
        results.append((out, final, torch.autograd.grad(loss, inputs + params)))
    (out_w, final_w, g_w), (out_s, final_s, g_s) = results
    torch.testing.assert_close(out_s, out_w, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(final_s, final_w, rtol=1e-10, atol=1e-12)
    for a, b in zip(g_s, g_w):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)
    # the module's own entry point takes the same path
    torch.testing.assert_close(segmented(x, key_padding_mask=mask)[0], whole(x, key_padding_mask=mask)[0],
                               rtol=1e-10, atol=1e-12)
    if carry:  # and a block of a stateful stream (an incremental call of many tokens) carries the same state on
        states = [{}, {}]
        for attn, state in zip((whole, segmented), states):
            attn(x, incremental_state=state)
        torch.testing.assert_close(segmented._get_input_buffer(states[1])["state"],
                                   whole._get_input_buffer(states[0])["state"], rtol=1e-10, atol=1e-12)


def test_segments_bound_the_backward_peak():
    """The peak of a training step over a 1,024-token sequence, in segments of 128: under half of
    taking it whole (every intermediate kept) and of recomputing it whole."""
    x = torch.randn(1024, 1, C, requires_grad=True)
    peaks = {}
    for name, attn in [("keep", _causal(True, 0).float()), ("recompute whole", _causal(True, 0, recompute=True).float()),
                       ("segments", _causal(True, 128).float())]:
        mode = _PeakStorages()
        with mode:
            attn(x)[0].square().sum().backward()
        peaks[name] = mode.peak
    assert peaks["segments"] < 0.5 * min(peaks["keep"], peaks["recompute whole"]), peaks


def test_recompute_segment_is_checked():
    with pytest.raises(ValueError, match="recompute_segment"):
        CausalRFAttention(C, H, fmap(), recompute_segment=-1)
