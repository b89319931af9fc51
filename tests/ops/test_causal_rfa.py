"""Causal RFA: the chunked parallel form, the recurrent form and its step against the naive
reference, all through one contract: ``(q, k, v, log_g, initial_state, output_final_state) ->
(out, final_state or None)``.

Layouts: q, k ``[B, H, T, F]``, v ``[B, H, T, K]``, log_g ``[B, H, T]``; the ops take and return the
state packed as ``[S | z]`` ``[B, H, F, K + 1]``, which these tests split into ``(S, z)`` to compare
(and differentiate) each part by name. The implementations accumulate in fp64 for fp64 inputs (used
here for tight comparisons, rtol 1e-10) and in fp32 for every other dtype (rtol 1e-5).
"""
from functools import partial

import pytest
import torch
import torch.nn.functional as F

from rfa_fairseq.ops import (
    chunk_causal_rfa,
    feature_map,
    gaussian_step_features,
    gaussian_step_weights,
    guarded_ratio,
    naive_causal_rfa,
    recurrent_causal_rfa,
    recurrent_causal_rfa_step,
    sample_random_matrix,
)
from rfa_fairseq.ops.denominator import DEFAULT_EPS

B, H = 2, 3


# ----------------------------------------------------------------------------- helpers


def join(state):
    """``(S, z)`` -> the ops' packed state ``[S | z]`` (None stays None)."""
    return None if state is None else torch.cat([state[0], state[1].unsqueeze(-1).to(state[0].dtype)], dim=-1)


def split(state):
    """The ops' packed state -> ``(S, z)`` as views."""
    return state[..., :-1], state[..., -1]


def assert_close(actual, expected, rtol=1e-5, name="", floor=0.0):
    """Element-wise rtol plus an absolute slack of rtol times the largest |expected|.

    ``floor`` is an absolute slack for quantities that are exactly zero in exact arithmetic and
    only rounding noise in fp32 (e.g. d out / d q at T = 1, where out = v whatever q is)."""
    assert actual.shape == expected.shape, f"{name}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    a, e = actual.double(), expected.double()
    assert torch.isfinite(a).all(), f"{name}: non-finite values"
    scale = max(e.abs().max().item(), 1e-30) if e.numel() else 1.0
    torch.testing.assert_close(a, e, rtol=rtol, atol=rtol * scale + floor, msg=lambda m: f"{name}: {m}")


def positive_features(gen, *shape, dtype=torch.float32):
    """Feature-like inputs bounded away from zero, so phi(q).z is well above eps."""
    return (torch.randn(*shape, generator=gen).abs() + 0.1).to(dtype)


def make_inputs(gen, T, Fd, K, gate, init, features="abs"):
    if features == "abs":
        q = positive_features(gen, B, H, T, Fd)
        k = positive_features(gen, B, H, T, Fd)
    else:  # real arc-cosine random features (non-negative) of random inputs
        D, head_dim = Fd, 8
        W = sample_random_matrix("orthogonal", H, D, head_dim, gen)
        sigma = torch.full((H, head_dim), 1.0)
        q = feature_map("arccos", torch.randn(B, H, T, head_dim, generator=gen), sigma, W) + 0.05
        k = feature_map("arccos", torch.randn(B, H, T, head_dim, generator=gen), sigma, W) + 0.05
    v = torch.randn(B, H, T, K, generator=gen)
    log_g = F.logsigmoid(torch.randn(B, H, T, generator=gen)) if gate else None
    state = None
    if init:
        state = (torch.randn(B, H, Fd, K, generator=gen), positive_features(gen, B, H, Fd) * 3)
    return q, k, v, log_g, state


def run_recurrent(q, k, v, log_g=None, initial_state=None, eps=DEFAULT_EPS, inplace=False, convex=True):
    """The decoder's path: recurrent_causal_rfa_step token by token on the packed state
    (updated in place with ``inplace``, as the decoder does without autograd)."""
    state = join(initial_state)
    outs = []
    for t in range(q.shape[2]):
        o, state = recurrent_causal_rfa_step(
            q[:, :, t], k[:, :, t], v[:, :, t], None if log_g is None else log_g[:, :, t],
            state, eps=eps, inplace=inplace, convex=convex,
        )
        outs.append(o)
    return torch.stack(outs, dim=2), split(state)


