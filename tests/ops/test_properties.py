"""Property-based tests (hypothesis) of the RFA ops against their naive references.

Everything that asserts exactness runs in fp64 (the ops accumulate in fp64 for fp64 inputs) on
non-negative feature-like q/k (|N(0, 1)| + 0.05), so phi(q).z is a sum of positive terms. Where a
gate drives the denominator below eps anyway (log g = -1e-6 writes only 1e-6 of each key), the
clamp is still applied identically by every path, and the guarded ratio is continuous, so the
comparison remains exact up to rounding.

Layouts: q, k ``[B, H, T, F]``, v ``[B, H, T, K]``, log_g ``[B, H, T]``,
state ``(S [B, H, F, K], z [B, H, F])`` (the ops take and return it packed as ``[S | z]``), key_padding_mask ``[B, T]`` (True = pad).

Hypothesis draws the shapes, switches, gate regime, padding pattern and a seed; the tensors
themselves come from a torch.Generator seeded by that draw (fast, reproducible, and shrinkable
through the seed). ``derandomize=True`` makes every run test the same examples.
"""
import math

import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from rfa_fairseq.ops import (
    chunk_causal_rfa,
    cross_rfa_apply,
    cross_rfa_state,
    feature_map,
    naive_causal_rfa,
    naive_cross_rfa,
    recurrent_causal_rfa_step,
    sample_random_matrix,
)

DT = torch.float64
RTOL = 1e-9

PROPERTY_SETTINGS = settings(
    deadline=None,
    max_examples=40,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    print_blob=True,
)

# Log-gate magnitudes are drawn as -10**e with e in [LOG10_MIN, LOG10_MAX]:
# from -1e-6 (g = 1 - 1e-6, the state barely moves) to -30 (g = 1e-13, the state is overwritten).
LOG10_MIN, LOG10_MAX = -6.0, math.log10(30.0)


# ----------------------------------------------------------------------------- helpers


def assert_close(actual, expected, name, rtol=RTOL):
    """Element-wise rtol plus an absolute slack of rtol times the largest |expected|."""
    assert actual.shape == expected.shape, f"{name}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert actual.dtype == expected.dtype, f"{name}: dtype {actual.dtype} != {expected.dtype}"
    assert torch.isfinite(actual).all(), f"{name}: non-finite values"
    scale = expected.abs().max().item() if expected.numel() else 0.0
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=rtol * max(scale, 1e-12),
                               msg=lambda m: f"{name}: {m}")


def features(gen, *shape):
    """Non-negative feature-like values bounded away from 0."""
    return torch.randn(*shape, generator=gen, dtype=DT).abs() + 0.05


def log_gates(gen, shape, lo, hi, spikes):
    """log g = -10**e, e ~ U(lo, hi) per element; with ``spikes`` a random third of the entries
    is set to the extremes -1e-6 and -30 exactly."""
    e = lo + (hi - lo) * torch.rand(*shape, generator=gen, dtype=DT)
    lg = -torch.pow(10.0, e)
    if spikes:
        which = torch.randint(0, 6, shape, generator=gen)
        lg = torch.where(which == 0, torch.full_like(lg, -1e-6), lg)
        lg = torch.where(which == 1, torch.full_like(lg, -30.0), lg)
    return lg


@st.composite
def gate_regimes(draw):
    """None (plain RFA) or (lo, hi, spikes) for :func:`log_gates`."""
    if not draw(st.booleans()):
        return None
    a = draw(st.floats(LOG10_MIN, LOG10_MAX))
    b = draw(st.floats(LOG10_MIN, LOG10_MAX))
    return (min(a, b), max(a, b), draw(st.booleans()))


@st.composite
def padding_masks(draw, B, T):
    """[B, T] bool masks: per row one of no padding, left, right, all padded, or arbitrary."""
    rows = []
    for _ in range(B):
        kind = draw(st.sampled_from(["none", "left", "right", "all", "arbitrary"]))
        if kind == "none":
            row = [False] * T
        elif kind == "all":
            row = [True] * T
        elif kind in ("left", "right"):
            n = draw(st.integers(0, T))
            row = [True] * n + [False] * (T - n) if kind == "left" else [False] * (T - n) + [True] * n
        else:
            row = draw(st.lists(st.booleans(), min_size=T, max_size=T))
        rows.append(row)
    return torch.tensor(rows, dtype=torch.bool).reshape(B, T)


