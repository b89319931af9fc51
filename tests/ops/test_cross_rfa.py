"""Cross RFA: the (S, z) state path against the naive triple loop, beam grouping, weights.

Layouts: q ``[B, H, Tq, F]``, k ``[Bs, H, S, F]``, v ``[Bs, H, S, K]``, key_padding_mask
``[Bs, S]`` (True = pad), state ``(S [Bs, H, F, K], z [Bs, H, F])``. fp64 inputs are computed in
fp64, everything else in fp32.
"""
import pytest
import torch

from rfa_fairseq.ops import (
    cross_rfa_apply,
    cross_rfa_quadratic,
    cross_rfa_state,
    cross_rfa_weights,
    naive_cross_rfa,
    quadratic_is_cheaper,
)
from rfa_fairseq.ops.denominator import DEFAULT_EPS

H = 2


def assert_close(actual, expected, rtol=1e-5, name="", floor=0.0):
    """Element-wise rtol plus an absolute slack of rtol times the largest |expected| (+ floor)."""
    assert actual.shape == expected.shape, f"{name}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    a, e = actual.double(), expected.double()
    assert torch.isfinite(a).all(), f"{name}: non-finite values"
    scale = e.abs().max().item() if e.numel() else 0.0
    torch.testing.assert_close(a, e, rtol=rtol, atol=rtol * scale + floor, msg=lambda m: f"{name}: {m}")


def positive_features(gen, *shape):
    return torch.randn(*shape, generator=gen).abs() + 0.1


def make_mask(pattern, B, S, gen):
    """[B, S] bool, True at padding, with at least one real key per row."""
    if pattern == "none":
        return None
    lengths = torch.tensor([S, 1] + [int(x) for x in torch.randint(1, S + 1, (B - 2,), generator=gen)])
    pos = torch.arange(S)[None, :]
    if pattern == "right":
        return pos >= lengths[:, None]
    if pattern == "left":
        return pos < (S - lengths)[:, None]
    mask = torch.rand(B, S, generator=gen) < 0.5  # random holes
    mask[torch.arange(B), torch.randint(0, S, (B,), generator=gen)] = False
    return mask


MASKS = ["none", "right", "left", "random"]
PRECISIONS = [
    pytest.param(torch.float64, 1e-10, 1e-12, id="fp64"),
    pytest.param(torch.float32, 1e-5, 1e-6, id="fp32"),
]
SHAPES = [
    pytest.param(3, 1, 13, 60, 5, id="B3-Tq1-S13-F60-K5"),
    pytest.param(4, 7, 13, 60, 33, id="B4-Tq7-S13-F60-K33"),
    pytest.param(3, 5, 1, 30, 5, id="B3-Tq5-S1-F30-K5"),
]


@pytest.mark.parametrize("dtype,rtol,floor", PRECISIONS)
@pytest.mark.parametrize("pattern", MASKS)
@pytest.mark.parametrize("B,Tq,S,Fd,K", SHAPES)
def test_state_path_matches_naive(gen, B, Tq, S, Fd, K, pattern, dtype, rtol, floor):
    if S == 1 and pattern != "none":
        pattern = "none"  # a single key cannot be padded
    q = positive_features(gen, B, H, Tq, Fd).to(dtype).requires_grad_(True)
    k = positive_features(gen, B, H, S, Fd).to(dtype).requires_grad_(True)
    v = torch.randn(B, H, S, K, generator=gen).to(dtype).requires_grad_(True)
    mask = make_mask(pattern, B, S, gen)
    cot = torch.randn(B, H, Tq, K, generator=gen, dtype=torch.float64).to(dtype)

    ref = naive_cross_rfa(q, k, v, mask)
    out = cross_rfa_apply(q, cross_rfa_state(k, v, mask))
    assert out.dtype == ref.dtype == dtype
    assert_close(out, ref, rtol, "out")
    g_ref = torch.autograd.grad((ref * cot).sum(), (q, k, v))
    g_out = torch.autograd.grad((out * cot).sum(), (q, k, v))
    for name, a, b in zip("qkv", g_out, g_ref):
        assert_close(a, b, rtol, f"grad {name}", floor)
    if mask is not None:  # nothing reaches padded keys
        pad4 = mask[:, None, :, None]
        assert torch.where(pad4, g_out[1], 0).abs().max() == 0
        assert torch.where(pad4, g_out[2], 0).abs().max() == 0
        assert g_out[1].abs().max() > 0