def run_chunk(chunk_size, convex=True):
    def fn(q, k, v, log_g=None, initial_state=None, eps=DEFAULT_EPS):
        out, state = chunk_causal_rfa(q, k, v, log_g, join(initial_state), True, eps=eps, convex=convex,
                                      chunk_size=chunk_size)
        return out, split(state)
    return fn


def run_naive(q, k, v, log_g=None, initial_state=None, eps=DEFAULT_EPS, convex=True):
    out, state = naive_causal_rfa(q, k, v, log_g, join(initial_state), True, eps=eps, convex=convex)
    return out, split(state)


def run_recurrent_form(q, k, v, log_g=None, initial_state=None, eps=DEFAULT_EPS, convex=True):
    out, state = recurrent_causal_rfa(q, k, v, log_g, join(initial_state), True, eps=eps, convex=convex)
    return out, split(state)


def forward_and_grads(fn, q, k, v, log_g, state):
    """Run ``fn`` and differentiate a random linear functional of (out, S, z) wrt every input."""
    leaves = {"q": q, "k": k, "v": v}
    if log_g is not None:
        leaves["log_g"] = log_g
    if state is not None:
        leaves["S0"], leaves["z0"] = state
    leaves = {n: t.detach().clone().requires_grad_(True) for n, t in leaves.items()}
    st = None if state is None else (leaves["S0"], leaves["z0"])
    out, (S, z) = fn(leaves["q"], leaves["k"], leaves["v"], leaves.get("log_g"), st)
    g = torch.Generator().manual_seed(7)  # same cotangents for every implementation
    cot = lambda x: torch.randn(x.shape, generator=g, dtype=torch.float64).to(x.dtype)  # noqa: E731
    loss = (out * cot(out)).sum() + (S * cot(S)).sum() + (z * cot(z)).sum()
    grads = torch.autograd.grad(loss, list(leaves.values()))
    return out.detach(), (S.detach(), z.detach()), dict(zip(leaves.keys(), grads))


def assert_same_run(got, ref, rtol=1e-5, grad_rtol=1e-5, floor=1e-6):
    (o1, (S1, z1), g1), (o2, (S2, z2), g2) = got, ref
    assert o1.dtype == o2.dtype
    assert_close(o1, o2, rtol, "out")
    assert_close(S1, S2, rtol, "S")
    assert_close(z1, z2, rtol, "z")
    assert g1.keys() == g2.keys()
    for name in g2:
        assert_close(g1[name], g2[name], grad_rtol, f"grad {name}", floor=floor)


# ----------------------------------------------------------------- equivalence with naive

CASES = [
    pytest.param(1, 60, 5, False, 16, "abs", id="T1-F60-K5-plain-C16"),
    pytest.param(1, 60, 5, True, 1, "abs", id="T1-F60-K5-gate-C1"),
    pytest.param(7, 60, 33, True, 1, "abs", id="T7-F60-K33-gate-C1"),
    pytest.param(7, 60, 33, False, 16, "abs", id="T7-F60-K33-plain-C16>T"),
    pytest.param(63, 60, 5, True, 16, "abs", id="T63-F60-K5-gate-C16"),
    pytest.param(63, 60, 33, False, 64, "abs", id="T63-F60-K33-plain-C64>T"),
    pytest.param(130, 60, 5, True, 64, "abs", id="T130-F60-K5-gate-C64"),
    pytest.param(130, 60, 5, False, 16, "abs", id="T130-F60-K5-plain-C16"),
    pytest.param(130, 60, 33, True, 256, "abs", id="T130-F60-K33-gate-C256>T"),
    pytest.param(63, 30, 5, True, 16, "arccos", id="T63-arccosF30-K5-gate-C16"),
    # the decay form of the gate (no 1 - g on the write)
    pytest.param(7, 60, 33, "decay", 1, "abs", id="T7-F60-K33-decay-C1"),
    pytest.param(130, 60, 5, "decay", 64, "abs", id="T130-F60-K5-decay-C64"),
    pytest.param(63, 30, 5, "decay", 16, "arccos", id="T63-arccosF30-K5-decay-C16"),
]
INIT = [pytest.param(False, id="zero-state"), pytest.param(True, id="init-state")]
# fp64 inputs are computed in fp64 (exact comparison); anything else in fp32.
PRECISIONS = [
    pytest.param(torch.float64, 1e-10, 1e-12, id="fp64"),
    pytest.param(torch.float32, 1e-5, 1e-6, id="fp32"),
]


