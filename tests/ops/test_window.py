"""Causal RFA with a local exact window (ops/causal_rfa/window.py): the exact kernels are what the
features estimate; the chunked form and the recurrent step equal the naive matrix in outputs, states
and gradients, from any split of a sequence into a prefix and its continuation."""
import pytest
import torch

from rfa_fairseq.ops import naive_causal_rfa
from rfa_fairseq.ops.causal_rfa.window import naive_window_causal_rfa, window_causal_rfa, window_causal_rfa_step
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


@pytest.mark.parametrize("gate,convex", [(False, True), (True, True), (True, False)])
def test_a_window_of_zero_keys_is_plain_rfa(gate, convex, gen):
    x, y, v, log_g, matrix = inputs(gen, 23, gate=gate)
    ref, _ = naive_causal_rfa(features("gaussian", x, matrix), features("gaussian", y, matrix), v, log_g, convex=convex)
    torch.testing.assert_close(naive_window_causal_rfa(x, y, v, log_g, "gaussian", matrix, 0, convex=convex), ref)
    assert (naive_window_causal_rfa(x, y, v, log_g, "gaussian", matrix, 3, convex=convex) - ref).abs().max() > 1e-3


@pytest.mark.parametrize("kernel", ["gaussian", "favor", "arccos"])
@pytest.mark.parametrize("gate", GATES)
@pytest.mark.parametrize("window", [1, 4, 7, 40])
def test_chunked_form_and_steps_equal_the_naive_matrix(window, gate, kernel, gen):
    """fp64: the whole sequence at once; a prefix then the rest from its state, by the chunked form, and by
    steps then the chunked form from their ring of keys; the final states agree."""
    gated, convex = gate
    T, split = 29, 11
    x, y, v, log_g, matrix = inputs(gen, T, kernel, gated)
    ref = naive_window_causal_rfa(x, y, v, log_g, kernel, matrix, window, convex=convex)
    whole, final = window_causal_rfa(x, y, v, log_g, kernel, matrix, window, output_final_state=True, convex=convex,
                                     chunk_size=5)
    torch.testing.assert_close(whole, ref, rtol=1e-10, atol=1e-10)
    args = lambda a, b: (x[:, :, a:b], y[:, :, a:b], v[:, :, a:b], part(log_g, a, b), kernel, matrix)  # noqa: E731
    first, state = window_causal_rfa(*args(0, split), window, output_final_state=True, convex=convex)
    rest, chunked = window_causal_rfa(*args(split, T), window, state, output_final_state=True, convex=convex)
    torch.testing.assert_close(torch.cat([first, rest], 2), ref, rtol=1e-10, atol=1e-10)
    steps, stepped = [], state
    for t in range(split, T - 4):
        lg = None if log_g is None else log_g[:, :, t]
        out, stepped = window_causal_rfa_step(x[:, :, t], y[:, :, t], v[:, :, t], lg, kernel, matrix, stepped,
                                              convex=convex)
        steps.append(out)
    # the last 4 tokens by the chunked form from the steps' ring of keys
    last, stepped = window_causal_rfa(*args(T - 4, T), window, stepped, output_final_state=True, convex=convex)
    torch.testing.assert_close(torch.cat([torch.stack(steps, 2), last], 2), ref[:, :, split:], rtol=1e-10, atol=1e-10)
    for a, b, c in zip(final, chunked, stepped):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(a, c, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("gate", GATES)
def test_chunked_gradients_equal_the_naive_matrix(gate, gen):
    gated, convex = gate
    x, y, v, log_g, matrix = inputs(gen, 26, gate=gated)
    leaves = [t.requires_grad_() for t in (x, y, v) + ((log_g,) if gated else ())]
    out, _ = window_causal_rfa(x, y, v, log_g, "gaussian", matrix, 6, convex=convex, chunk_size=4)
    ref = naive_window_causal_rfa(x, y, v, log_g, "gaussian", matrix, 6, convex=convex)
    w = torch.randn(out.shape, generator=gen, dtype=out.dtype)
    for a, b in zip(torch.autograd.grad((out * w).sum(), leaves), torch.autograd.grad((ref * w).sum(), leaves)):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10)


def test_left_padding_changes_nothing_at_the_tokens(gen):
    """Pads before a sequence neither write nor decay: its outputs and state are those without them."""
    x, y, v, log_g, matrix = inputs(gen, 17)
    out, state = window_causal_rfa(x, y, v, log_g, "gaussian", matrix, 5, output_final_state=True)
    P = 4
    padded = [torch.cat([torch.randn(B, H, P, *t.shape[3:], generator=gen, dtype=t.dtype), t], 2) for t in (x, y, v)]
    lg = torch.cat([torch.randn(B, H, P, generator=gen, dtype=log_g.dtype).clamp_max(0), log_g], 2)
    pad = (torch.arange(17 + P) < P).expand(B, 1, -1)
    out_p, state_p = window_causal_rfa(*padded, lg, "gaussian", matrix, 5, output_final_state=True, pad=pad)
    torch.testing.assert_close(out_p[:, :, P:], out)
    torch.testing.assert_close(state_p.state, state.state)


def test_strong_gates_over_a_long_sequence_keep_gradients_finite(gen):
    """fp32, a gate of e^-5 at every step and a length that is not a multiple of the window: the
    cumulative log-gates reach -185, whose differences must never be exponentiated upwards."""
    x, y, v, _, matrix = inputs(gen, 37, dtype=torch.float32)
    log_g = torch.full((B, H, 37), -5.0, requires_grad=True)
    out, _ = window_causal_rfa(x, y, v.requires_grad_(), log_g, "gaussian", matrix, 8, chunk_size=5)
    out.sum().backward()
    assert torch.isfinite(out).all() and torch.isfinite(log_g.grad).all() and torch.isfinite(v.grad).all()
