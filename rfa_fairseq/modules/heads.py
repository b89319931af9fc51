"""Layout helpers: fairseq's Time x Batch x Channel <-> the ops' [B, H, T, K]."""
from torch import Tensor


def split_heads(x: Tensor, num_heads: int) -> Tensor:
    """``[T, B, H*K]`` -> ``[B, H, T, K]``."""
    T, B, C = x.shape
    return x.view(T, B, num_heads, C // num_heads).permute(1, 2, 0, 3)


def merge_heads(x: Tensor) -> Tensor:
    """``[B, H, T, K]`` -> ``[T, B, H*K]``."""
    B, H, T, K = x.shape
    return x.permute(2, 0, 1, 3).reshape(T, B, H * K)
