"""Causal RFA with a local exact window (ops/causal_rfa/window.py): the exact kernels are what the
features estimate; the chunked form and the recurrent step equal the naive matrix in outputs, states
and gradients, from any split of a sequence into a prefix and its continuation."""
import pytest
import torch

from rfa_fairseq.ops import naive_causal_rfa
from rfa_fairseq.ops import WindowState, naive_window_causal_rfa, window_causal_rfa, window_causal_rfa_step
from rfa_fairseq.ops.feature_maps import exact_kernel, features, sample_random_matrix, scale_inputs

B, H, K, D = 2, 3, 8, 16
GATES = [pytest.param((False, True), id="rfa"), pytest.param((True, True), id="gate"),
         pytest.param((True, False), id="decay")]


def inputs(gen, T, kernel="gaussian", gate=True, dtype=torch.float64):
    x, y, v = (torch.randn(B, H, T, K, generator=gen, dtype=dtype) for _ in range(3))
    sigma = torch.rand(H, K, generator=gen, dtype=dtype) + 0.5
    log_g = torch.nn.functional.logsigmoid(torch.randn(B, H, T, generator=gen, dtype=dtype) + 1.0) if gate else None
    matrix = sample_random_matrix("orthogonal", H, D, K, gen).to(dtype)
    return scale_inputs(kernel, x, sigma), scale_inputs(kernel, y, sigma), v, log_g, matrix


def part(t, a, b):
    return None if t is None else t[:, :, a:b]


@pytest.mark.parametrize("kernel", ["gaussian", "favor", "arccos"])
def test_exact_kernels_are_what_the_features_estimate(kernel, gen):
    """The mean of phi(x) . phi(y) over 4,000 draws of 64 rows is within 3% of the exact kernel."""
    x, y = (scale_inputs(kernel, torch.randn(1, 1, 5, K, generator=gen, dtype=torch.float64),
                         torch.full((1, K), 0.8, dtype=torch.float64)) for _ in range(2))
    matrix = sample_random_matrix("gaussian", 4000, 64, K, gen).double()
    estimate = (features(kernel, x.expand(1, 4000, 5, K), matrix)
                @ features(kernel, y.expand(1, 4000, 5, K), matrix).transpose(-1, -2)).mean(1)
    exact = exact_kernel(kernel, x, y)[:, 0]
    torch.testing.assert_close(estimate, exact, rtol=0.03, atol=0.003)


def window_op(op, kernel, matrix, window, **kw):
    """``op`` with its window keywords bound: the contract of every causal form."""
    return lambda q, k, v, lg=None, state=None, final=False: op(q, k, v, lg, state, final, kernel=kernel,
                                                                random_matrix=matrix, window=window, **kw)


@pytest.mark.parametrize("gate,convex", [(False, True), (True, True), (True, False)])
def test_a_window_of_zero_keys_is_plain_rfa(gate, convex, gen):
    x, y, v, log_g, matrix = inputs(gen, 23, gate=gate)
    ref, ref_state = naive_causal_rfa(features("gaussian", x, matrix), features("gaussian", y, matrix), v, log_g,
                                      output_final_state=True, convex=convex)
    out, state = window_op(naive_window_causal_rfa, "gaussian", matrix, 0, convex=convex)(x, y, v, log_g, None, True)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(state.state, ref_state)
    out3, _ = window_op(naive_window_causal_rfa, "gaussian", matrix, 3, convex=convex)(x, y, v, log_g)
    assert (out3 - ref).abs().max() > 1e-3


def assert_states_equal(a, b):
    for name, s, t in zip(WindowState._fields, a, b):
        torch.testing.assert_close(s, t, rtol=1e-10, atol=1e-10, msg=name)


@pytest.mark.parametrize("kernel", ["gaussian", "favor", "arccos"])
@pytest.mark.parametrize("gate", GATES)
@pytest.mark.parametrize("window", [1, 4, 7, 40])
def test_chunked_form_and_steps_equal_the_naive_reference(window, gate, kernel, gen):
    """fp64: the whole sequence at once; a prefix then the rest from its state, by the naive reference, by the
    chunked form, and by steps (the ring then in another order) then the chunked form; outputs and final
    states agree."""
    gated, convex = gate
    T, split = 29, 11
    x, y, v, log_g, matrix = inputs(gen, T, kernel, gated)
    naive = window_op(naive_window_causal_rfa, kernel, matrix, window, convex=convex)
    chunk = window_op(window_causal_rfa, kernel, matrix, window, convex=convex, chunk_size=5)
    args = lambda a, b: (x[:, :, a:b], y[:, :, a:b], v[:, :, a:b], part(log_g, a, b))  # noqa: E731
    ref, final = naive(*args(0, T), None, True)
    whole, whole_final = chunk(*args(0, T), None, True)
    torch.testing.assert_close(whole, ref, rtol=1e-10, atol=1e-10)
    assert_states_equal(whole_final, final)
    for op in (naive, chunk):
        first, state = op(*args(0, split), None, True)
        rest, split_final = op(*args(split, T), state, True)
        torch.testing.assert_close(torch.cat([first, rest], 2), ref, rtol=1e-10, atol=1e-10)
        assert_states_equal(split_final, final)
    steps, stepped = [], state
    for t in range(split, T - 4):
        lg = None if log_g is None else log_g[:, :, t]
        out, stepped = window_causal_rfa_step(x[:, :, t], y[:, :, t], v[:, :, t], lg, stepped, kernel=kernel,
                                              random_matrix=matrix, convex=convex)
        steps.append(out)
    # the last 4 tokens by the chunked form and by the naive reference from the steps' ring of keys
    for op in (chunk, naive):
        last, last_state = op(*args(T - 4, T), stepped, True)
        torch.testing.assert_close(torch.cat([torch.stack(steps, 2), last], 2), ref[:, :, split:], rtol=1e-10,
                                   atol=1e-10)
        assert_states_equal(last_state, final)


