"""The feature-map kernel (rfa_fairseq/kernels) against ops.prepared_feature_map, and its sin/cos
against fp64."""
import math

import pytest
import torch

from rfa_fairseq import kernels
from rfa_fairseq.ops import l2_normalize, prepared_feature_map, projection_matrix, sample_random_matrix



def _sincos(x, scale=1.0):
    return kernels.load().sincos_scaled(x.contiguous(), scale)


def test_sin_cos_are_within_2e_7_of_fp64_over_the_reduced_range():
    x = torch.cat([torch.linspace(-8192, 8192, 400_001), torch.linspace(-10, 10, 100_001),
                   torch.tensor([0.0, -0.0, math.pi / 4, -math.pi / 4, math.pi / 2, 3 * math.pi / 4, math.pi])])
    s, c = _sincos(x)
    xd = x.double()
    assert (s.double() - torch.sin(xd)).abs().max().item() < 2e-7
    assert (c.double() - torch.cos(xd)).abs().max().item() < 2e-7


def test_sin_cos_beyond_the_reduced_range_use_the_library():
    """A block with an argument past 8192 (or a NaN) is computed by std::sin, std::cos."""
    x = torch.tensor([1.0, 9000.0, -3.0e4, 1.0e6, 2.5])
    s, c = _sincos(x, scale=0.5)
    torch.testing.assert_close(s.double(), 0.5 * torch.sin(x.double()), rtol=0, atol=1e-7)
    torch.testing.assert_close(c.double(), 0.5 * torch.cos(x.double()), rtol=0, atol=1e-7)
    s, c = _sincos(torch.tensor([0.5, float("nan"), float("inf")]))
    assert torch.isnan(s[1:]).all() and torch.isnan(c[1:]).all()
    assert abs(s[0].item() - math.sin(0.5)) < 1e-7


def _reference(kernel, x, matrix, eps):
    return prepared_feature_map(kernel, l2_normalize(x, eps), matrix)


def _matrix(H, D, K, gen, sigma_scale=1.0):
    w = sample_random_matrix("orthogonal", H, D, K, gen)
    sigma = sigma_scale * (0.5 + torch.rand(H, K, generator=gen))
    return projection_matrix(sigma, w)


CASES = {
    # name: (B, H, T, K, D) and how x is laid out
    "decoding step, split_heads view": (8, 4, 1, 16, 64),
    "several rows": (3, 2, 7, 16, 32),
    "D not a multiple of 32": (2, 3, 5, 12, 40),
    "D not a multiple of 8": (2, 2, 3, 16, 45),
    "K not a multiple of 8": (2, 2, 3, 13, 32),
    "one row": (1, 1, 1, 8, 8),
}


@pytest.mark.parametrize("kernel", ["gaussian", "arccos"])
@pytest.mark.parametrize("case", list(CASES))
def test_feature_map_equals_the_pytorch_ops(kernel, case):
    B, H, T, K, D = CASES[case]
    gen = torch.Generator().manual_seed(0)
    # [T, B, H * K] as a linear layer returns it, viewed as [B, H, T, K] (strided, like split_heads)
    x = torch.randn(T, B, H * K, generator=gen).view(T, B, H, K).permute(1, 2, 0, 3)
    matrix = _matrix(H, D, K, gen)
    got = kernels.feature_map(kernel, x, matrix, eps=1e-6)
    ref = _reference(kernel, x, matrix, 1e-6)
    assert got.shape == ref.shape and got.is_contiguous()
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-6)


def test_feature_map_with_large_arguments_and_zero_rows():
    """A large sigma sends projections past the reduced range (the library's sin/cos then); a zero
    row normalises to zero (sin 0, cos D^-1/2) as in the reference."""
    gen = torch.Generator().manual_seed(1)
    B, H, T, K, D = 2, 2, 3, 16, 32
    x = torch.randn(B, H, T, K, generator=gen)
    x[1, 0, 2] = 0.0
    matrix = _matrix(H, D, K, gen, sigma_scale=5000.0)
    proj = torch.einsum("bhtk,hkd->bhtd", l2_normalize(x), matrix)
    assert proj.abs().max() > 8192
    got = kernels.feature_map("gaussian", x, matrix, eps=1e-6)
    # fp32 projections of magnitude 1e4 differ by their rounding (1e-3) between the two orders of
    # summation, so compare against the kernel's own projection rounding: the features of the
    # reference's projections, at a tolerance of that rounding
    torch.testing.assert_close(got, _reference("gaussian", x, matrix, 1e-6), rtol=0, atol=5e-3 / math.sqrt(D))
    assert torch.equal(got[1, 0, 2, :D], torch.zeros(D))
    torch.testing.assert_close(got[1, 0, 2, D:], torch.full((D,), D ** -0.5))


def test_feature_map_threads_agree():
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(4, 8, 33, 64, generator=gen)
    matrix = _matrix(8, 64, 64, gen)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = kernels.feature_map("gaussian", x, matrix, eps=1e-6)
        torch.set_num_threads(2)
        two = kernels.feature_map("gaussian", x, matrix, eps=1e-6)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)  # each row is computed by one thread, whatever the split
    torch.testing.assert_close(one, _reference("gaussian", x, matrix, 1e-6), rtol=0, atol=1e-6)


def test_feature_map_refuses_bad_arguments_by_name():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, 3, 1, 8, generator=gen)
    matrix = _matrix(3, 16, 8, gen)
    with pytest.raises(ValueError, match="x must be a float32 CPU tensor"):
        kernels.feature_map("gaussian", x.double(), matrix, 1e-6)
    with pytest.raises(ValueError, match="matrix must be a float32 CPU tensor"):
        kernels.feature_map("gaussian", x, matrix.double(), 1e-6)
    with pytest.raises(ValueError, match="does not match the matrix"):
        kernels.feature_map("gaussian", x, _matrix(2, 16, 8, gen), 1e-6)
    with pytest.raises(ValueError, match="does not match the matrix"):
        kernels.feature_map("gaussian", x[..., :7], matrix, 1e-6)
    with pytest.raises(ValueError, match="unknown kernel"):
        kernels.feature_map("laplace", x, matrix, 1e-6)
