"""Tasks (importing this registers them with fairseq)."""
from .stateful_lm import StatefulLanguageModelingTask

__all__ = ["StatefulLanguageModelingTask"]
