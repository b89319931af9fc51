"""Checks of argument and flag values, one helper per check, for every layer of the package.

Pure Python (no torch, no fairseq), so that a check and its message are written once. Each helper takes the name to
print (a flag such as ``--rfa-chunk-size`` or an argument such as ``embed_dim``) and the value, raises ValueError naming
it when the value is bad, and returns the value otherwise (a bool is not an int; NaN and infinity are not finite;
``one_of`` returns ``str(value)``, for ChoiceEnum members)."""
import math
from functools import partial


def flag(name: str) -> str:
    """The command-line flag of a config field: ``rfa_chunk_size`` -> ``--rfa-chunk-size``."""
    return "--" + name.replace("_", "-")


def _number(name: str, value, types, ok, what: str):
    """``value`` if of ``types`` (not a bool) and ``ok``, else ValueError: ``name`` must be ``what``."""
    if isinstance(value, bool) or not isinstance(value, types) or not ok(value):
        raise ValueError(f"{name} must be {what}, got {value!r}")
    return value


positive_int = partial(_number, types=int, ok=lambda v: v >= 1, what="a positive integer")
non_negative_int = partial(_number, types=int, ok=lambda v: v >= 0, what="0 or a positive integer")
positive_finite = partial(_number, types=(int, float), ok=lambda v: math.isfinite(v) and v > 0,
                          what="a positive finite number")
finite = partial(_number, types=(int, float), ok=math.isfinite, what="a finite number")
non_negative_finite = partial(_number, types=(int, float), ok=lambda v: math.isfinite(v) and v >= 0,
                              what="0 or a positive finite number")


def one_of(name: str, value, choices) -> str:
    value = str(value)
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}, got {value!r}")
    return value


def divisible_heads(embed_dim: int, num_heads: int, embed_name: str = "embed_dim", heads_name: str = "num_heads"):
    if isinstance(num_heads, bool) or not isinstance(num_heads, int) or num_heads < 1 or embed_dim % num_heads != 0:
        raise ValueError(f"{embed_name} ({embed_dim}) must be divisible by {heads_name} ({num_heads})")
