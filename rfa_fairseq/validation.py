"""Checks of argument and flag values, one helper per check, for every layer of the package.

Pure Python (no torch, no fairseq), so that a check and its message are written once. Each helper
takes the name to print (a flag such as ``--rfa-chunk-size`` or an argument such as ``embed_dim``) and
the value, raises ValueError naming it when the value is bad, and returns the value otherwise.
"""
import math


def flag(name: str) -> str:
    """The command-line flag of a config field: ``rfa_chunk_size`` -> ``--rfa-chunk-size``."""
    return "--" + name.replace("_", "-")


def positive_int(name: str, value):
    """``value`` if it is an int of at least 1 (a bool is not), else ValueError."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


def non_negative_int(name: str, value):
    """``value`` if it is an int of at least 0 (a bool is not), else ValueError."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be 0 or a positive integer, got {value!r}")
    return value


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def positive_finite(name: str, value):
    """``value`` if it is a number, finite and above 0 (NaN and infinity are not), else ValueError."""
    if not _is_number(value) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a positive finite number, got {value!r}")
    return value


def finite(name: str, value):
    """``value`` if it is a finite number (of any sign), else ValueError."""
    if not _is_number(value) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    return value


def one_of(name: str, value, choices) -> str:
    """``str(value)`` (a ChoiceEnum member or a string) if it is one of ``choices``, else ValueError."""
    value = str(value)
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}, got {value!r}")
    return value


def divisible_heads(embed_dim: int, num_heads: int, embed_name: str = "embed_dim", heads_name: str = "num_heads"):
    """ValueError unless ``num_heads`` is at least 1 and divides ``embed_dim`` (each head gets
    ``embed_dim // num_heads`` channels); the names are the flags or arguments to print."""
    if isinstance(num_heads, bool) or not isinstance(num_heads, int) or num_heads < 1 or embed_dim % num_heads != 0:
        raise ValueError(f"{embed_name} ({embed_dim}) must be divisible by {heads_name} ({num_heads})")
