"""Random matrices and feature maps: the kernels they estimate, and RFA -> softmax attention.

Layouts: inputs ``[B, H, T, K]``, random matrix ``[H, D, K]``, sigma ``[H, K]``, features
``[B, H, T, F]`` with F = 2D (Gaussian, sin/cos), D (arc-cosine, FAVOR+) or K (elu + 1). All
statistical checks use
fixed seeds; thresholds sit between the observed error and the error of a wrong formula.
"""
import math

import pytest
import torch

from rfa_fairseq.ops import (
    KERNELS,
    POSITIVE_KERNELS,
    RANDOM_MATRICES,
    chunk_causal_rfa,
    cross_rfa_apply,
    cross_rfa_state,
    feature_map,
    feature_size,
    l2_normalize,
    sample_random_matrix,
)
from rfa_fairseq.ops.feature_maps import sample_orthogonal_matrix

KINDS = [pytest.param(kind, id=kind) for kind in RANDOM_MATRICES]


def seeded(seed):
    return torch.Generator().manual_seed(seed)


def kernel_pairs(g, H, N, K):
    """Unit vectors x and y at a spread of distances (close pairs and unrelated ones)."""
    x = l2_normalize(torch.randn(1, H, N, K, generator=g))
    spread = torch.linspace(0.05, 2.0, N)[None, None, :, None]
    y = l2_normalize(x + spread * torch.randn(1, H, N, K, generator=g))
    return x, y


# ------------------------------------------------------------------ (a) Gaussian kernel


@pytest.mark.parametrize("kind", KINDS)
def test_gaussian_map_estimates_gaussian_kernel(kind):
    H, K, N = 2, 8, 256
    g = seeded(0)
    sigma = 0.5 + torch.rand(H, K, generator=g)  # per head and per dimension
    x, y = kernel_pairs(g, H, N, K)
    exact = torch.exp(-((sigma[:, None, :] * (x - y)) ** 2).sum(-1) / 2)
    assert exact.min() < 0.3 and exact.max() > 0.9  # the pairs cover a range of kernel values
    errors = {}
    for D in (16, 256, 4096):
        W = sample_random_matrix(kind, H, D, K, g)
        px, py = feature_map("gaussian", x, sigma, W), feature_map("gaussian", y, sigma, W)
        assert px.shape == (1, H, N, feature_size("gaussian", D, K)) == (1, H, N, 2 * D)
        # sin^2 + cos^2 = 1: |phi(x)| = 1 exactly, whatever the draw
        torch.testing.assert_close(px.norm(dim=-1), torch.ones(1, H, N), rtol=1e-5, atol=1e-5)
        errors[D] = ((px * py).sum(-1) - exact).abs().mean().item()
    assert errors[4096] < errors[256] < errors[16], errors
    assert errors[4096] < 0.03, errors
    # A wrong scale (sigma applied twice, or not at all) is far off even with many features.
    W = sample_random_matrix(kind, H, 4096, K, g)
    est = (feature_map("gaussian", x, sigma, W) * feature_map("gaussian", y, sigma, W)).sum(-1)
    wrong = torch.exp(-((sigma[:, None, :] ** 2 * (x - y)) ** 2).sum(-1) / 2)
    assert (est - wrong).abs().mean().item() > 3 * errors[4096]


@pytest.mark.parametrize("kind", KINDS)
def test_favor_map_estimates_the_exponential_kernel(kind):
    """FAVOR+: phi(x).phi(y) is unbiased for exp(x.y) on the scaled inputs, and positive; its
    error falls as D grows, and a missing |x|^2 / 2 correction is far off."""
    H, K, N = 2, 8, 256
    g = seeded(10)
    sigma = 0.5 + torch.rand(H, K, generator=g)
    x, y = kernel_pairs(g, H, N, K)
    exact = torch.exp((sigma[:, None, :] ** 2 * x * y).sum(-1))
    errors = {}
    for D in (16, 256, 4096):
        W = sample_random_matrix(kind, H, D, K, g)
        px, py = feature_map("favor", x, sigma, W), feature_map("favor", y, sigma, W)
        assert (px > 0).all() and px.shape == (1, H, N, D)
        errors[D] = (((px * py).sum(-1) - exact).abs() / exact).mean().item()
    assert errors[4096] < errors[256] < errors[16], errors
    assert errors[4096] < 0.1, errors  # about 1 / sqrt(D): 0.74, 0.19, 0.06 with these seeds
    W = sample_random_matrix(kind, H, 4096, K, g)
    est = (feature_map("favor", x, sigma, W) * feature_map("favor", y, sigma, W)).sum(-1)
    without_correction = est * torch.exp(0.5 * ((sigma[:, None, :] * x) ** 2).sum(-1)
                                         + 0.5 * ((sigma[:, None, :] * y) ** 2).sum(-1))
    assert ((without_correction - exact).abs() / exact).mean().item() > 5 * errors[4096]


