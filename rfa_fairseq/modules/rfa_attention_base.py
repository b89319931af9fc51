"""What causal and cross RFA attention share: projections, their initialisation, the incremental-state accessors."""
from typing import Dict, Optional

from fairseq.incremental_decoding_utils import with_incremental_state
from torch import Tensor, nn

from ..ops.denominator import DEFAULT_EPS
from ..validation import divisible_heads
from .random_feature_map import RandomFeatureMap

IncrementalState = Dict[str, Dict[str, Optional[Tensor]]]


def init_projection(linear: nn.Linear, gain: float = 1.0):
    nn.init.xavier_uniform_(linear.weight, gain=gain)
    if linear.bias is not None:
        nn.init.zeros_(linear.bias)


def add_projections(module: nn.Module, embed_dim: int, kdim: int, bias: bool):
    """``module``'s ``q_proj``, ``k_proj``, ``v_proj`` and ``out_proj``, initialised as MultiheadAttention's."""
    module.q_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
    module.k_proj = nn.Linear(kdim, embed_dim, bias=bias)
    module.v_proj = nn.Linear(kdim, embed_dim, bias=bias)
    module.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
    for proj in (module.q_proj, module.k_proj, module.v_proj):
        init_projection(proj, gain=2**-0.5)
    init_projection(module.out_proj)


@with_incremental_state
class RFAttentionBase(nn.Module):
    """Query, key, value and output projections (:func:`add_projections`) around a :class:`RandomFeatureMap`.
    Subclasses set ``STATE_KEY``, the name of their entry in fairseq's incremental state."""

    def __init__(self, embed_dim: int, num_heads: int, feature_map: RandomFeatureMap, kdim: Optional[int] = None,
                 bias: bool = True, eps: float = DEFAULT_EPS, recompute: bool = False):
        super().__init__()
        divisible_heads(embed_dim, num_heads)
        self.embed_dim, self.num_heads, self.head_dim = embed_dim, num_heads, embed_dim // num_heads
        self.eps, self.recompute = eps, recompute
        add_projections(self, embed_dim, kdim or embed_dim, bias)
        self.feature_map = feature_map

    # fairseq's decoder layer and generator use these names on MultiheadAttention.
    def _get_input_buffer(self, incremental_state: Optional[IncrementalState]) -> Dict[str, Optional[Tensor]]:
        return self.get_incremental_state(incremental_state, self.STATE_KEY) or {}

    def _set_input_buffer(self, incremental_state: IncrementalState, buffer: Dict[str, Optional[Tensor]]):
        return self.set_incremental_state(incremental_state, self.STATE_KEY, buffer)
