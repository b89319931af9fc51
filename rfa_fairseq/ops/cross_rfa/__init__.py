from .naive import naive_cross_rfa  # noqa: F401
from .state import (cross_rfa_apply, cross_rfa_quadratic, cross_rfa_state, cross_rfa_weights,  # noqa: F401
                    quadratic_is_cheaper)