def cast_inputs(dtype, q, k, v, log_g, state):
    cast = lambda x: None if x is None else x.to(dtype)  # noqa: E731
    return cast(q), cast(k), cast(v), cast(log_g), None if state is None else tuple(map(cast, state))


@pytest.mark.parametrize("dtype,rtol,floor", PRECISIONS)
@pytest.mark.parametrize("init", INIT)
@pytest.mark.parametrize("T,Fd,K,gate,chunk,features", CASES)
def test_chunk_matches_naive(gen, T, Fd, K, gate, chunk, features, init, dtype, rtol, floor):
    inputs = cast_inputs(dtype, *make_inputs(gen, T, Fd, K, gate, init, features))
    convex = gate != "decay"
    ref = forward_and_grads(partial(run_naive, convex=convex), *inputs)
    got = forward_and_grads(run_chunk(chunk, convex), *inputs)
    assert ref[0].dtype == dtype and ref[1][0].dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert_same_run(got, ref, rtol, rtol, floor)


@pytest.mark.parametrize("dtype,rtol,floor", PRECISIONS)
@pytest.mark.parametrize("init", INIT)
@pytest.mark.parametrize("T,Fd,K,gate,chunk,features", CASES)
def test_recurrent_steps_match_naive(gen, T, Fd, K, gate, chunk, features, init, dtype, rtol, floor):
    inputs = cast_inputs(dtype, *make_inputs(gen, T, Fd, K, gate, init, features))
    convex = gate != "decay"
    ref = forward_and_grads(partial(run_naive, convex=convex), *inputs)
    got = forward_and_grads(partial(run_recurrent, convex=convex), *inputs)
    assert_same_run(got, ref, rtol, rtol, floor)
    assert_same_run(forward_and_grads(partial(run_recurrent_form, convex=convex), *inputs), ref, rtol, rtol, floor)


@pytest.mark.parametrize("form", [naive_causal_rfa, recurrent_causal_rfa, partial(chunk_causal_rfa, chunk_size=4)],
                         ids=["naive", "recurrent", "chunk"])
@pytest.mark.parametrize("T", [0, 5], ids=["T0", "T5"])
def test_final_state_only_when_asked(gen, form, T):
    """One contract: ``(out, None)`` unless ``output_final_state``; with no tokens the final state
    is the initial one (zeros without one)."""
    q, k, v, log_g, state = make_inputs(gen, T, 12, 5, True, True)
    out, none = form(q, k, v, log_g, join(state))
    assert out.shape == v.shape and none is None
    _, final = form(q, k, v, log_g, None, True)
    assert final.shape == (B, H, 12, 6) and final.dtype == torch.float32
    if T == 0:
        assert torch.equal(final, torch.zeros_like(final))


@pytest.mark.parametrize("gate", [pytest.param(False, id="plain"), pytest.param(True, id="gate"),
                                  pytest.param("decay", id="decay")])