@pytest.mark.parametrize("dtype,rtol,floor", PRECISIONS)
@pytest.mark.parametrize("pattern", MASKS)
@pytest.mark.parametrize("B,Tq,S,Fd,K", SHAPES)
def test_quadratic_form_matches_naive(gen, B, Tq, S, Fd, K, pattern, dtype, rtol, floor):
    """The [Tq, S] form (training at sentence lengths) computes the state path's numbers."""
    if S == 1 and pattern != "none":
        pattern = "none"
    # Signed features in fp64 make the guard act (negative and tiny denominators); in fp32 they
    # would make the gradients too ill-conditioned to compare, so positive features there.
    features = torch.randn if dtype == torch.float64 else lambda *shape, generator: positive_features(generator, *shape)
    q = features(B, H, Tq, Fd, generator=gen).to(dtype).requires_grad_(True)
    k = features(B, H, S, Fd, generator=gen).to(dtype).requires_grad_(True)
    v = torch.randn(B, H, S, K, generator=gen).to(dtype).requires_grad_(True)
    mask = make_mask(pattern, B, S, gen)
    ref = naive_cross_rfa(q, k, v, mask)
    out = cross_rfa_quadratic(q, k, v, mask)
    assert out.dtype == dtype
    assert_close(out, ref, rtol, "out")
    cot = torch.randn(B, H, Tq, K, generator=gen, dtype=torch.float64).to(dtype)
    for name, a, b in zip("qkv", torch.autograd.grad((out * cot).sum(), (q, k, v)),
                          torch.autograd.grad((ref * cot).sum(), (q, k, v))):
        assert_close(a, b, rtol, f"grad {name}", floor)


def test_quadratic_is_cheaper_where_the_lengths_are_short():
    """Sentence lengths against the default feature sizes take the quadratic form; long sources
    and targets the summary."""
    assert quadratic_is_cheaper(20, 256, 64, Tq=20) and quadratic_is_cheaper(25, 128, 64, Tq=30)
    assert not quadratic_is_cheaper(200, 256, 64, Tq=200) and not quadratic_is_cheaper(60, 256, 64, Tq=512)


@pytest.mark.parametrize("pattern", ["right", "left", "random"])
def test_padded_keys_do_not_leak(gen, pattern):
    """Garbage at padded positions changes neither the state nor the output; the result equals
    attending to the unpadded keys alone."""
    B, Tq, S, Fd, K = 4, 6, 11, 60, 5
    q = positive_features(gen, B, H, Tq, Fd)
    k = positive_features(gen, B, H, S, Fd)
    v = torch.randn(B, H, S, K, generator=gen)
    mask = make_mask(pattern, B, S, gen)
    assert mask.any()
    pad4 = mask[:, None, :, None]
    k2 = torch.where(pad4, 1e3 * torch.randn(k.shape, generator=gen), k)
    v2 = torch.where(pad4, 1e3 * torch.randn(v.shape, generator=gen), v)
    state1 = cross_rfa_state(k, v, mask)
    state2 = cross_rfa_state(k2, v2, mask)
    torch.testing.assert_close(state2, state1, rtol=1e-6, atol=1e-6)
    out = cross_rfa_apply(q, state2)
    for b in range(B):
        keep = (~mask[b]).nonzero().squeeze(1)
        ref = naive_cross_rfa(q[b : b + 1], k[b : b + 1, :, keep], v[b : b + 1, :, keep])
        assert_close(out[b : b + 1], ref, 1e-5, f"row {b}")


