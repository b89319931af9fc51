from .naive import naive_cross_rfa
from .quadratic import cross_rfa_quadratic, quadratic_is_cheaper
from .state import cross_rfa_apply, cross_rfa_state, cross_rfa_weights, key_norm_weights

__all__ = [
    "naive_cross_rfa", "cross_rfa_quadratic", "quadratic_is_cheaper", "cross_rfa_apply", "cross_rfa_state",
    "cross_rfa_weights", "key_norm_weights",
]
