from .chunk import DEFAULT_CHUNK_SIZE, chunk_causal_rfa
from .naive import naive_causal_rfa
from .recurrent import gaussian_recurrent_step, gaussian_step_weights, recurrent_causal_rfa_step

# The gate's forms: the paper's S = g S + (1 - g) phi(k) v^T, or the decay form S = g S + phi(k) v^T.
GATE_FORMS = ("convex", "decay")

# Tokens per recomputed segment when a long sequence is trained (modules.CausalRFAttention): short
# enough that one segment's intermediates are small beside the heads of the whole sequence.
DEFAULT_RECOMPUTE_SEGMENT = 512

__all__ = ["chunk_causal_rfa", "gaussian_recurrent_step", "gaussian_step_weights", "naive_causal_rfa", "recurrent_causal_rfa_step", "DEFAULT_CHUNK_SIZE", "DEFAULT_RECOMPUTE_SEGMENT",
           "GATE_FORMS"]