@pytest.mark.parametrize("gate", GATES)
def test_chunked_gradients_equal_the_naive_reference(gate, gen):
    """Gradients of the outputs and of the final state, through the inputs and the initial state."""
    gated, convex = gate
    x, y, v, log_g, matrix = inputs(gen, 26, gate=gated)
    _, start = window_causal_rfa(x[:, :, :9], y[:, :, :9], v[:, :, :9], part(log_g, 0, 9), None, True,
                                 kernel="gaussian", random_matrix=matrix, window=6)
    start = WindowState(*(t.requires_grad_() if t.is_floating_point() else t for t in start))
    leaves = [t.requires_grad_() for t in (x, y, v) + ((log_g,) if gated else ())] + [start.state, start.values]
    outs = [window_op(op, "gaussian", matrix, 6, convex=convex)(x, y, v, log_g, start, True)
            for op in (window_causal_rfa, naive_window_causal_rfa)]
    w = torch.randn(outs[0][0].shape, generator=gen, dtype=x.dtype)
    ws = torch.randn(outs[0][1].state.shape, generator=gen, dtype=x.dtype)
    grads = [torch.autograd.grad((o * w).sum() + (s.state * ws).sum() + s.values.sum(), leaves) for o, s in outs]
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10)


def test_padding_changes_nothing_at_the_tokens(gen):
    """Pads before a sequence (chunked form) and a pad step neither write nor decay: the outputs and the state
    are those without them, but for the place a pad takes in the window."""
    x, y, v, log_g, matrix = inputs(gen, 17)
    op = window_op(window_causal_rfa, "gaussian", matrix, 5)
    out, state = op(x, y, v, log_g, None, True)
    P = 4
    padded = [torch.cat([torch.randn(B, H, P, *t.shape[3:], generator=gen, dtype=t.dtype), t], 2) for t in (x, y, v)]
    lg = torch.cat([torch.randn(B, H, P, generator=gen, dtype=log_g.dtype).clamp_max(0), log_g], 2)
    pad = (torch.arange(17 + P) < P).expand(B, 1, -1)
    out_p, state_p = window_op(window_causal_rfa, "gaussian", matrix, 5, pad=pad)(*padded, lg, None, True)
    torch.testing.assert_close(out_p[:, :, P:], out)
    torch.testing.assert_close(state_p.state, state.state)
    # a pad step: the oldest key leaves the ring undecayed, the pad takes its slot with no value
    pad1 = torch.ones(B, 1, dtype=torch.bool)
    _, after = window_causal_rfa_step(x[:, :, 3], y[:, :, 3], v[:, :, 3], log_g[:, :, 3].masked_fill(pad1, 0.0), state,
                                      kernel="gaussian", random_matrix=matrix, pad=pad1)
    leaving = features("gaussian", state.keys[:, :, :1], matrix).transpose(-1, -2) @ state.values[:, :, :1]
    torch.testing.assert_close(after.state, state.state + leaving)
    assert after.values[:, :, 0].abs().max() == 0 and torch.equal(after.values[:, :, 1:], state.values[:, :, 1:])
    assert torch.equal(after.slot, torch.ones(B, dtype=torch.long))


def test_strong_gates_over_a_long_sequence_keep_gradients_finite(gen):
    """fp32, a gate of e^-5 at every step and a length that is not a multiple of the window: the
    cumulative log-gates reach -185, whose differences must never be exponentiated upwards."""
    x, y, v, _, matrix = inputs(gen, 37, dtype=torch.float32)
    log_g = torch.full((B, H, 37), -5.0, requires_grad=True)
    out, _ = window_op(window_causal_rfa, "gaussian", matrix, 8, chunk_size=5)(x, y, v.requires_grad_(), log_g)
    out.sum().backward()
    assert torch.isfinite(out).all() and torch.isfinite(log_g.grad).all() and torch.isfinite(v.grad).all()


@pytest.mark.slow  # Inductor compiles the step (about a minute)
def test_the_compiled_step_compiles_once_and_equals_the_eager_step(gen):
    """The ring's position is a tensor, so torch.compile traces one graph for every step."""
    from torch._dynamo.utils import counters

    x, y, v, log_g, matrix = inputs(gen, 12, dtype=torch.float32)
    _, state = window_causal_rfa(x, y, v, log_g, None, True, kernel="gaussian", random_matrix=matrix, window=5)
    eager = WindowState(*(t.clone() for t in state))
    torch._dynamo.reset()
    counters.clear()
    step = torch.compile(lambda *a: window_causal_rfa_step(*a, kernel="gaussian", random_matrix=matrix, inplace=True),
                         dynamic=False)
    with torch.no_grad():
        for t in range(8):
            q, k, w = (torch.randn(B, H, K, generator=gen) for _ in range(3))
            lg = torch.nn.functional.logsigmoid(torch.randn(B, H, generator=gen))
            out, state = step(q, k, w, lg, state)
            ref, eager = window_causal_rfa_step(q, k, w, lg, eager, kernel="gaussian", random_matrix=matrix)
            torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert counters["stats"]["unique_graphs"] == 1 and not counters["recompiles"]
