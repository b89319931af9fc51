"""fairseq modules: RFA attention layers with fairseq's incremental-state protocol."""
from .causal_rfa_attention import CausalRFAttention
from .cross_rfa_attention import CrossRFAttention
from .random_feature_map import RandomFeatureMap

__all__ = ["CausalRFAttention", "CrossRFAttention", "RandomFeatureMap"]