def test_elu_map_is_deterministic_and_ignores_the_random_matrix():
    g = seeded(11)
    H, K = 2, 6
    x = 3 * torch.randn(1, H, 4, K, generator=g)
    sigma = 0.5 + torch.rand(H, K, generator=g)
    a = feature_map("elu", x, sigma, sample_random_matrix("gaussian", H, 5, K, g))
    b = feature_map("elu", x, sigma, sample_random_matrix("gaussian", H, 5, K, g))
    assert torch.equal(a, b) and (a > 0).all()
    # not normalised: scaling the input changes the features (a unit-norm map would not)
    assert not torch.allclose(feature_map("elu", 2 * x, sigma, torch.zeros(H, 5, K)), a)


def test_feature_map_shapes_dtypes_and_errors():
    g = seeded(1)
    B, H, T, K, D = 2, 3, 7, 5, 33
    W = sample_random_matrix("gaussian", H, D, K, g)
    sigma = torch.ones(H, K)
    x = torch.randn(B, H, T, K, generator=g).half()
    for kernel in KERNELS:
        phi = feature_map(kernel, x, sigma, W)
        assert phi.shape == (B, H, T, feature_size(kernel, D, K))
        assert phi.dtype == torch.float32  # features are always computed in fp32
        if kernel in POSITIVE_KERNELS:
            assert (phi >= 0).all()
    assert feature_size("gaussian", D, K) == 2 * D and feature_size("arccos", D, K) == D
    assert feature_size("favor", D, K) == D and feature_size("elu", D, K) == K
    with pytest.raises(ValueError):
        feature_map("laplace", x, sigma, W)
    with pytest.raises(ValueError):
        feature_size("laplace", D, K)
    with pytest.raises(ValueError):
        sample_random_matrix("uniform", H, D, K, g)


@pytest.mark.parametrize("kind", KINDS)
def test_random_matrix_draws_follow_the_generator(kind):
    a = sample_random_matrix(kind, 2, 20, 6, seeded(5))
    b = sample_random_matrix(kind, 2, 20, 6, seeded(5))
    c = sample_random_matrix(kind, 2, 20, 6, seeded(6))
    assert a.shape == (2, 20, 6) and a.dtype == torch.float32
    assert torch.equal(a, b)
    assert not torch.allclose(a, c)


def naive_features(kernel, x, sigma, W):
    """phi by the formula, one row at a time: w_i = sigma * omega_i on the unit input (on the
    input itself for elu)."""
    B, H, T, K = x.shape
    D = W.shape[1]
    out = []
    for b in range(B):
        for h in range(H):
            for t in range(T):
                if kernel == "elu":
                    out.append(torch.where(sigma[h] * x[b, h, t] > 0, sigma[h] * x[b, h, t] + 1,
                                           torch.exp(sigma[h] * x[b, h, t])))
                    continue
                u = x[b, h, t] / (x[b, h, t].norm() + 1e-6)
                proj = torch.stack([torch.dot(sigma[h] * W[h, i], u) for i in range(D)])
                if kernel == "gaussian":
                    phi = torch.cat([proj.sin(), proj.cos()])
                elif kernel == "favor":
                    phi = torch.exp(proj - 0.5 * ((sigma[h] * u) ** 2).sum())
                else:
                    phi = proj.relu()
                out.append(phi / math.sqrt(D))
    return torch.stack(out).view(B, H, T, -1)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("rows", [(8, 1), (2, 3), (3, 50)], ids=["step", "few", "many"])
def test_feature_map_equals_the_formula_row_by_row(kernel, rows):
    """The batched map (sigma on the inputs, one bmm over heads) computes the formula's features,
    in fp64 to rounding and in fp32 closely, for the strides of fairseq's Time x Batch layout."""
    B, T = rows
    H, K, D = 3, 8, 20
    g = seeded(3)
    W = torch.randn(H, D, K, generator=g, dtype=torch.float64)
    sigma = 0.5 + torch.rand(H, K, generator=g, dtype=torch.float64)
    x = torch.randn(T, B, H * K, generator=g, dtype=torch.float64).view(T, B, H, K).permute(1, 2, 0, 3)
    ref = naive_features(kernel, x, sigma, W)
    out = feature_map(kernel, x, sigma, W)
    assert out.shape == ref.shape == (B, H, T, feature_size(kernel, D, K)) and out.dtype == torch.float64
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    out32 = feature_map(kernel, x.float(), sigma.float(), W.float())
    assert out32.dtype == torch.float32
    torch.testing.assert_close(out32, ref.float(), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="laplace"):
        feature_map("laplace", x, sigma, W)


