"""Models and architectures (importing this registers them with fairseq)."""
from .rfa_decoder import RFA_CHECKPOINT_VERSION, RFATransformerDecoder, RFATransformerDecoderLayer
from .rfa_classifier import RFAClassifierModel  # noqa: F401  (registers rfa_classifier)
from .rfa_transformer import RFATransformerModel
from .rfa_transformer_lm import RFATransformerLanguageModel

__all__ = ["RFA_CHECKPOINT_VERSION", "RFATransformerDecoder", "RFATransformerDecoderLayer", "RFATransformerModel",
           "RFATransformerLanguageModel"]