@st.composite
def causal_cases(draw, max_T=70, with_padding=False):
    B = draw(st.integers(1, 3))
    H = draw(st.integers(1, 3))
    T = draw(st.integers(1, max_T))
    Fd = draw(st.integers(1, 40))
    K = draw(st.integers(1, 9))
    case = dict(
        B=B, H=H, T=T, F=Fd, K=K,
        chunk=draw(st.integers(1, 80)),
        gate=draw(gate_regimes()),
        init=draw(st.booleans()),
        seed=draw(st.integers(0, 2**31 - 1)),
    )
    if with_padding:
        case["mask"] = draw(padding_masks(B, T))
    return case


def make_causal(case):
    gen = torch.Generator().manual_seed(case["seed"])
    B, H, T, Fd, K = case["B"], case["H"], case["T"], case["F"], case["K"]
    q = features(gen, B, H, T, Fd)
    k = features(gen, B, H, T, Fd)
    v = torch.randn(B, H, T, K, generator=gen, dtype=DT)
    log_g = None if case["gate"] is None else log_gates(gen, (B, H, T), *case["gate"])
    state = None
    if case["init"]:
        state = (torch.randn(B, H, Fd, K, generator=gen, dtype=DT), features(gen, B, H, Fd) * 2)
    return q, k, v, log_g, state


def clone_state(state):
    return None if state is None else (state[0].clone(), state[1].clone())


def join(state):
    """``(S, z)`` -> the ops' packed state ``[S | z]`` (None stays None)."""
    return None if state is None else torch.cat([state[0], state[1].unsqueeze(-1).to(state[0].dtype)], dim=-1)


def split(state):
    """The ops' packed state -> ``(S, z)`` as views."""
    return state[..., :-1], state[..., -1]


def naive(q, k, v, log_g, state):
    """naive_causal_rfa with ``(S, z)`` in and out."""
    out, final = naive_causal_rfa(q, k, v, log_g, join(state), True)
    return out, split(final)


def chunk(q, k, v, log_g, state, chunk_size):
    """chunk_causal_rfa with ``(S, z)`` in and out."""
    out, final = chunk_causal_rfa(q, k, v, log_g, join(state), True, chunk_size=chunk_size)
    return out, split(final)


# Corners that must be run whatever hypothesis draws: several chunks with a partial last one,
# one chunk longer than T, all log-gates at -1e-6 (z stays below eps for a while) or at -30, and
# masks mixing left, right, arbitrary and fully padded rows.
_MASK_3x70 = torch.stack([
    torch.arange(70) < 23,                    # left padding
    torch.arange(70) >= 61,                   # right padding
    (torch.arange(70) % 3) == 1,              # arbitrary holes
])
EXAMPLES = [
    dict(B=3, H=2, T=70, F=40, K=9, chunk=16, gate=(-6.0, LOG10_MAX, True), init=True, seed=11),
    dict(B=3, H=3, T=70, F=7, K=1, chunk=80, gate=None, init=False, seed=12),
    dict(B=3, H=1, T=70, F=5, K=3, chunk=9, gate=(-6.0, -6.0, False), init=False, seed=13),
    dict(B=2, H=2, T=70, F=3, K=2, chunk=1, gate=(LOG10_MAX, LOG10_MAX, False), init=True, seed=14),
]
PADDED_EXAMPLES = [
    dict(EXAMPLES[0], mask=_MASK_3x70),
    dict(EXAMPLES[2], mask=torch.stack([_MASK_3x70[0], torch.ones(70, dtype=torch.bool), _MASK_3x70[2]])),
    dict(B=2, H=2, T=70, F=4, K=2, chunk=64, gate=None, init=True, seed=15, mask=_MASK_3x70[1:]),
]


def with_examples(examples, name="case"):
    def deco(f):
        for ex in reversed(examples):
            f = example(**{name: ex})(f)
        return f
    return deco


# ----------------------------------------------------------------------------- causal RFA


@PROPERTY_SETTINGS
@given(case=causal_cases())
@with_examples(EXAMPLES)
def test_chunk_equals_naive(case):
    q, k, v, log_g, state = make_causal(case)
    ref, (S_ref, z_ref) = naive(q, k, v, log_g, state)
    out, (S, z) = chunk(q, k, v, log_g, clone_state(state), case["chunk"])
    assert_close(out, ref, "out")
    assert_close(S, S_ref, "S")
    assert_close(z, z_ref, "z")
    # Without asking for the state, the same outputs.
    assert_close(chunk_causal_rfa(q, k, v, log_g, join(state), chunk_size=case["chunk"])[0], ref, "out only")


