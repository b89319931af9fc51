"""Random matrices and feature maps (pure torch): inputs ``x [B, H, T, K]``, a random matrix ``[H, D, K]`` (``D``
random features per head), a per-head scale ``sigma [H, K]``; feature maps return ``[B, H, T, F]`` in fp32 (fp64
for fp64 inputs). A new kernel is one function and one entry in :data:`FEATURE_MAPS`."""
import math
from types import MappingProxyType
from typing import Callable, NamedTuple, Optional, Tuple

import torch
from torch import Tensor

from .denominator import as_dtype, compute_dtype

RANDOM_MATRICES = ("gaussian", "orthogonal")


def sample_orthogonal_matrix(num_heads: int, num_features: int, head_dim: int,
                             generator: Optional[torch.Generator] = None) -> Tensor:
    """Orthogonal random features (Yu et al., 2016): ``[H, D, K]``, blocks of ``K`` orthogonal unit rows (QR of a
    Gaussian matrix; the last block truncated), each rescaled by an independent chi(K) norm: marginally N(0, I)."""
    num_blocks = -(-num_features // head_dim)
    q, r = torch.linalg.qr(torch.randn(num_heads, num_blocks, head_dim, head_dim, generator=generator))
    q = q * torch.sign(torch.diagonal(r, dim1=-2, dim2=-1)).unsqueeze(-2)  # QR's sign fixed: a Haar-distributed draw
    rows = q.transpose(-1, -2).reshape(num_heads, num_blocks * head_dim, head_dim)[:, :num_features]
    return rows * torch.randn(num_heads, num_features, head_dim, generator=generator).norm(dim=-1).unsqueeze(-1)


def sample_random_matrix(kind: str, num_heads: int, num_features: int, head_dim: int,
                         generator: Optional[torch.Generator] = None) -> Tensor:
    """``[H, D, K]`` in fp32 on the generator's device: i.i.d. N(0, 1) rows, or :func:`sample_orthogonal_matrix`'s."""
    if kind == "gaussian":
        return torch.randn(num_heads, num_features, head_dim, generator=generator)
    if kind == "orthogonal":
        return sample_orthogonal_matrix(num_heads, num_features, head_dim, generator)
    raise ValueError(f"unknown random matrix kind {kind!r}; expected one of {RANDOM_MATRICES}")


def l2_normalize(x: Tensor, eps: float = 1e-6) -> Tensor:
    return x / (x.norm(dim=-1, keepdim=True) + eps)


def project(x: Tensor, random_matrix: Tensor) -> Tensor:
    """``w_i . x`` for every random row: ``[..., H, T, K]`` x ``[H, D, K]`` -> ``[..., H, T, D]``, one bmm over heads
    (the matrix is never expanded per batch row, which would copy it for every beam-search hypothesis)."""
    *lead, H, T, K = x.shape
    rows = x.movedim(-3, 0).reshape(H, -1, K)
    return torch.bmm(rows, random_matrix.transpose(1, 2)).view(H, *lead, T, -1).movedim(0, -3)


def random_fourier_features(x: Tensor, random_matrix: Tensor) -> Tensor:
    """phi(x) = D^-1/2 [sin(w.x), cos(w.x)]: E[phi(x).phi(y)] = exp(-|x - y|^2 / 2) for rows ``w`` ~ N(0, I)
    (``x`` already scaled by sigma)."""
    proj = project(x, random_matrix)
    return torch.cat([torch.sin(proj), torch.cos(proj)], dim=-1) / math.sqrt(proj.shape[-1])


def arccos_features(x: Tensor, random_matrix: Tensor) -> Tensor:
    """phi(x) = D^-1/2 max(0, w.x): the order-1 arc-cosine kernel (non-negative features)."""
    proj = project(x, random_matrix)
    return torch.relu(proj) / math.sqrt(proj.shape[-1])


def favor_features(x: Tensor, random_matrix: Tensor) -> Tensor:
    """Performer's FAVOR+, phi(x) = D^-1/2 exp(w.x - |x|^2 / 2): E[phi(x).phi(y)] = exp(x.y) for rows ``w`` ~ N(0, I).
    Unlike Performer, no running maximum is subtracted: ``w.x - |x|^2 / 2 <= |w|^2 / 2`` (about K / 2) is far inside
    fp32's range, and a maximum over the keys would differ between a sequence and its prefixes, breaking decoding."""
    proj = project(x, random_matrix)
    return torch.exp(proj - 0.5 * x.pow(2).sum(-1, keepdim=True)) / math.sqrt(proj.shape[-1])


def elu_features(x: Tensor, random_matrix: Tensor) -> Tensor:
    """phi(x) = elu(x) + 1 (Katharopoulos et al., 2020): no random matrix, ``K`` positive values, x not normalised."""
    return torch.nn.functional.elu(x) + 1.0


class FeatureMapKind(NamedTuple):
    fn: Callable[[Tensor, Tensor], Tensor]  # (scaled inputs [B, H, T, K], random matrix [H, D, K]) -> phi
    size: Callable[[int, int], int]  # (random rows D, head dim K) -> F, the length of phi
    positive: bool  # phi is never negative, so phi(q) . z > 0 (until it underflows)
    normalize: bool = True  # L2-normalise the inputs before sigma scales them


FEATURE_MAPS = MappingProxyType({
    "gaussian": FeatureMapKind(random_fourier_features, lambda d, k: 2 * d, positive=False),
    "arccos": FeatureMapKind(arccos_features, lambda d, k: d, positive=True),
    "favor": FeatureMapKind(favor_features, lambda d, k: d, positive=True),
    "elu": FeatureMapKind(elu_features, lambda d, k: k, positive=True, normalize=False),
})
KERNELS = tuple(FEATURE_MAPS)
POSITIVE_KERNELS = tuple(name for name, kind in FEATURE_MAPS.items() if kind.positive)


def _kind(kernel: str) -> FeatureMapKind:
    if kernel not in FEATURE_MAPS:
        raise ValueError(f"unknown kernel {kernel!r}; expected one of {KERNELS}")
    return FEATURE_MAPS[kernel]


def feature_size(kernel: str, num_features: int, head_dim: int) -> int:
    """Length ``F`` of phi(x) for ``num_features`` random rows and heads of ``head_dim``."""
    return _kind(kernel).size(num_features, head_dim)


def feature_map(kernel: str, x: Tensor, sigma: Tensor, random_matrix: Tensor) -> Tensor:
    """phi(sigma * x / |x|) by ``kernel`` (``elu``: not normalised) for ``x [B, H, T, K]``, ``sigma [H, K]``:
    ``[B, H, T, F]`` in fp32 (fp64 for fp64). The learned scale goes on the inputs, not the matrix: ``1 / D`` of the
    projection's cost, and no per-call copy of the matrix."""
    kind = _kind(kernel)
    x = x.to(compute_dtype(x))
    if kind.normalize:
        x = l2_normalize(x)
    return kind.fn(x * sigma.to(x.dtype)[:, None, :], random_matrix.to(x.dtype))


def gaussian_step_weights(random_matrix: Tensor, sigma: Tensor) -> Tuple[Tensor, Tensor]:
    """For :func:`gaussian_step_features`, in ``random_matrix``'s dtype: ``projection [H, K, 2 D]``, the matrix with
    sigma folded in, twice, and ``phase [2 D]``, ``[0, pi/2]``: one bmm and one sine make ``[sin | cos]``."""
    w = (random_matrix * sigma.to(random_matrix.dtype).unsqueeze(1)).transpose(1, 2)  # [H, K, D]
    D = w.size(-1)
    return torch.cat([w, w], dim=-1).contiguous(), torch.cat([w.new_zeros(D), w.new_full((D,), math.pi / 2)])


def gaussian_step_features(x: Tensor, projection: Tensor, phase: Tensor) -> Tensor:
    """``feature_map("gaussian", x, sigma, random_matrix)`` for ``x [..., H, T, K]`` from :func:`gaussian_step_weights`:
    ``[..., H, T, 2 D]`` in the dtype of ``projection``, in a third fewer operators (what a decoding step's time is)."""
    *lead, H, T, K = x.shape
    rows = l2_normalize(as_dtype(x, projection.dtype)).movedim(-3, 0).reshape(H, -1, K)
    # bmm then add_, not baddbmm: baddbmm copies the broadcast phases into its output first
    phi = torch.bmm(rows, projection).add_(phase).sin_().mul_((projection.size(-1) // 2) ** -0.5)  # D^-1/2
    return phi.view(H, *lead, T, -1).movedim(0, -3)