@pytest.mark.parametrize("beam", [pytest.param(b, id=f"beam{b}") for b in (1, 4, 5)])
@pytest.mark.parametrize("pattern", ["none", "left", "random"])
def test_beam_grouped_apply(gen, beam, pattern):
    """A state for Bs sources serves Bs * beam sentence-major query rows without being copied."""
    Bs, Tq, S, Fd, K = 3, 2, 9, 60, 5
    k = positive_features(gen, Bs, H, S, Fd)
    v = torch.randn(Bs, H, S, K, generator=gen)
    mask = make_mask(pattern, Bs, S, gen)
    q = positive_features(gen, Bs * beam, H, Tq, Fd)
    state = cross_rfa_state(k, v, mask)
    out = cross_rfa_apply(q, state)
    assert out.shape == (Bs * beam, H, Tq, K)
    rep = state.repeat_interleave(beam, dim=0)
    torch.testing.assert_close(out, cross_rfa_apply(q, rep), rtol=1e-6, atol=1e-6)
    # and against the naive reference with keys, values and mask copied per beam
    rk = lambda x: None if x is None else x.repeat_interleave(beam, dim=0)  # noqa: E731
    assert_close(out, naive_cross_rfa(q, rk(k), rk(v), rk(mask)), 1e-5, "vs naive")
    if beam > 1:  # sentence-major, not beam-major: tiling the state instead gives other results
        tiled = state.repeat(beam, 1, 1, 1)
        assert not torch.allclose(out, cross_rfa_apply(q, tiled), rtol=1e-3, atol=1e-3)


def test_beam_grouped_apply_gradients(gen):
    Bs, beam, Tq, S, Fd, K = 2, 3, 4, 7, 30, 5
    k = positive_features(gen, Bs, H, S, Fd).double().requires_grad_(True)
    v = torch.randn(Bs, H, S, K, generator=gen, dtype=torch.float64).requires_grad_(True)
    q = positive_features(gen, Bs * beam, H, Tq, Fd).double().requires_grad_(True)
    mask = make_mask("random", Bs, S, gen)
    cot = torch.randn(Bs * beam, H, Tq, K, generator=gen, dtype=torch.float64)
    out = cross_rfa_apply(q, cross_rfa_state(k, v, mask))
    rk = lambda x: x.repeat_interleave(beam, dim=0)  # noqa: E731
    ref = naive_cross_rfa(q, rk(k), rk(v), rk(mask))
    assert_close(out, ref, 1e-10, "out")
    for name, a, b in zip("qkv", torch.autograd.grad((out * cot).sum(), (q, k, v)),
                          torch.autograd.grad((ref * cot).sum(), (q, k, v))):
        assert_close(a, b, 1e-10, f"grad {name}", 1e-12)


@pytest.mark.parametrize("rows", [pytest.param(r, id=f"rows{r}") for r in (1, 5, 7)])
def test_rows_not_a_multiple_of_sources_raise(gen, rows):
    Bs, S, Fd, K = 3, 6, 30, 5
    k = positive_features(gen, Bs, H, S, Fd)
    state = cross_rfa_state(k, torch.randn(Bs, H, S, K, generator=gen))
    q = positive_features(gen, rows, H, 2, Fd)
    with pytest.raises(ValueError):
        cross_rfa_apply(q, state)
    with pytest.raises(ValueError):
        cross_rfa_weights(q, k)
    with pytest.raises(ValueError):
        cross_rfa_quadratic(q, k, torch.randn(Bs, H, S, K, generator=gen))


