from .chunk import DEFAULT_CHUNK_SIZE, chunk_causal_rfa
from .naive import naive_causal_rfa
from .recurrent import recurrent_causal_rfa_step

__all__ = ["chunk_causal_rfa", "naive_causal_rfa", "recurrent_causal_rfa_step", "DEFAULT_CHUNK_SIZE"]
