"""Models and architectures (importing this registers them with fairseq)."""
from .rfa_decoder import RFA_CHECKPOINT_VERSION, RFATransformerDecoder, RFATransformerDecoderLayer  # noqa: F401
from .rfa_classifier import RFAClassifierModel  # noqa: F401  (registers rfa_classifier)
from .rfa_transformer import RFATransformerModel  # noqa: F401
from .rfa_transformer_lm import RFATransformerLanguageModel  # noqa: F401
