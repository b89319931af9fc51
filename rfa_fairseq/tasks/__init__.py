"""Tasks (importing this registers them with fairseq)."""
from .stateful_lm import StatefulLanguageModelingTask
from .translation import LeanBeamSearch, RFATranslationTask

__all__ = ["LeanBeamSearch", "RFATranslationTask", "StatefulLanguageModelingTask"]