@PROPERTY_SETTINGS
@given(case=causal_cases(), inplace=st.booleans())
@example(case=EXAMPLES[0], inplace=True)
@example(case=EXAMPLES[2], inplace=False)
@example(case=EXAMPLES[3], inplace=True)
def test_recurrent_steps_equal_naive(case, inplace):
    q, k, v, log_g, state = make_causal(case)
    ref, (S_ref, z_ref) = naive(q, k, v, log_g, state)
    # The decoder's packed state, a copy of the caller's (in place, the step writes into it).
    st_ = None if state is None else join(state)
    outs = []
    for t in range(case["T"]):
        args = (q[:, :, t], k[:, :, t], v[:, :, t], None if log_g is None else log_g[:, :, t], st_)
        o, st_ = recurrent_causal_rfa_step(*args, inplace=inplace)
        outs.append(o)
    st_ = split(st_)
    assert_close(torch.stack(outs, dim=2), ref, "out")
    assert_close(st_[0], S_ref, "S")
    assert_close(st_[1], z_ref, "z")
    # Neither the inputs nor (out of place) the initial state may be written to.
    q0, k0, v0, _, state0 = make_causal(case)
    assert torch.equal(q, q0) and torch.equal(k, k0) and torch.equal(v, v0), "inputs were modified"
    if state is not None:
        assert torch.equal(state[0], state0[0]) and torch.equal(state[1], state0[1]), "caller's state was modified"


def _pad_like_module(k, log_g, mask):
    """What CausalRFAttention does at padded positions: k = 0 and log g = 0."""
    pad = mask[:, None, :]
    k = k.masked_fill(pad.unsqueeze(-1), 0.0)
    if log_g is not None:
        log_g = log_g.masked_fill(pad, 0.0)
    return k, log_g


@PROPERTY_SETTINGS
@given(case=causal_cases(with_padding=True))
@with_examples(PADDED_EXAMPLES)
def test_padding_equals_removing_padded_positions(case):
    q, k, v, log_g, state = make_causal(case)
    mask = case["mask"]
    kp, lgp = _pad_like_module(k, log_g, mask)
    out_c, (S_c, z_c) = chunk(q, kp, v, lgp, clone_state(state), case["chunk"])
    out_n, (S_n, z_n) = naive(q, kp, v, lgp, state)
    for b in range(case["B"]):
        real = (~mask[b]).nonzero().flatten()
        sl = slice(b, b + 1)
        row_state = None if state is None else (state[0][sl], state[1][sl])
        ref, (S_ref, z_ref) = naive(
            q[sl][:, :, real], k[sl][:, :, real], v[sl][:, :, real],
            None if log_g is None else log_g[sl][:, :, real], row_state,
        )
        for name, out, S, z in (("chunk", out_c, S_c, z_c), ("naive", out_n, S_n, z_n)):
            assert_close(out[sl][:, :, real], ref, f"{name} out row {b}")
            assert_close(S[sl], S_ref, f"{name} S row {b}")
            assert_close(z[sl], z_ref, f"{name} z row {b}")


