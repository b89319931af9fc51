"""The math of RFA in pure torch (no fairseq imports): feature maps and attention ops. Layout: ``[B, H, T, F]`` for
feature-mapped queries/keys, ``[B, H, T, K]`` for values, and ``[B, H, F, K + 1]`` for a state, causal or cross:
``S = sum phi(k) v^T`` and ``z = sum phi(k)`` packed as ``[S | z]`` (``z`` the last column)."""
from .causal_rfa import (GATE_FORMS, chunk_causal_rfa, fla_causal_rfa, fla_installed,  # noqa: F401
                         fla_refuses_gated_backward, naive_causal_rfa, recurrent_causal_rfa, recurrent_causal_rfa_step)
from .cross_rfa import (cross_rfa_apply, cross_rfa_quadratic, cross_rfa_state, cross_rfa_weights,  # noqa: F401
                        naive_cross_rfa, quadratic_is_cheaper)
from .denominator import DEFAULT_EPS, guarded_ratio  # noqa: F401
from .lara import lara, naive_lara, randomized_attention, segment_landmarks, softmax_attention  # noqa: F401
from .feature_maps import (FEATURE_MAPS, KERNELS, POSITIVE_KERNELS, RANDOM_MATRICES, feature_map,  # noqa: F401
                           feature_size, gaussian_step_features, gaussian_step_weights, l2_normalize,
                           sample_random_matrix)