def test_feature_map_gradients_equal_the_formulas():
    g = seeded(4)
    H, K, D = 2, 5, 7
    W = torch.randn(H, D, K, generator=g, dtype=torch.float64)
    for kernel in KERNELS:
        sigma = (0.5 + torch.rand(H, K, generator=g, dtype=torch.float64)).requires_grad_(True)
        x = torch.randn(2, H, 3, K, generator=g, dtype=torch.float64).requires_grad_(True)
        cot = torch.randn(2, H, 3, feature_size(kernel, D, K), generator=g, dtype=torch.float64)
        got = torch.autograd.grad((feature_map(kernel, x, sigma, W) * cot).sum(), (x, sigma))
        ref = torch.autograd.grad((naive_features(kernel, x, sigma, W) * cot).sum(), (x, sigma))
        for a, b in zip(got, ref):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


# ------------------------------------------------------------- (b) orthogonal matrices


@pytest.mark.parametrize(
    "H,D,K",
    [
        pytest.param(1, 8, 8, id="H1-D8-K8"),
        pytest.param(3, 33, 5, id="H3-D33-K5-partial"),
        pytest.param(2, 70, 33, id="H2-D70-K33-partial"),
        pytest.param(2, 3, 7, id="H2-D3-K7-D<K"),
    ],
)
def test_orthogonal_blocks(H, D, K):
    W = sample_orthogonal_matrix(H, D, K, seeded(2))
    assert W.shape == (H, D, K)
    assert torch.isfinite(W).all() and (W.norm(dim=-1) > 0).all()
    U = W / W.norm(dim=-1, keepdim=True)
    for start in range(0, D, K):  # each block of K rows (the last may be shorter): orthonormal
        block = U[:, start : start + K]
        gram = block @ block.transpose(-1, -2)
        torch.testing.assert_close(gram, torch.eye(block.shape[1]).expand_as(gram), rtol=0, atol=1e-5)
    if D > K:  # different blocks are independent draws, not orthogonal to each other
        cross = U[:, :K] @ U[:, K : 2 * K].transpose(-1, -2)
        assert cross.abs().max() > 0.1


def test_orthogonal_rows_are_marginally_standard_normal():
    H, D, K = 2, 4000, 6
    W = sample_orthogonal_matrix(H, D, K, seeded(3))
    sq = W.pow(2).sum(-1)  # chi^2(K): mean K, variance 2K
    assert abs(sq.mean().item() - K) < 0.05 * K
    assert abs(sq.var().item() - 2 * K) < 0.15 * 2 * K
    assert abs(W.mean().item()) < 0.03 and abs(W.var().item() - 1) < 0.05
    # each row has its own chi(K) norm (not one norm per block, not unit rows)
    assert W[0, :K].norm(dim=-1).std() > 0


# ---------------------------------------------------------------- (c) arc-cosine kernel


def test_arccos_features_are_nonnegative_with_right_shape():
    g = seeded(4)
    B, H, T, K, D = 2, 3, 7, 5, 37
    W = sample_random_matrix("orthogonal", H, D, K, g)
    phi = feature_map("arccos", torch.randn(B, H, T, K, generator=g), torch.rand(H, K, generator=g) + 0.5, W)
    assert phi.shape == (B, H, T, D)
    assert (phi >= 0).all()
    assert (phi == 0).any() and (phi > 0).any()  # relu: about half the features are zero


