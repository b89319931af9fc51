"""The math of RFA in pure torch (no fairseq imports): feature maps and attention ops.

Layout throughout: ``[B, H, T, F]`` for feature-mapped queries/keys, ``[B, H, T, K]`` for values.
"""
from .causal_rfa import (
    causal_keys_step,
    chunk_causal_rfa,
    gather_keys,
    keys_capacity,
    keys_to_summary,
    naive_causal_rfa,
    pack_state,
    recurrent_causal_rfa_step,
    recurrent_causal_rfa_step_packed,
    unpack_state,
)
from .cross_rfa import (
    cross_rfa_apply,
    cross_rfa_apply_keys,
    cross_rfa_keys,
    cross_rfa_state,
    cross_rfa_weights,
    keys_form_is_smaller,
    naive_cross_rfa,
)
from .denominator import DEFAULT_EPS, guarded_ratio
from .feature_maps import (
    KERNELS,
    RANDOM_MATRICES,
    feature_map,
    feature_size,
    l2_normalize,
    prepared_feature_map,
    projection_matrix,
    sample_random_matrix,
)

__all__ = [
    "chunk_causal_rfa", "naive_causal_rfa", "recurrent_causal_rfa_step", "recurrent_causal_rfa_step_packed",
    "pack_state", "unpack_state", "causal_keys_step", "gather_keys", "keys_capacity", "keys_to_summary",
    "cross_rfa_apply", "cross_rfa_state", "cross_rfa_weights", "naive_cross_rfa",
    "cross_rfa_keys", "cross_rfa_apply_keys", "keys_form_is_smaller",
    "DEFAULT_EPS", "guarded_ratio",
    "KERNELS", "RANDOM_MATRICES", "feature_map", "feature_size", "l2_normalize", "sample_random_matrix",
    "prepared_feature_map", "projection_matrix",
]
