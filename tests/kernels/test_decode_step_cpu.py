"""The fused CPU decoding step (rfa_fairseq/kernels) against the PyTorch ops it replaces.

Reference: the beam gather (``index_select`` / :func:`gather_keys`) followed by
:func:`recurrent_causal_rfa_step_packed` or :func:`causal_keys_step`. Compared: the readout, the
new state (every number a later step reads), and that the source buffer is left alone.
"""
import pytest
import torch
import torch.nn.functional as F

from rfa_fairseq import kernels
from rfa_fairseq.ops import causal_keys_step, gather_keys, keys_capacity, recurrent_causal_rfa_step_packed
from rfa_fairseq.ops.causal_rfa.keys import key_rows

B, H, FD, K = 6, 3, 32, 8
TOL = dict(rtol=1e-5, atol=1e-5)


def _features(*shape, gen):
    x = torch.randn(*shape, generator=gen)
    return x / x.norm(dim=-1, keepdim=True)  # unit rows, as sin/cos features are


def _step_inputs(gen, gated, strided=False):
    if strided:  # [B, H, F] views of a [H, B, F] layout, as the stacked feature map hands them over
        q = _features(H, B, FD, gen=gen).transpose(0, 1)
        k = _features(H, B, FD, gen=gen).transpose(0, 1)
        assert not q.is_contiguous()
    else:
        q, k = _features(B, H, FD, gen=gen), _features(B, H, FD, gen=gen)
    v = torch.randn(B, H, K, generator=gen)
    log_g = F.logsigmoid(torch.randn(B, H, generator=gen) + 1) if gated else None
    return q, k, v, log_g


ORDERS = {
    "none": None,
    "identity": torch.arange(B),
    "beams": torch.tensor([2, 0, 1, 5, 5, 3]),  # repeats and moves
    "all-one-row": torch.full((B,), 4),
}


@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("order_name", list(ORDERS))
@pytest.mark.parametrize("strided", [False, True])
def test_summary_step_equals_gather_then_step(gated, order_name, strided):
    gen = torch.Generator().manual_seed(0)
    order = ORDERS[order_name]
    src = torch.randn(B, H, FD, K + 1, generator=gen)
    src[..., -1] = src[..., -1].abs() + 0.5  # a positive denominator column, as a real z
    keep = src.clone()
    q, k, v, log_g = _step_inputs(gen, gated, strided)
    gathered = src.clone() if order is None else src.index_select(0, order)
    o_ref, state_ref = recurrent_causal_rfa_step_packed(q, k, v, log_g, gathered, eps=1e-2)
    if order is None:  # in place
        dst = src
        out = kernels.fused_summary_step(src, dst, None, q, k, v, log_g, eps=1e-2)
    else:
        dst = torch.full_like(src, float("nan"))
        out = kernels.fused_summary_step(src, dst, order, q, k, v, log_g, eps=1e-2)
        assert torch.equal(src, keep)  # the source rows are read, never written
    torch.testing.assert_close(out, o_ref, **TOL)
    torch.testing.assert_close(dst, state_ref, **TOL)


def _keys_buffer(gen, length, gated):
    """A key buffer holding ``length`` tokens, built by the reference step."""
    buf = None
    for t in range(length):
        q, k, v, log_g = _step_inputs(gen, gated)
        _, buf = causal_keys_step(q, k, v, log_g, buf, t, inplace=True)
    if buf is None:
        buf = torch.empty(B, H, FD, K + 1)
    return buf