@pytest.mark.parametrize("scale", [pytest.param(1.0, id="sigma1"), pytest.param(2.0, id="sigma2")])
@pytest.mark.parametrize("kind", KINDS)
def test_arccos_map_estimates_order1_arccos_kernel(kind, scale):
    """phi(x).phi(y) -> E[relu(w.x) relu(w.y)] = |sx||sy| (sin t + (pi - t) cos t) / (2 pi)."""
    H, K, N, D = 2, 8, 256, 16384
    g = seeded(5)
    x = torch.randn(1, H, N, K, generator=g) * (0.5 + torch.rand(1, H, N, 1, generator=g))
    y = torch.randn(1, H, N, K, generator=g) * (0.5 + torch.rand(1, H, N, 1, generator=g))
    y[:, :, :16] = x[:, :, :16] * 1.3  # some parallel pairs (t = 0)
    y[:, :, 16:32] = -x[:, :, 16:32]  # some opposite pairs (t = pi, kernel 0)
    nx, ny = x.norm(dim=-1), y.norm(dim=-1)
    t = torch.acos(((x * y).sum(-1) / (nx * ny)).clamp(-1, 1))
    exact = scale**2 * nx * ny * (torch.sin(t) + (math.pi - t) * torch.cos(t)) / (2 * math.pi)
    sigma = torch.full((H, K), scale)
    W = sample_random_matrix(kind, H, D, K, g)
    # feature_map maps the unit vector x / |x|; the order-1 kernel is homogeneous in |x| and |y|
    est = (feature_map("arccos", x, sigma, W) * feature_map("arccos", y, sigma, W)).sum(-1) * nx * ny
    err = (est - exact).abs() / (scale**2 * nx * ny)
    assert err.mean() < 0.01 and err.max() < 0.05, (err.mean(), err.max())
    assert est[:, :, 16:32].abs().max() < 1e-6  # opposite vectors: never both positive
    # the constant: a least-squares fit of est = c * exact gives c = 1 within a few percent
    c = (est * exact).sum() / (exact * exact).sum()
    assert abs(c.item() - 1) < 0.03, c


# ------------------------------------------------------- (d) RFA -> softmax attention


def softmax_attention(q, k, v, temperature, causal=False):
    logits = temperature * q @ k.transpose(-1, -2)
    if causal:
        T = q.shape[2]
        logits = logits.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
    return torch.softmax(logits, dim=-1) @ v


@pytest.mark.parametrize("kind", KINDS)
def test_cross_rfa_approaches_softmax_attention(kind):
    """Unit q, k and sigma = s: phi(q).phi(k) ~ exp(-s^2) exp(s^2 q.k), so RFA ~ softmax(s^2 q.k) v."""
    B, H, K, Tq, S, s = 2, 2, 8, 10, 24, 1.5
    g = seeded(0)
    q = l2_normalize(torch.randn(B, H, Tq, K, generator=g))
    k = l2_normalize(torch.randn(B, H, S, K, generator=g))
    v = torch.randn(B, H, S, K, generator=g)
    sigma = torch.full((H, K), s)
    target = softmax_attention(q, k, v, s * s)
    mean_err, max_err = {}, {}
    for D in (64, 8192):
        W = sample_random_matrix(kind, H, D, K, g)
        out = cross_rfa_apply(feature_map("gaussian", q, sigma, W),
                              cross_rfa_state(feature_map("gaussian", k, sigma, W), v))
        mean_err[D] = (out - target).abs().mean().item()
        max_err[D] = (out - target).abs().max().item()
    assert mean_err[8192] < mean_err[64] / 4 and max_err[8192] < max_err[64], (mean_err, max_err)
    assert max_err[8192] < 0.1 and mean_err[8192] < 0.018, (mean_err, max_err)
    # The same output is clearly farther from softmax attention with a wrong temperature.
    for wrong in (s, 1.2 * s * s, s**4):
        assert (out - softmax_attention(q, k, v, wrong)).abs().mean().item() > 0.022


@pytest.mark.parametrize("kind", KINDS)
def test_causal_rfa_approaches_causal_softmax_attention(kind):
    B, H, K, T, s = 2, 2, 8, 40, 1.5
    g = seeded(1)
    q = l2_normalize(torch.randn(B, H, T, K, generator=g))
    k = l2_normalize(torch.randn(B, H, T, K, generator=g))
    v = torch.randn(B, H, T, K, generator=g)
    sigma = torch.full((H, K), s)
    target = softmax_attention(q, k, v, s * s, causal=True)
    mean_err = {}
    for D in (64, 8192):
        W = sample_random_matrix(kind, H, D, K, g)
        out, _ = chunk_causal_rfa(feature_map("gaussian", q, sigma, W), feature_map("gaussian", k, sigma, W), v,
                                  chunk_size=16)
        mean_err[D] = (out - target).abs().mean().item()
    assert mean_err[8192] < mean_err[64] / 4, mean_err
    assert mean_err[8192] < 0.02, mean_err
    # later positions average over many keys: the estimate is tight there
    assert (out - target)[:, :, T // 2 :].abs().max() < 0.1
    for wrong in (s, 1.2 * s * s, s**4):
        assert (out - softmax_attention(q, k, v, wrong, causal=True)).abs().mean().item() > 0.025
