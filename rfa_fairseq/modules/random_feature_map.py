"""RandomFeatureMap: the learned per-head scale sigma plus the random matrix, as an nn.Module.

The random matrix ``[H, D, K]`` is a buffer, so it is saved in checkpoints and a loaded model
decodes exactly as it was validated. In training mode it is redrawn whenever the training step
changes: the draw is seeded from ``(torch.initial_seed(), num_updates, module_id)``. fairseq's
trainer reseeds torch with ``--seed + num_updates`` at every update on every rank, so draws
follow fairseq's seed, are identical on all distributed ranks, and repeat exactly on resume.
Draws happen on the CPU with a private generator, so they do not disturb (and are not disturbed
by) dropout's random stream, whatever the device.
"""
from typing import Optional

import torch
from torch import Tensor, nn

from .. import kernels
from ..ops import feature_map, feature_size, l2_normalize, prepared_feature_map, projection_matrix, sample_random_matrix
from ..ops.feature_maps import NORM_EPS


def _identity(t: Tensor):
    """What changes when ``t`` does: storage, place, version counter (None for an inference
    tensor, which has no version counter: then nothing is reused)."""
    if t.is_inference():
        return None
    return (t.data_ptr(), t.device, t._version)


class RandomFeatureMap(nn.Module):
    """phi(x) for queries and keys of one attention module; input ``[B, H, T, K]``.

    Queries and keys are L2-normalised, scaled element-wise by ``sigma`` (``[H, K]``, learned)
    and projected on the random rows; output ``[B, H, T, F]`` in fp32.

    ``decode_kernel`` (``--rfa-decode-kernel``): without autograd (decoding, validation) the map
    of fp32 CPU inputs runs as one compiled call (``rfa_fairseq.kernels.feature_map``) under
    ``"auto"`` (if the kernel builds) and ``"cpp"``; ``"torch"`` keeps the PyTorch ops.
    """

    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        num_features: int,
        kernel: str = "gaussian",
        random_matrix: str = "orthogonal",
        init_sigma: float = 1.0,
        module_id: int = 0,
        decode_kernel: str = "auto",
    ):
        super().__init__()
        self.decode_kernel = kernels.check_choice(decode_kernel)
        self.num_heads, self.head_dim, self.num_features = num_heads, head_dim, num_features
        self.kernel, self.random_matrix_kind, self.module_id = kernel, random_matrix, module_id
        self.output_dim = feature_size(kernel, num_features)
        self.sigma = nn.Parameter(torch.full((num_heads, head_dim), float(init_sigma)))
        self.register_buffer("random_matrix", torch.zeros(num_heads, num_features, head_dim))
        self.num_updates = 0
        self._drawn_for = None
        self._prepared = None  # (key, projection_matrix) for use without autograd
        self.redraw()

    def set_num_updates(self, num_updates: int):
        """Called by fairseq's trainer (through the model) after every update."""
        self.num_updates = num_updates

    def draw_seed(self) -> int:
        key = (torch.initial_seed(), self.num_updates, self.module_id)
        return hash(key) % (2**63)

    @torch.no_grad()
    def redraw(self, seed: int = None):
        """Draw a new random matrix (from ``seed``, or from the current step's seed)."""
        if seed is None:
            seed = self.draw_seed()
        gen = torch.Generator().manual_seed(seed)
        w = sample_random_matrix(self.random_matrix_kind, self.num_heads, self.num_features, self.head_dim, gen)
        self.random_matrix.copy_(w)
        self._drawn_for = seed

    def refresh(self):
        """In training, draw the matrix of the current step if it is not drawn yet."""
        if self.training:
            seed = self.draw_seed()
            if seed != self._drawn_for:
                self.redraw(seed)

    def matrix_for_recompute(self) -> Tensor:
        """A copy of this step's random matrix (drawn now if it is not yet), for a caller that
        computes the features again in the backward pass: the buffer itself is redrawn in place
        at the next training step, which must not change a backward pass still to come."""
        self.refresh()
        return self.random_matrix.clone()

    def forward(self, x: Tensor, random_matrix: Optional[Tensor] = None) -> Tensor:
        """phi(x). ``random_matrix``: a :meth:`matrix_for_recompute` copy to use instead of the
        buffer (then there is no redraw check: the copy is of the current draw)."""
        if random_matrix is None:
            self.refresh()
        x = x.double() if x.dtype == torch.float64 else x.float()
        if torch.is_grad_enabled() or random_matrix is not None:
            return feature_map(self.kernel, l2_normalize(x), self.sigma,
                               self.random_matrix if random_matrix is None else random_matrix)
        if kernels.usable(self.decode_kernel, x, x):
            return kernels.feature_map(self.kernel, x, self.prepared_matrix(x.dtype), NORM_EPS)
        return prepared_feature_map(self.kernel, l2_normalize(x), self.prepared_matrix(x.dtype))

    def prepared_matrix(self, dtype: torch.dtype) -> Tensor:
        """``projection_matrix(sigma, random_matrix)`` in ``dtype``, made again only when sigma
        or the random matrix changed (a new tensor, an in-place update, a redraw): decoding
        steps reuse one. Without autograd only; under autograd sigma's gradient needs the product
        recorded, so :meth:`forward` uses the reference :func:`feature_map` there."""
        key = (dtype, torch.is_inference_mode_enabled(), _identity(self.sigma), _identity(self.random_matrix))
        if self._prepared is not None and self._prepared[0] == key and None not in key:
            return self._prepared[1]
        with torch.no_grad():
            matrix = projection_matrix(self.sigma.to(dtype), self.random_matrix.to(dtype))
        self._prepared = (key, matrix)
        return matrix

    def extra_repr(self) -> str:
        return (
            f"heads={self.num_heads}, head_dim={self.head_dim}, features={self.num_features}, "
            f"kernel={self.kernel}, random_matrix={self.random_matrix_kind}, decode_kernel={self.decode_kernel}"
        )
