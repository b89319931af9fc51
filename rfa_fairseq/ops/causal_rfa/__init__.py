"""Causal RFA in its forms, one contract, fla's: ``(q, k, v, log_g, initial_state, output_final_state) ->
(out, final_state or None)``, each tested equal to the naive reference (tests/ops/test_causal_rfa.py, test_fla.py):
``naive``, the recurrence as a loop, the reference; ``chunk``, the chunked parallel form (training, prompts, blocks of a
stateful LM); ``recurrent``, token by token on the packed state, its step the decoder's; ``fla``, the chunked form by
flash-linear-attention's Triton kernels (GPU training)."""
from .chunk import DEFAULT_CHUNK_SIZE, chunk_causal_rfa  # noqa: F401
from .naive import naive_causal_rfa  # noqa: F401
from .fla import fla_causal_rfa, fla_installed, fla_refuses_gated_backward  # noqa: F401
from .recurrent import recurrent_causal_rfa, recurrent_causal_rfa_step  # noqa: F401

# The gate's forms: the paper's S = g S + (1 - g) phi(k) v^T, or the decay form S = g S + phi(k) v^T.
GATE_FORMS = ("convex", "decay")
# Tokens per recomputed segment of a long training sequence (modules.CausalRFAttention): small intermediates.
DEFAULT_RECOMPUTE_SEGMENT = 512