@PROPERTY_SETTINGS
@given(
    case=causal_cases(max_T=40),
    dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16, torch.float64]),
    kind=st.sampled_from(["normal", "sparse", "fourier"]),
    q_scale=st.sampled_from([1.0, 1e-3, 30.0]),
    v_scale=st.sampled_from([1.0, 1e3, 3e4]),
)
def test_arbitrary_sign_features_stay_finite(case, dtype, kind, q_scale, v_scale):
    """Signed features make phi(q).z small or negative: every path must stay finite, in v's dtype,
    and agree on the shapes."""
    gen = torch.Generator().manual_seed(case["seed"])
    B, H, T, Fd, K = case["B"], case["H"], case["T"], case["F"], case["K"]
    if kind in ("normal", "sparse"):
        q = torch.randn(B, H, T, Fd, generator=gen) * q_scale
        k = torch.randn(B, H, T, Fd, generator=gen) * q_scale
        if kind == "sparse":  # exact zeros: whole rows of q vanish, so phi(q).z = 0 exactly
            q = q * (torch.rand(B, H, T, 1, generator=gen) < 0.5) * (torch.rand(B, H, T, Fd, generator=gen) < 0.7)
            k = k * (torch.rand(B, H, T, Fd, generator=gen) < 0.5)
    else:  # real sin/cos random features (F is rounded up to even: D = ceil(F / 2))
        D, hd = max(1, (Fd + 1) // 2), 4
        W = sample_random_matrix("gaussian", H, D, hd, gen)
        sigma = torch.full((H, hd), q_scale)
        q = feature_map("gaussian", torch.randn(B, H, T, hd, generator=gen), sigma, W)
        k = feature_map("gaussian", torch.randn(B, H, T, hd, generator=gen), sigma, W)
        Fd = q.shape[-1]
    q, k = q.to(dtype), k.to(dtype)
    # |v| <= 2 * 3e4 = 6e4 stays below fp16's largest finite value (65504): finite inputs.
    v = (torch.randn(B, H, T, K, generator=gen).clamp(-2, 2) * v_scale).to(dtype)
    assert torch.isfinite(q).all() and torch.isfinite(k).all() and torch.isfinite(v).all()
    log_g = None if case["gate"] is None else log_gates(gen, (B, H, T), *case["gate"]).to(torch.float32)
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    state = None
    if case["init"]:  # signed z too; states live in the accumulation dtype, as the ops return them
        state = (torch.randn(B, H, Fd, K, generator=gen, dtype=acc), torch.randn(B, H, Fd, generator=gen, dtype=acc))

    out_n, (S_n, z_n) = naive(q, k, v, log_g, state)
    out_c, (S_c, z_c) = chunk(q, k, v, log_g, clone_state(state), case["chunk"])
    st_ = None if state is None else join(state)
    steps = []
    for t in range(T):
        o, st_ = recurrent_causal_rfa_step(q[:, :, t], k[:, :, t], v[:, :, t],
                                           None if log_g is None else log_g[:, :, t], st_, inplace=True)
        steps.append(o)
    st_ = split(st_)
    out_r = torch.stack(steps, dim=2)
    for name, out, S, z in (("naive", out_n, S_n, z_n), ("chunk", out_c, S_c, z_c), ("step", out_r, *st_)):
        assert out.dtype == dtype, f"{name}: output dtype {out.dtype} != {dtype}"
        assert out.shape == (B, H, T, K), name
        assert S.dtype == acc and z.dtype == acc, f"{name}: state dtype {S.dtype}/{z.dtype}, expected {acc}"
        assert torch.isfinite(out).all(), f"{name}: non-finite output"
        assert torch.isfinite(S).all() and torch.isfinite(z).all(), f"{name}: non-finite state"

    # Cross RFA with the same signed features and a random (possibly all-padded) key mask.
    mask = torch.rand(B, T, generator=gen) < 0.3
    mask[0] = bool(case["init"])  # sometimes a fully padded first row (phi(q).z = 0 < eps)
    state_x = cross_rfa_state(k, v, mask)
    out_x = cross_rfa_apply(q, state_x, out_dtype=dtype)
    assert out_x.dtype == dtype and out_x.shape == (B, H, T, K)
    assert state_x.dtype == acc
    assert torch.isfinite(out_x).all(), "cross: non-finite output"


# ----------------------------------------------------------------------------- cross RFA


@st.composite
def cross_cases(draw):
    Bs = draw(st.integers(1, 3))
    S = draw(st.integers(1, 70))
    return dict(
        Bs=Bs, S=S,
        beam=draw(st.integers(1, 2)),
        H=draw(st.integers(1, 3)),
        Tq=draw(st.integers(1, 6)),
        F=draw(st.integers(1, 40)),
        K=draw(st.integers(1, 9)),
        mask=draw(st.none() | padding_masks(Bs, S)),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


@PROPERTY_SETTINGS
@given(case=cross_cases())
def test_cross_state_apply_equals_naive(case):
    """One state per source serves ``beam`` query rows (sentence-major); padded keys are ignored,
    and an all-padded source gives 0 (0 / eps)."""
    gen = torch.Generator().manual_seed(case["seed"])
    Bs, beam, H, Tq, S, Fd, K = (case[n] for n in ("Bs", "beam", "H", "Tq", "S", "F", "K"))
    q = features(gen, Bs * beam, H, Tq, Fd)
    k = features(gen, Bs, H, S, Fd)
    v = torch.randn(Bs, H, S, K, generator=gen, dtype=DT)
    mask = case["mask"]
    state = cross_rfa_state(k, v, mask)
    out = cross_rfa_apply(q, state)
    rep = lambda x: None if x is None else x.repeat_interleave(beam, dim=0)  # noqa: E731
    ref = naive_cross_rfa(q, rep(k), rep(v), rep(mask))
    assert_close(out, ref, "cross out")
    # The state itself: sums over the real keys only.
    keep = torch.ones(Bs, S, dtype=DT) if mask is None else (~mask).to(DT)
    assert_close(state[..., -1], (k * keep[:, None, :, None]).sum(2), "z")
    assert_close(state[..., :-1], torch.einsum("bhsf,bhsk,bs->bhfk", k, v, keep), "S")
    if mask is not None:
        for b in range(Bs):
            if bool(mask[b].all()):
                assert torch.all(out[b * beam:(b + 1) * beam] == 0), "all-padded source must give 0"
