"""rfa_fairseq: Random Feature Attention (Peng et al., ICLR 2021) for fairseq.

Load with ``--user-dir rfa_fairseq``. Layers: ``ops`` (math, pure torch) -> ``modules`` (fairseq attention modules) ->
``models`` (registered models and architectures) and ``tasks`` (the stateful language modelling task)."""
from .checkpoints import allow_fairseq_checkpoint_globals

allow_fairseq_checkpoint_globals()

from . import models, tasks  # noqa: E402,F401  (registers models, architectures and tasks)

__version__ = "0.1.0"
