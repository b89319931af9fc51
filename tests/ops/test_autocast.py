"""Under torch.autocast (fairseq's --amp) the attention ops keep their own dtypes: states, the normaliser and the
division in fp32, results equal to those without autocast (``ops.denominator.exact_dtypes``). Without that, CPU
autocast in bf16 moves the chunked form's output by about 1e-2 and returns its state in bf16."""
import pytest
import torch
import torch.nn.functional as F

from rfa_fairseq.modules import CausalRFAttention, CrossRFAttention, RandomFeatureMap
from rfa_fairseq.ops import (chunk_causal_rfa, cross_rfa_apply, cross_rfa_quadratic, cross_rfa_state, cross_rfa_weights,
                             naive_causal_rfa, naive_cross_rfa, recurrent_causal_rfa_step)

B, H, T, S, Fd, K = 2, 2, 150, 40, 16, 8
HALF = [pytest.param(torch.bfloat16, id="bf16"), pytest.param(torch.float16, id="fp16")]


def _inputs():
    g = torch.Generator().manual_seed(0)
    q, k = (torch.rand(B, H, n, Fd, generator=g) / Fd**0.5 + 1e-3 for n in (T, T))
    v = torch.randn(B, H, T, K, generator=g)
    log_g = F.logsigmoid(torch.randn(B, H, T, generator=g) + 2)
    return q, k, v, log_g


def _ops():
    q, k, v, log_g = _inputs()
    state = chunk_causal_rfa(q, k, v, log_g, output_final_state=True)[1]
    pad = torch.zeros(B, S, dtype=torch.bool)
    pad[0, :5] = True
    ks, vs = k[:, :, :S], v[:, :, :S]
    return {
        "chunk": lambda: chunk_causal_rfa(q, k, v, log_g, output_final_state=True),
        "naive": lambda: naive_causal_rfa(q[:, :, :20], k[:, :, :20], v[:, :, :20], log_g[:, :, :20],
                                          output_final_state=True),
        "step": lambda: recurrent_causal_rfa_step(q[:, :, 0], k[:, :, 0], v[:, :, 0], log_g[:, :, 0], state.clone()),
        "cross_state": lambda: cross_rfa_state(ks, vs, pad),
        "cross_apply": lambda: cross_rfa_apply(q, cross_rfa_state(ks, vs, pad)),
        "cross_quadratic": lambda: cross_rfa_quadratic(q, ks, vs, pad),
        "cross_weights": lambda: cross_rfa_weights(q, ks, pad),
        "naive_cross": lambda: naive_cross_rfa(q, ks, vs, pad),
    }


def _tensors(out):
    """The tensors of an op's result (a tensor, or tuples of them, states and Nones)."""
    if torch.is_tensor(out):
        return [out]
    return [t for x in out for t in _tensors(x)] if isinstance(out, tuple) else []


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("name", list(_ops()))
def test_ops_under_autocast_equal_ops_without(name, dtype):
    op = _ops()[name]
    expected = _tensors(op())
    with torch.autocast("cpu", dtype=dtype):
        got = _tensors(op())
    assert [t.dtype for t in got] == [t.dtype for t in expected]
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", HALF)
def test_modules_under_autocast_keep_fp32_states(dtype):
    """A layer under autocast: half-precision projections, then the state, its normaliser and the division in
    fp32; the decoding state (causal and cross) is fp32."""
    torch.manual_seed(0)
    causal = CausalRFAttention(32, 4, RandomFeatureMap(4, 8, 16), gate=True).eval()
    cross = CrossRFAttention(32, 4, RandomFeatureMap(4, 8, 16)).eval()
    x, src = torch.randn(12, 2, 32), torch.randn(7, 2, 32)
    state = {}
    with torch.no_grad(), torch.autocast("cpu", dtype=dtype):
        causal(x, incremental_state=state)
        cross(x[:1], src, src, incremental_state=state)
    assert {t.dtype for fields in state.values() for t in fields.values() if torch.is_tensor(t)} == {torch.float32}
