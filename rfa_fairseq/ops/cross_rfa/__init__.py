from .naive import naive_cross_rfa
from .state import cross_rfa_apply, cross_rfa_quadratic, cross_rfa_state, cross_rfa_weights, quadratic_is_cheaper

__all__ = ["naive_cross_rfa", "cross_rfa_apply", "cross_rfa_quadratic", "cross_rfa_state", "cross_rfa_weights",
           "quadratic_is_cheaper"]
