from .chunk import DEFAULT_CHUNK_SIZE, chunk_causal_rfa
from .keys import causal_keys_step, gather_keys, key_rows, keys_capacity, keys_to_summary
from .naive import naive_causal_rfa
from .recurrent import pack_state, recurrent_causal_rfa_step, recurrent_causal_rfa_step_packed, unpack_state

__all__ = ["chunk_causal_rfa", "naive_causal_rfa", "recurrent_causal_rfa_step", "recurrent_causal_rfa_step_packed",
           "pack_state", "unpack_state", "DEFAULT_CHUNK_SIZE",
           "causal_keys_step", "gather_keys", "key_rows", "keys_capacity", "keys_to_summary"]
