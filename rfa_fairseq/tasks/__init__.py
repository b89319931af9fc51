"""Tasks (importing this registers them with fairseq): the stateful language model, and translation with a lean beam search."""
from .stateful_lm import StatefulLanguageModelingTask  # noqa: F401
from .translation import LeanBeamSearch, RFATranslationTask  # noqa: F401