@pytest.mark.parametrize("chunk", [pytest.param(c, id=f"C{c}") for c in (1, 5, 16, 64, 100)])
def test_chunk_is_a_resumable_scan(gen, chunk, gate):
    """Two chunk calls chained through the returned state equal one call over the whole sequence
    (what a stateful language model does from one block to the next)."""
    q, k, v, log_g, state = make_inputs(gen, 90, 60, 5, gate, True)
    scan = run_chunk(chunk, convex=gate != "decay")
    part = lambda x, a, b: None if x is None else x[:, :, a:b]  # noqa: E731
    whole, (S, z) = scan(q, k, v, log_g, state)
    o1, st = scan(part(q, 0, 37), part(k, 0, 37), part(v, 0, 37), part(log_g, 0, 37), state)
    o2, (S2, z2) = scan(part(q, 37, 90), part(k, 37, 90), part(v, 37, 90), part(log_g, 37, 90), st)
    assert_close(torch.cat([o1, o2], dim=2), whole, name="out")
    assert_close(S2, S, name="S")
    assert_close(z2, z, name="z")


@pytest.mark.parametrize("gate", [pytest.param(False, id="plain"), pytest.param(True, id="gate"),
                                  pytest.param("decay", id="decay")])
@pytest.mark.parametrize("T,chunk", [pytest.param(7, 16, id="T7-C16"), pytest.param(16, 16, id="T16-C16"),
                                     pytest.param(40, 16, id="T40-C16")])
def test_chunk_output_alone_matches_naive(gen, T, chunk, gate):
    """Training asks for the output only (no state in or out): a single chunk then skips the
    state altogether. Output and gradients against the naive loop."""
    q, k, v, log_g, _ = make_inputs(gen, T, 60, 5, gate, False)
    convex = gate != "decay"
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v) + (() if log_g is None else (log_g,))]
    lg = leaves[3] if log_g is not None else None
    out, _ = chunk_causal_rfa(*leaves[:3], lg, chunk_size=chunk, convex=convex)
    ref, _ = naive_causal_rfa(*leaves[:3], lg, convex=convex)
    assert_close(out, ref, name="out")
    cot = torch.randn(out.shape, generator=gen)
    for name, a, b in zip("qkvg", torch.autograd.grad((out * cot).sum(), leaves),
                          torch.autograd.grad((ref * cot).sum(), leaves)):
        assert_close(a, b, name=f"grad {name}", floor=1e-6)


# ------------------------------------------------------------------------------ padding

PAD_PATTERNS = ["right", "left", "scattered"]


