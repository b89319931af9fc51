"""RandomFeatureMap: the learned per-head scale sigma plus the random matrix, as an nn.Module.

The random matrix ``[H, D, K]`` is a buffer, saved in checkpoints, so a loaded model decodes exactly as it was
validated. In training it is redrawn whenever the step changes, unless ``fixed``. Draws are seeded from
``(torch.initial_seed(), num_updates, module_id)``; fairseq reseeds torch with ``--seed + num_updates`` at every update
on every rank, so draws follow fairseq's seed, agree across ranks and repeat on resume. A private CPU generator keeps
them apart from dropout's random stream."""
from typing import Optional

import torch
from torch import Tensor, nn

from ..ops import feature_map, feature_size, gaussian_step_features, gaussian_step_weights, sample_random_matrix
from ..ops.denominator import compute_dtype

_M64 = 2**64 - 1


def draw_seed(initial_seed: int, num_updates: int, module_id: int) -> int:
    """A 63-bit seed from the three integers by arithmetic alone (splitmix64's mixing step on each in turn), so a
    resumed run draws the same matrices whatever the interpreter's ``hash``."""
    x = 0
    for part in (initial_seed, num_updates, module_id):
        x = ((x ^ (part & _M64)) + 0x9E3779B97F4A7C15) & _M64
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
        x ^= x >> 31
    return x >> 1


def feature_map_id(layer: int, cross: bool) -> int:
    """The ``module_id`` of a decoder layer's feature map: its draws' seed (two per layer: causal, cross)."""
    return 2 * layer + int(cross)


class RandomFeatureMap(nn.Module):
    """phi(x) for queries and keys ``[B, H, T, K]`` of one attention module: L2-normalised, scaled element-wise by
    the learned ``sigma [H, K]``, mapped by ``kernel`` (``ops.feature_maps``) to ``[B, H, T, F]`` in fp32."""

    def __init__(self, num_heads: int, head_dim: int, num_features: int, kernel: str = "gaussian",
                 random_matrix: str = "orthogonal", init_sigma: float = 1.0, module_id: int = 0, fixed: bool = False):
        super().__init__()
        self.num_heads, self.head_dim, self.num_features = num_heads, head_dim, num_features
        self.kernel, self.random_matrix_kind, self.module_id, self.fixed = kernel, random_matrix, module_id, fixed
        self.output_dim = feature_size(kernel, num_features, head_dim)
        self.sigma = nn.Parameter(torch.full((num_heads, head_dim), float(init_sigma)))
        self.register_buffer("random_matrix", torch.zeros(num_heads, num_features, head_dim))
        self.num_updates, self._drawn_for = 0, None
        self._inference_weights = (None, None)  # (what they were made from, the weights)
        self.redraw()

    def set_num_updates(self, num_updates: int):
        """Called by fairseq's trainer (through the model) after every update."""
        self.num_updates = num_updates

    def draw_seed(self) -> int:
        return draw_seed(torch.initial_seed(), self.num_updates, self.module_id)

    @torch.no_grad()
    def redraw(self, seed: int = None):
        """Draw a new random matrix (from ``seed``, or from the current step's seed)."""
        seed = self.draw_seed() if seed is None else seed
        gen = torch.Generator().manual_seed(seed)
        self.random_matrix.copy_(sample_random_matrix(self.random_matrix_kind, *self.random_matrix.shape, gen))
        self._drawn_for = seed

    def matrix_for_recompute(self) -> Tensor:
        """A copy of this step's random matrix (drawn now if it is not yet) for a backward pass that recomputes the
        features: the buffer itself is redrawn in place at the next training step."""
        return self.matrix().clone()

    def matrix(self, random_matrix: Optional[Tensor] = None) -> Tensor:
        """``random_matrix`` (a :meth:`matrix_for_recompute` copy), else the buffer, in training drawn for the current
        step if it is not yet (never when ``fixed``)."""
        if random_matrix is not None:
            return random_matrix
        if self.training and not self.fixed and (seed := self.draw_seed()) != self._drawn_for:
            self.redraw(seed)
        return self.random_matrix

    def forward(self, x: Tensor, random_matrix: Optional[Tensor] = None) -> Tensor:
        """phi(x); ``random_matrix``: a :meth:`matrix_for_recompute` copy to use instead of the buffer (no redraw)."""
        if random_matrix is None and self.kernel == "gaussian" and not (self.training or torch.is_grad_enabled()):
            return gaussian_step_features(x, *self.inference_weights(compute_dtype(x)))
        return feature_map(self.kernel, x, self.sigma, self.matrix(random_matrix))

    def inference_weights(self, dtype: torch.dtype):
        """``ops.gaussian_step_weights`` of sigma and the matrix in ``dtype``, kept while neither changes."""
        if torch.compiler.is_compiling():  # a step under torch.compile computes them in its graph
            return gaussian_step_weights(self.random_matrix.to(dtype), self.sigma.to(dtype))
        made_from = (dtype, *((t.data_ptr(), t._version) for t in (self.sigma, self.random_matrix)))
        if self._inference_weights[0] != made_from:
            self._inference_weights = made_from, gaussian_step_weights(self.random_matrix.to(dtype), self.sigma.to(dtype))
        return self._inference_weights[1]

    def extra_repr(self) -> str:
        return (f"heads={self.num_heads}, head_dim={self.head_dim}, features={self.num_features}, "
                f"kernel={self.kernel}, random_matrix={self.random_matrix_kind}" + (", fixed" if self.fixed else ""))
