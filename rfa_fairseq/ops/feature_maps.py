"""Random matrices and random feature maps (pure torch).

Layouts: inputs ``x`` are ``[B, H, T, K]`` (batch, heads, time, head dim ``K``); a random
matrix is ``[H, D, K]`` (``D`` random features per head); a per-head scale ``sigma`` is
``[H, K]``. Feature maps return ``[B, H, T, F]`` with ``F = 2D`` (Gaussian) or ``F = D``
(arc-cosine). Features are computed in fp32 (fp64 for fp64 inputs).
"""
import math
from typing import Optional

import torch
from torch import Tensor

KERNELS = ("gaussian", "arccos")
RANDOM_MATRICES = ("gaussian", "orthogonal")


def feature_size(kernel: str, num_features: int) -> int:
    """Length ``F`` of phi(x) for ``num_features`` random projections."""
    if kernel == "gaussian":
        return 2 * num_features
    if kernel == "arccos":
        return num_features
    raise ValueError(f"unknown kernel {kernel!r}; expected one of {KERNELS}")


def sample_gaussian_matrix(
    num_heads: int, num_features: int, head_dim: int, generator: Optional[torch.Generator] = None
) -> Tensor:
    """i.i.d. N(0, 1) rows: ``[H, D, K]`` in fp32 on the generator's device (CPU by default)."""
    return torch.randn(num_heads, num_features, head_dim, generator=generator)


def sample_orthogonal_matrix(
    num_heads: int, num_features: int, head_dim: int, generator: Optional[torch.Generator] = None
) -> Tensor:
    """Orthogonal random features (Yu et al., 2016): ``[H, D, K]``.

    Rows come in blocks of ``K`` mutually orthogonal unit vectors (QR of a Gaussian matrix),
    each row rescaled by an independent chi(K) norm so that every row is marginally N(0, I).
    ``D`` need not be a multiple of ``K``: the last block is truncated.
    """
    num_blocks = -(-num_features // head_dim)
    gauss = torch.randn(num_heads, num_blocks, head_dim, head_dim, generator=generator)
    q, r = torch.linalg.qr(gauss)
    # Fix the sign ambiguity of QR so the draw is Haar-distributed.
    q = q * torch.sign(torch.diagonal(r, dim1=-2, dim2=-1)).unsqueeze(-2)
    rows = q.transpose(-1, -2).reshape(num_heads, num_blocks * head_dim, head_dim)[:, :num_features]
    norms = torch.randn(num_heads, num_features, head_dim, generator=generator).norm(dim=-1)
    return rows * norms.unsqueeze(-1)


def sample_random_matrix(
    kind: str, num_heads: int, num_features: int, head_dim: int, generator: Optional[torch.Generator] = None
) -> Tensor:
    if kind == "gaussian":
        return sample_gaussian_matrix(num_heads, num_features, head_dim, generator)
    if kind == "orthogonal":
        return sample_orthogonal_matrix(num_heads, num_features, head_dim, generator)
    raise ValueError(f"unknown random matrix kind {kind!r}; expected one of {RANDOM_MATRICES}")


NORM_EPS = 1e-6


def l2_normalize(x: Tensor, eps: float = NORM_EPS) -> Tensor:
    """x / (|x| + eps) over the last dimension."""
    return x / (x.norm(dim=-1, keepdim=True) + eps)


def _project(x: Tensor, sigma: Tensor, random_matrix: Tensor) -> Tensor:
    """(sigma * x) . omega_i for every row, ``[B, H, T, D]``.

    The scale goes on whichever side is smaller: on the ``[H, D, K]`` matrix when there are
    more input rows per head than random features (training), else on the inputs (a decoding
    step has a handful of rows; scaling the matrix would write a new ``[H, D, K]`` tensor per
    call). Both are the same product up to rounding. einsum batches over heads without
    expanding the matrix per batch row."""
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    x, sigma, random_matrix = x.to(acc), sigma.to(acc), random_matrix.to(acc)
    rows = x.shape[0] * x.shape[2]
    if rows >= random_matrix.shape[1]:
        return torch.einsum("bhtk,hdk->bhtd", x, random_matrix * sigma.unsqueeze(1))
    return torch.einsum("bhtk,hdk->bhtd", x * sigma[:, None, :], random_matrix)


def projection_matrix(sigma: Tensor, random_matrix: Tensor) -> Tensor:
    """The random rows with the scale folded in, laid out for one batched matmul: ``[H, K, D]``
    contiguous, since ``(sigma * x) . omega_i == x . (sigma * omega_i)``. A module that does not
    train sigma (decoding) makes this once and reuses it: see :func:`prepared_feature_map`."""
    return (random_matrix * sigma.unsqueeze(1)).transpose(1, 2).contiguous()


def project_prepared(x: Tensor, matrix: Tensor) -> Tensor:
    """``[B, H, T, K]`` inputs on a :func:`projection_matrix` ``[H, K, D]`` -> ``[B, H, T, D]``.

    One bmm over heads on ``[H, B * T, K]`` rows with a contiguous right operand; for the few
    rows of a decoding step this is about twice as fast on a cold cache as the einsum of
    :func:`_project`, which hands the matmul a transposed matrix."""
    B, H, T, K = x.shape
    rows = x.to(matrix.dtype).transpose(0, 1).reshape(H, B * T, K)
    return torch.bmm(rows, matrix).view(H, B, T, -1).transpose(0, 1)


def features_of_projection(kernel: str, proj: Tensor) -> Tensor:
    """phi from the projections ``w_i . x`` ``[..., D]``: the nonlinearity and the D^-1/2 scale."""
    scale = 1.0 / math.sqrt(proj.shape[-1])
    if kernel == "gaussian":
        return torch.cat([torch.sin(proj), torch.cos(proj)], dim=-1) * scale
    if kernel == "arccos":
        return torch.relu(proj) * scale
    raise ValueError(f"unknown kernel {kernel!r}; expected one of {KERNELS}")


def random_fourier_features(x: Tensor, sigma: Tensor, random_matrix: Tensor) -> Tensor:
    """phi(x) = D^-1/2 [sin(w.x), cos(w.x)]; E[phi(x).phi(y)] = exp(-|sigma*(x-y)|^2 / 2)."""
    return features_of_projection("gaussian", _project(x, sigma, random_matrix))


def arccos_features(x: Tensor, sigma: Tensor, random_matrix: Tensor) -> Tensor:
    """phi(x) = D^-1/2 max(0, w.x): the order-1 arc-cosine kernel (non-negative features)."""
    return features_of_projection("arccos", _project(x, sigma, random_matrix))


def feature_map(kernel: str, x: Tensor, sigma: Tensor, random_matrix: Tensor) -> Tensor:
    if kernel == "gaussian":
        return random_fourier_features(x, sigma, random_matrix)
    if kernel == "arccos":
        return arccos_features(x, sigma, random_matrix)
    raise ValueError(f"unknown kernel {kernel!r}; expected one of {KERNELS}")


def prepared_feature_map(kernel: str, x: Tensor, matrix: Tensor) -> Tensor:
    """:func:`feature_map` with the scale already folded into ``matrix = projection_matrix(sigma,
    random_matrix)``: the same features up to rounding, for callers that keep ``matrix``."""
    if kernel not in KERNELS:
        raise ValueError(f"unknown kernel {kernel!r}; expected one of {KERNELS}")
    return features_of_projection(kernel, project_prepared(x, matrix))