def pad_mask(pattern, T, gen):
    """[B, T] bool, True at padding; every row keeps at least one real token."""
    lengths = [T, max(1, T // 3)]  # one full row, one short row (B = 2)
    if pattern == "right":
        return torch.arange(T)[None, :] >= torch.tensor(lengths)[:, None]
    if pattern == "left":
        return torch.arange(T)[None, :] < (T - torch.tensor(lengths))[:, None]
    mask = torch.rand(B, T, generator=gen) < 0.4
    mask[:, 0] = False
    return mask


@pytest.mark.parametrize("init", INIT)
@pytest.mark.parametrize("gate", [pytest.param(False, id="plain"), pytest.param(True, id="gate")])
@pytest.mark.parametrize("pattern", PAD_PATTERNS)
@pytest.mark.parametrize(
    "impl",
    [
        pytest.param(run_naive, id="naive"),
        pytest.param(run_chunk(1), id="chunk-C1"),
        pytest.param(run_chunk(7), id="chunk-C7"),
        pytest.param(run_chunk(64), id="chunk-C64>T"),
        pytest.param(run_recurrent, id="recurrent"),
        pytest.param(run_recurrent_form, id="recurrent-form"),
    ],
)
def test_padding_leaves_state_unchanged(gen, impl, pattern, gate, init):
    T, Fd, K = 23, 60, 5
    q, k, v, log_g, state = make_inputs(gen, T, Fd, K, gate, init)
    mask = pad_mask(pattern, T, gen)
    assert mask.any() and (~mask).any(dim=1).all()
    pad = mask[:, None, :]  # [B, 1, T]
    # Padding: zero keys and log g = 0; queries and values are garbage that must not leak.
    k = k.masked_fill(pad[..., None], 0.0)
    q = torch.where(pad[..., None], 100 * torch.randn(q.shape, generator=gen), q)
    v = torch.where(pad[..., None], 100 * torch.randn(v.shape, generator=gen), v)
    if gate:
        log_g = log_g.masked_fill(pad, 0.0)
    out, (S, z) = impl(q, k, v, log_g, state)
    for b in range(B):
        idx = (~mask[b]).nonzero().squeeze(1)
        sub = lambda x: x[b : b + 1, :, idx]  # noqa: E731
        st_b = None if state is None else (state[0][b : b + 1], state[1][b : b + 1])
        ref, (S_ref, z_ref) = run_naive(sub(q), sub(k), sub(v), None if log_g is None else sub(log_g), st_b)
        assert_close(out[b : b + 1, :, idx], ref, name=f"row {b} out")
        assert_close(S[b : b + 1], S_ref, name=f"row {b} S")
        assert_close(z[b : b + 1], z_ref, name=f"row {b} z")


# ------------------------------------------------------------------ in-place recurrent step


@pytest.mark.parametrize("gate", [pytest.param(False, id="plain"), pytest.param(True, id="gate"),
                                  pytest.param("decay", id="decay")])
@pytest.mark.parametrize("init", INIT)
def test_recurrent_inplace_equals_out_of_place(gen, gate, init):
    T, Fd, K = 17, 60, 33
    q, k, v, log_g, state = make_inputs(gen, T, Fd, K, gate, init)
    if state is None:  # the caller owns the state tensor: start from zeros it made itself
        state = (torch.zeros(B, H, Fd, K), torch.zeros(B, H, Fd))
    with torch.no_grad():
        st_ref, st_ip = join(state), join(state)
        for t in range(T):
            args = (q[:, :, t], k[:, :, t], v[:, :, t], None if log_g is None else log_g[:, :, t])
            before = st_ref.clone()
            o_ref, new_ref = recurrent_causal_rfa_step(*args, st_ref, inplace=False, convex=gate != "decay")
            # the out-of-place step must not touch its input state
            assert torch.equal(st_ref, before)
            o_ip, new_ip = recurrent_causal_rfa_step(*args, st_ip, inplace=True, convex=gate != "decay")
            assert new_ip is st_ip
            torch.testing.assert_close(o_ip, o_ref, rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(new_ip, new_ref, rtol=1e-6, atol=1e-6)
            st_ref, st_ip = new_ref, new_ip
    out, (S, z) = run_naive(q, k, v, log_g, state, convex=gate != "decay")
    S_ip, z_ip = split(st_ip)
    assert_close(S_ip, S, name="S")
    assert_close(z_ip, z, name="z")
    assert_close(o_ip, out[:, :, -1], name="last out")


def test_recurrent_inplace_from_empty_state_does_not_alias_inputs(gen):
    q, k, v, _, _ = make_inputs(gen, 5, 60, 5, False, False)
    k_before = k.clone()
    with torch.no_grad():
        run_recurrent(q, k, v, None, None, inplace=True)
    assert torch.equal(k, k_before)


@pytest.mark.parametrize("eps", [DEFAULT_EPS, 1.0], ids=["eps", "large-eps"])
@pytest.mark.parametrize("gate", [pytest.param(None, id="plain"), pytest.param("convex", id="gate"),
                                  pytest.param("decay", id="decay")])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
def test_gaussian_step_features_feed_the_same_step(gen, gate, eps, dtype):
    """The inference feature map (``gaussian_step_features``, precomputed weights) against
    ``feature_map``, and the step it feeds against the same step fed by ``feature_map``: features,
    outputs and the in-place state at every token (the large floor makes the guard act; gaussian
    features make some denominators negative)."""
    T, K, D = 12, 8, 5
    qk = torch.randn(B, T, 2, H, K, generator=gen, dtype=dtype) * 3
    v = torch.randn(B, T, H, K, generator=gen, dtype=dtype)
    log_g = None if gate is None else F.logsigmoid(torch.randn(B, T, H, generator=gen, dtype=dtype) * 2)
    sigma = torch.rand(H, K, generator=gen, dtype=dtype) + 0.5
    w = sample_random_matrix("orthogonal", H, D, K, gen).to(dtype)
    rtol = 1e-10 if dtype == torch.float64 else 1e-5
    weights = gaussian_step_weights(w, sigma)

    def decode(features):
        state, outs, states, clamped = None, [], [], 0
        with torch.no_grad():
            for t in range(T):
                q, k = features(qk[:, t].transpose(1, 2)).unbind(2)  # [B, H, F] each
                o, state = recurrent_causal_rfa_step(q, k, v[:, t], None if log_g is None else log_g[:, t], state,
                                                     eps=eps, convex=gate != "decay", inplace=True)
                outs.append(o)
                states.append(state.clone())
                clamped += int(((q.unsqueeze(-2) @ state[..., -1:]).squeeze(-1).squeeze(-1) < eps).sum())
        return outs, states, clamped

    fast = lambda x: gaussian_step_features(x, *weights)  # noqa: E731
    reference = lambda x: feature_map("gaussian", x, sigma, w)  # noqa: E731
    x = qk.permute(0, 3, 1, 2, 4).flatten(2, 3)  # [B, H, 2 T, K]
    torch.testing.assert_close(fast(x), reference(x), rtol=rtol, atol=rtol)
    (fast_outs, fast_states, _), (outs, states, clamped) = decode(fast), decode(reference)
    for t in range(T):
        torch.testing.assert_close(fast_outs[t], outs[t], rtol=rtol, atol=rtol)
        torch.testing.assert_close(fast_states[t], states[t], rtol=rtol, atol=rtol)
    if eps > DEFAULT_EPS:
        assert clamped > 0, "the test should make the guard act"


# ------------------------------------------------------------------ the denominator guard


def test_guarded_ratio_clamps_at_eps():
    num = torch.tensor([[2.0], [3.0], [4.0], [5.0], [6.0]])
    den = torch.tensor([-1.0, 0.0, 1e-5, 0.5, 2.0])
    out = guarded_ratio(num, den, 1e-2, torch.float32)
    expected = torch.tensor([[200.0], [300.0], [400.0], [10.0], [3.0]])
    torch.testing.assert_close(out, expected)
    # outside fp16's range: clamped to the largest finite fp16, never inf
    big = guarded_ratio(torch.tensor([[1e3], [-1e3]]), torch.tensor([0.0, 0.0]), 1e-2, torch.float16)
    assert big.dtype == torch.float16
    assert big.tolist() == [[65504.0], [-65504.0]]


IMPLS = [
    pytest.param(run_naive, id="naive"),
    pytest.param(run_chunk(16), id="chunk-C16"),
    pytest.param(run_recurrent, id="recurrent"),
]
DTYPES = [
    pytest.param(torch.float32, id="fp32"),
    pytest.param(torch.float16, id="fp16"),
    pytest.param(torch.bfloat16, id="bf16"),
]


def adversarial_inputs(kind, scale, T, Fd, K, gen):
    """Features for which phi(q).z is about 0 or negative at many steps."""
    q = torch.randn(B, H, T, Fd, generator=gen)
    k = torch.randn(B, H, T, Fd, generator=gen)
    v = torch.randn(B, H, T, K, generator=gen)
    if kind == "anti-aligned":  # q_t = -k_t: the first denominator is -|k_0|^2 < 0
        q = -k
    elif kind == "orthogonal":  # q lives on the first half of the features, k on the second: den = 0
        q[..., Fd // 2 :] = 0
        k[..., : Fd // 2] = 0
    elif kind == "zero-query":
        q = torch.zeros_like(q)
    elif kind == "tiny-den":  # den = q.z is ~1e-7 at the first step
        k = k.abs()
        q = k * 1e-7 / (k * k).sum(-1, keepdim=True)
    return q * scale, k * scale, v * scale


@pytest.mark.parametrize("gate", [pytest.param(False, id="plain"), pytest.param(True, id="gate")])
@pytest.mark.parametrize(
    "kind,scale",
    [
        pytest.param("mixed-sign", 1.0, id="mixed-sign"),
        pytest.param("mixed-sign", 60.0, id="mixed-sign-x60"),
        pytest.param("anti-aligned", 1.0, id="anti-aligned"),
        pytest.param("anti-aligned", 60.0, id="anti-aligned-x60"),
        pytest.param("orthogonal", 1.0, id="orthogonal"),
        pytest.param("zero-query", 1.0, id="zero-query"),
        pytest.param("tiny-den", 1.0, id="tiny-den"),
    ],
)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("impl", IMPLS)
def test_denominator_guard_is_finite(gen, impl, dtype, kind, scale, gate):
    T, Fd, K = 19, 60, 5
    q, k, v = adversarial_inputs(kind, scale, T, Fd, K, gen)
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    log_g = F.logsigmoid(torch.randn(B, H, T, generator=gen)).to(dtype) if gate else None
    out, (S, z) = impl(q, k, v, log_g)
    assert out.dtype == v.dtype
    assert S.dtype == torch.float32 and z.dtype == torch.float32
    assert torch.isfinite(out).all()
    assert torch.isfinite(S).all() and torch.isfinite(z).all()
    if kind in ("orthogonal", "zero-query"):  # num = 0 and den = 0: the guard gives exactly 0
        assert (out == 0).all()
    if kind == "anti-aligned" and not gate:  # step 0: num / eps with num = -|k_0|^2 v_0 (fp32)
        kf, vf = k[:, :, 0].float(), v[:, :, 0].float()
        expected = (-(kf * kf).sum(-1, keepdim=True) * vf / DEFAULT_EPS)
        if dtype != torch.float32:
            lim = torch.finfo(dtype).max
            expected = expected.clamp(-lim, lim)
        torch.testing.assert_close(out[:, :, 0].float(), expected.to(dtype).float(), rtol=1e-2, atol=0)
    if dtype == torch.float16 and scale > 1:  # some results exceed fp16: they must hit the clamp
        assert out.abs().max().item() == torch.finfo(torch.float16).max


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("impl", IMPLS)
def test_denominator_guard_gradients_are_finite(gen, impl, dtype):
    T, Fd, K = 19, 60, 5
    q, k, v = adversarial_inputs("mixed-sign", 1.0, T, Fd, K, gen)
    log_g = F.logsigmoid(torch.randn(B, H, T, generator=gen))
    leaves = [x.to(dtype).requires_grad_(True) for x in (q, k, v, log_g)]
    out, (S, z) = impl(*leaves)
    grads = torch.autograd.grad(out.float().sum() + S.sum() + z.sum(), leaves)
    for name, gr in zip("q k v log_g".split(), grads):
        assert gr.dtype == dtype
        assert torch.isfinite(gr).all(), name


@pytest.mark.parametrize("dtype", [pytest.param(torch.float64, id="fp64")] + DTYPES)
@pytest.mark.parametrize("impl", IMPLS)
def test_output_dtype_follows_v_and_low_precision_matches_naive(gen, impl, dtype):
    """Inputs of any float dtype: output in v's dtype, the state in the compute dtype (fp64 for
    fp64 inputs, fp32 otherwise), equal to naive up to the output dtype's rounding."""
    q, k, v, log_g, state = make_inputs(gen, 21, 60, 5, True, True)
    q, k, v, log_g = (x.to(dtype) for x in (q, k, v, log_g))
    out, (S, z) = impl(q, k, v, log_g, state)
    ref, (S_ref, z_ref) = run_naive(q, k, v, log_g, state)
    assert out.dtype == dtype == ref.dtype
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    assert S.dtype == z.dtype == acc
    rtol = {torch.float64: 1e-10, torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
    assert_close(out, ref, rtol, "out")
    assert_close(S, S_ref, max(rtol, 1e-5) if acc == torch.float32 else rtol, "S")
    assert_close(z, z_ref, max(rtol, 1e-5) if acc == torch.float32 else rtol, "z")


# ---------------------------------------------------------------- gates near 0 and near 1


def extreme_log_g(kind, T, gen):
    if kind == "closed":  # g = e^-50: the state forgets everything but the current token
        return torch.full((B, H, T), -50.0)
    if kind == "open":  # g = 1 - 1e-8: the state barely moves
        return torch.full((B, H, T), -1e-8)
    pick = torch.rand(B, H, T, generator=gen) < 0.5
    return torch.where(pick, torch.tensor(-50.0), torch.tensor(-1e-8))


@pytest.mark.parametrize(
    "dtype,rtol", [pytest.param(torch.float64, 1e-10, id="fp64"), pytest.param(torch.float32, 1e-4, id="fp32")]
)
@pytest.mark.parametrize("kind", ["closed", "open", "mixed"])
@pytest.mark.parametrize(
    "impl", [pytest.param(run_chunk(64), id="chunk-C64"), pytest.param(run_chunk(7), id="chunk-C7"),
             pytest.param(run_recurrent, id="recurrent")]
)
def test_extreme_gates_long_sequence(gen, impl, kind, dtype, rtol):
    T, Fd, K = 512, 60, 5
    q, k, v, _, state = cast_inputs(dtype, *make_inputs(gen, T, Fd, K, False, True))
    log_g = extreme_log_g(kind, T, gen).to(dtype)
    ref, (S_ref, z_ref) = run_naive(q, k, v, log_g, state)

    leaves = [x.clone().requires_grad_(True) for x in (q, k, v, log_g, *state)]
    out, (S, z) = impl(leaves[0], leaves[1], leaves[2], leaves[3], (leaves[4], leaves[5]))
    for x in (out, S, z):
        assert torch.isfinite(x).all()
    # In fp32 the naive reference computes 1 - g as 1 - exp(log g), which is exactly 0 for
    # log g = -1e-8 (the fast paths use -expm1 and get 1e-8): the two differ by O(T * 1e-8).
    assert_close(out, ref, rtol, "out")
    assert_close(S, S_ref, rtol, "S")
    assert_close(z, z_ref, rtol, "z")
    # Closed-form limits, independent of the reference.
    if kind == "closed":  # only the current token survives: out_t = v_t (up to e^-50)
        assert_close(out, v, 1e-5 if dtype == torch.float32 else 1e-12, "out vs v")
    if kind == "open":  # the initial state dominates: out_t = q_t S0 / q_t z0
        S0, z0 = state
        expected = torch.einsum("bhtf,bhfk->bhtk", q, S0) / torch.einsum("bhtf,bhf->bht", q, z0)[..., None]
        assert_close(out, expected, 1e-4, "out vs initial state")  # the state moves by O(T * 1e-8)
    g = torch.Generator().manual_seed(3)
    loss = (out * torch.randn(out.shape, generator=g)).sum() + S.sum() + z.sum()
    grads = torch.autograd.grad(loss, leaves)
    for name, gr in zip(["q", "k", "v", "log_g", "S0", "z0"], grads):
        assert torch.isfinite(gr).all(), name


@pytest.mark.parametrize("kind", ["closed", "open", "mixed"])
def test_extreme_gates_chunk_gradients_match_recurrent(gen, kind):
    """The chunked and recurrent paths share the -expm1 form of 1 - g: their grads agree tightly."""
    T, Fd, K = 200, 60, 5
    q, k, v, _, state = make_inputs(gen, T, Fd, K, False, True)
    log_g = extreme_log_g(kind, T, gen)
    got = forward_and_grads(run_chunk(64), q, k, v, log_g, state)
    ref = forward_and_grads(run_recurrent, q, k, v, log_g, state)
    assert_same_run(got, ref, rtol=1e-5, grad_rtol=1e-4)


@pytest.mark.parametrize("gate", [pytest.param(False, id="plain"), pytest.param(True, id="gate")])
def test_chunk_empty_sequence(gen, gate):
    q, k, v, log_g, state = make_inputs(gen, 0, 60, 5, gate, True)
    out, (S, z) = run_chunk(16)(q, k, v, log_g, state)
    assert out.shape == (B, H, 0, 5)
    assert torch.equal(S, state[0]) and torch.equal(z, state[1])