@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("order_name", list(ORDERS))
@pytest.mark.parametrize("length", [0, 1, 5, "last"])
def test_keys_step_equals_gather_then_step(gated, order_name, length):
    gen = torch.Generator().manual_seed(1)
    capacity = keys_capacity(FD, K, gated)
    length = capacity - 1 if length == "last" else length
    order = ORDERS[order_name]
    src = _keys_buffer(gen, length, gated)
    keep = key_rows(src, gated)[:length].clone()
    q, k, v, log_g = _step_inputs(gen, gated, strided=True)
    if order is None or length == 0:
        gathered = src.clone()
    else:
        gathered = gather_keys(src, length, order, gated)
    o_ref, buf_ref = causal_keys_step(q, k, v, log_g, gathered, length, inplace=True)
    if order is None:
        dst = src
    else:
        dst = torch.full_like(src, float("nan"))
    out = kernels.fused_keys_step(src, dst, order, length, q, k, v, log_g, eps=1e-2)
    if order is not None:
        assert torch.equal(key_rows(src, gated)[:length], keep)
    torch.testing.assert_close(out, o_ref, **TOL)
    used = slice(0, length + 1)  # rows past the keys in use are never read
    torch.testing.assert_close(key_rows(dst, gated)[used], key_rows(buf_ref, gated)[used], **TOL)


def test_a_decode_of_many_steps_stays_equal():
    """Both forms and the switch between them over a beam-search-like run: reorders every step,
    the fold into the summary at the capacity, errors that do not grow."""
    from rfa_fairseq.ops import keys_to_summary

    gen = torch.Generator().manual_seed(2)
    gated = True
    capacity = keys_capacity(FD, K, gated)
    ref = fused = None
    spare = torch.empty(B, H, FD, K + 1)
    for t in range(capacity + 20):
        q, k, v, log_g = _step_inputs(gen, gated)
        order = torch.randint(0, B, (B,), generator=gen) if t else None
        if t < capacity:
            if ref is not None:
                ref = gather_keys(ref, t, order, gated)
            o_ref, ref = causal_keys_step(q, k, v, log_g, ref, t, inplace=True)
            if fused is None:
                fused = torch.empty(B, H, FD, K + 1)
                out = kernels.fused_keys_step(None, fused, None, 0, q, k, v, log_g, eps=1e-2)
            else:
                out = kernels.fused_keys_step(fused, spare, order, t, q, k, v, log_g, eps=1e-2)
                fused, spare = spare, fused
        else:
            if t == capacity:
                ref, fused = keys_to_summary(ref, t, gated), keys_to_summary(fused, t, gated)
            o_ref, ref = recurrent_causal_rfa_step_packed(q, k, v, log_g, ref.index_select(0, order), inplace=True)
            out = kernels.fused_summary_step(fused, spare, order, q, k, v, log_g, eps=1e-2)
            fused, spare = spare, fused
        torch.testing.assert_close(out, o_ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(fused, ref, rtol=1e-4, atol=1e-4)


def test_bad_arguments_are_refused_with_their_name():
    gen = torch.Generator().manual_seed(3)
    src = torch.zeros(B, H, FD, K + 1)
    dst = torch.zeros_like(src)
    q, k, v, log_g = _step_inputs(gen, True)
    with pytest.raises(RuntimeError, match="order\\[1\\] = 6 is not a row"):
        kernels.fused_summary_step(src, dst, torch.tensor([0, 6, 1, 2, 3, 4]), q, k, v, log_g, 1e-2)
    with pytest.raises(RuntimeError, match="holds at most"):
        kernels.fused_keys_step(src, dst, None, keys_capacity(FD, K, True), q, k, v, log_g, 1e-2)
    with pytest.raises(ValueError, match="^v has shape"):
        kernels.fused_summary_step(src, dst, None, q, k, v[..., :-1], log_g, 1e-2)
    with pytest.raises(ValueError, match="^q must be a float32 CPU tensor"):
        kernels.fused_summary_step(src, dst, None, q.double(), k, v, log_g, 1e-2)
    with pytest.raises(ValueError, match="other than the destination"):
        kernels.fused_summary_step(src, src, torch.arange(B), q, k, v, log_g, 1e-2)
    with pytest.raises(ValueError, match="^order must be int64"):
        kernels.fused_summary_step(src, dst, torch.arange(B).int(), q, k, v, log_g, 1e-2)
    with pytest.raises(ValueError, match="^dst must be a contiguous"):
        kernels.fused_summary_step(src, torch.zeros(B, H, K + 1, FD).transpose(2, 3), None, q, k, v, log_g, 1e-2)
