"""Checks of argument and flag values, one helper per check, for every layer of the package.

Pure Python (no torch, no fairseq), so that a check and its message are written once. Each helper takes the name to
print (a flag such as ``--rfa-chunk-size`` or an argument such as ``embed_dim``) and the value, raises ValueError naming
it when the value is bad, and returns the value otherwise (a bool is not an int; NaN and infinity are not finite;
``one_of`` returns ``str(value)``, for ChoiceEnum members)."""
import math


def flag(name: str) -> str:
    """The command-line flag of a config field: ``rfa_chunk_size`` -> ``--rfa-chunk-size``."""
    return "--" + name.replace("_", "-")


def positive_int(name: str, value):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


def non_negative_int(name: str, value):
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be 0 or a positive integer, got {value!r}")
    return value


def positive_finite(name: str, value):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a positive finite number, got {value!r}")
    return value


def finite(name: str, value):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    return value


def one_of(name: str, value, choices) -> str:
    value = str(value)
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}, got {value!r}")
    return value


def divisible_heads(embed_dim: int, num_heads: int, embed_name: str = "embed_dim", heads_name: str = "num_heads"):
    if isinstance(num_heads, bool) or not isinstance(num_heads, int) or num_heads < 1 or embed_dim % num_heads != 0:
        raise ValueError(f"{embed_name} ({embed_dim}) must be divisible by {heads_name} ({num_heads})")
