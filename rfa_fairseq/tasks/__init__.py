"""Tasks (importing this registers them with fairseq): the stateful language model, and translation with the compiled beam search."""
from .stateful_lm import StatefulLanguageModelingTask  # noqa: F401
from .translation import CompiledSearch, RFATranslationTask  # noqa: F401
