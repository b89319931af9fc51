"""Causal RFA by fla-core's kernels (``ops/causal_rfa/fla.py``) against the naive loop in fp64: outputs,
final state and gradients, padding, an initial state, and a chunked prefix continued by the package's
one-token steps. On a CPU the kernels run in Triton's interpreter (``rfa_test_utils.fla_on_this_machine``);
skipped where fla-core is not installed."""
import pytest
import torch
import torch.nn.functional as F

from rfa_test_utils import fla_on_this_machine, skip_where_fla_refuses_gated_backward
from test_causal_rfa import assert_close, positive_features

from rfa_fairseq.ops import naive_causal_rfa, recurrent_causal_rfa_step
from rfa_fairseq.ops.causal_rfa.fla import fla_causal_rfa

B, H, T, Fd, K = 2, 2, 100, 16, 7  # two chunks of fla's 64; K + 1 = 8 needs no column of zeros


@pytest.fixture(autouse=True)
def _fla():
    fla_on_this_machine()


def device():
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def inputs(gen, gated, state=False, K=K):
    q, k = positive_features(gen, 2, B, H, T, Fd).double().unbind(0)
    q, k = q / Fd, k / Fd
    v = torch.randn(B, H, T, K, generator=gen, dtype=torch.float64)
    log_g = F.logsigmoid(torch.randn(B, H, T, generator=gen, dtype=torch.float64) + 2) if gated else None
    s0 = torch.rand(B, H, Fd, K + 1, generator=gen, dtype=torch.float64) if state else None
    return q, k, v, log_g, s0


def both(op_inputs, convex=True, final=True):
    """(outputs, final state, gradients of every input) of the naive loop (fp64, CPU) and fla (fp32)."""
    results = []
    for op, dtype, dev in ((naive_causal_rfa, torch.float64, "cpu"), (fla_causal_rfa, torch.float32, device())):
        xs = [None if x is None else x.detach().to(dev, dtype, copy=True).requires_grad_() for x in op_inputs]
        out, state = op(*xs, output_final_state=final, convex=convex)
        loss = (out * torch.linspace(-1, 1, out.size(-1), device=dev, dtype=dtype)).sum()
        if final:
            loss = loss + state.square().sum()
        loss.backward()
        results.append((out, state, [None if x is None else x.grad for x in xs]))
    return results


@pytest.mark.parametrize("gated,convex", [(False, True), (True, True), (True, False)])
@pytest.mark.parametrize("initial", [False, True])
def test_fla_matches_the_naive_loop(gen, gated, convex, initial):
    skip_where_fla_refuses_gated_backward(gated)
    (ref, ref_state, ref_grads), (out, state, grads) = both(inputs(gen, gated, initial), convex=convex)
    assert out.dtype == torch.float32 and state.dtype == torch.float32
    assert_close(out, ref, 1e-4, "out")
    assert_close(state, ref_state, 1e-4, "final state")
    for name, g, r in zip(["q", "k", "v", "log g", "initial state"], grads, ref_grads):
        if r is not None:
            assert_close(g, r, 1e-4, f"d {name}")


def test_fla_pads_v_to_an_even_width(gen):
    """K + 1 odd: fla gets a column of zeros, which must not reach the outputs, state or gradients."""
    skip_where_fla_refuses_gated_backward(True)
    (ref, ref_state, ref_grads), (out, state, grads) = both(inputs(gen, True, True, K=8))
    assert state.shape == ref_state.shape == (B, H, Fd, 9)
    assert_close(out, ref, 1e-4, "out")
    assert_close(state, ref_state, 1e-4, "final state")
    for name, g, r in zip(["q", "k", "v", "log g", "initial state"], grads, ref_grads):
        assert_close(g, r, 1e-4, f"d {name}")


def test_fla_padded_steps_neither_write_nor_decay(gen):
    """Right padding as the modules make it (phi(k) = 0, log g = 0): the real positions' outputs and the final
    state are the unpadded sequence's."""
    q, k, v, log_g, _ = inputs(gen, True)
    real = 70
    k, log_g = k.clone(), log_g.clone()
    k[1, :, real:] = 0.0
    log_g[1, :, real:] = 0.0
    out, state = fla_causal_rfa(*(x.float().to(device()) for x in (q, k, v, log_g)), output_final_state=True)
    ref, ref_state = naive_causal_rfa(q[1:, :, :real], k[1:, :, :real], v[1:, :, :real], log_g[1:, :, :real],
                                      output_final_state=True)
    assert_close(out[1:, :, :real], ref, 1e-4, "real positions")
    assert_close(state[1:], ref_state, 1e-4, "final state")


def test_fla_prefix_then_one_token_steps(gen):
    """A prompt by fla, continued by the decoder's recurrent step from fla's state: the whole naive run."""
    q, k, v, log_g, _ = inputs(gen, True)
    ref, _ = naive_causal_rfa(q, k, v, log_g)
    prefix = 50
    x32 = [x.float().to(device()) for x in (q, k, v, log_g)]
    out, state = fla_causal_rfa(*(x[:, :, :prefix] for x in x32), output_final_state=True)
    steps = []
    for t in range(prefix, T):
        o, state = recurrent_causal_rfa_step(*(x[:, :, t] for x in x32), state)
        steps.append(o)
    assert_close(torch.cat([out, torch.stack(steps, dim=2)], dim=2), ref, 1e-4, "prefix + steps")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fla_half_precision_keeps_the_state_in_fp32(gen, dtype):
    """Mixed precision: half inputs, a fp32 state, outputs in the inputs' dtype close to the fp64 loop."""
    if dtype == torch.bfloat16 and not torch.cuda.is_available():
        pytest.skip("Triton's interpreter computes bf16 dots wrongly (outputs of 1e10 where fp16's are right)")
    q, k, v, log_g, s0 = inputs(gen, True, True)
    out, state = fla_causal_rfa(q.to(device(), dtype), k.to(device(), dtype), v.to(device(), dtype),
                                log_g.float().to(device()), s0.float().to(device()), output_final_state=True)
    ref, ref_state = naive_causal_rfa(q, k, v, log_g, s0, output_final_state=True)
    assert out.dtype == dtype and state.dtype == torch.float32
    assert_close(out, ref, 3e-2, "out")
    assert_close(state, ref_state, 3e-2, "final state")


def test_fla_refuses_fp64_by_name(gen):
    q, k, v, log_g, _ = inputs(gen, True)
    with pytest.raises(TypeError, match="fp32, fp16 or bf16"):
        fla_causal_rfa(q, k, v, log_g)