@pytest.mark.parametrize("features", ["positive", "mixed-sign"])
@pytest.mark.parametrize("beam", [pytest.param(1, id="beam1"), pytest.param(3, id="beam3")])
@pytest.mark.parametrize("pattern", MASKS)
def test_weights_reproduce_apply(gen, pattern, beam, features):
    """weights @ v equals cross_rfa_apply; weights vanish at padded keys; rows sum to 1 where the
    denominator is above eps (and to den / eps below it)."""
    Bs, Tq, S, Fd, K = 3, 4, 10, 60, 5
    if features == "positive":
        k = positive_features(gen, Bs, H, S, Fd)
        q = positive_features(gen, Bs * beam, H, Tq, Fd)
    else:  # denominators near zero or negative: the clamp is active on some rows
        k = torch.randn(Bs, H, S, Fd, generator=gen) / 4
        q = torch.randn(Bs * beam, H, Tq, Fd, generator=gen) / 4
    v = torch.randn(Bs, H, S, K, generator=gen)
    mask = make_mask(pattern, Bs, S, gen)
    state = cross_rfa_state(k, v, mask)
    w = cross_rfa_weights(q, k, mask)
    assert w.shape == (Bs * beam, H, Tq, S)
    assert w.dtype == torch.float32
    v_rows = v.repeat_interleave(beam, dim=0)
    via_weights = torch.einsum("bhts,bhsk->bhtk", w, v_rows)
    assert_close(via_weights, cross_rfa_apply(q, state), 1e-5, "weights @ v")
    assert_close(cross_rfa_quadratic(q, k, v, mask), cross_rfa_apply(q, state), 1e-5, "quadratic form, beams grouped")
    if mask is not None:
        pad = mask.repeat_interleave(beam, dim=0)[:, None, None, :].expand_as(w)
        assert (w[pad] == 0).all()
    den = torch.einsum("bhtf,bhf->bht", q, state[..., -1].repeat_interleave(beam, dim=0))
    expected_sum = torch.where(den > DEFAULT_EPS, torch.ones_like(den), den / DEFAULT_EPS)
    torch.testing.assert_close(w.sum(-1), expected_sum, rtol=1e-5, atol=1e-5)
    if features == "mixed-sign":
        assert (den <= DEFAULT_EPS).any() and (den > DEFAULT_EPS).any()  # both branches exercised


@pytest.mark.parametrize(
    "dtype", [pytest.param(torch.float16, id="fp16"), pytest.param(torch.bfloat16, id="bf16"),
              pytest.param(torch.float32, id="fp32")]
)
@pytest.mark.parametrize("scale", [pytest.param(1.0, id="x1"), pytest.param(100.0, id="x100")])
def test_apply_guard_is_finite_in_low_precision(gen, dtype, scale):
    """Mixed-sign features (den ~ 0 or < 0) and large values: finite, in the requested dtype."""
    B, Tq, S, Fd, K = 3, 5, 8, 60, 5
    q = (torch.randn(B, H, Tq, Fd, generator=gen) * scale).to(dtype)
    k = (torch.randn(B, H, S, Fd, generator=gen) * scale).to(dtype)
    v = (torch.randn(B, H, S, K, generator=gen) * scale).to(dtype)
    q[0] = -k[0, :, :Tq]  # strongly negative denominators on sentence 0
    q[1, :, 0] = 0  # den = num = 0 exactly
    mask = make_mask("random", B, S, gen)
    state = cross_rfa_state(k, v, mask)
    assert state.dtype == torch.float32
    out = cross_rfa_apply(q, state)
    assert out.dtype == dtype
    assert torch.isfinite(out).all()
    assert (out[1, :, 0] == 0).all()
    out_v = cross_rfa_apply(q, state, out_dtype=v.dtype)
    assert out_v.dtype == v.dtype and torch.isfinite(out_v).all()
    ref = naive_cross_rfa(q, k, v, mask)
    assert ref.dtype == dtype and torch.isfinite(ref).all()
    if dtype == torch.float16 and scale > 1:  # the fp32 results overflow fp16: clamped, not inf
        assert out.abs().max().item() == torch.finfo(torch.float16).max
