"""rfa_fairseq: Random Feature Attention (Peng et al., ICLR 2021) for fairseq.

Load with ``--user-dir rfa_fairseq``. Layers: ``ops`` (math, pure torch) -> ``modules`` (fairseq attention modules) ->
``models`` (registered models and architectures) and ``tasks`` (the stateful LM; translation, its compiled beam search)."""
import argparse

import torch

# fairseq checkpoints under torch's safe unpickler (weights_only=True, torch >= 2.6): the few plain containers fairseq
# pickles besides tensors are allow-listed here, torch still refuses any other object. argparse.Namespace: the legacy
# ``args``/``cfg.model`` of argparse-based models (translation).
torch.serialization.add_safe_globals([argparse.Namespace])  # torch >= 2.4

from . import models, tasks  # noqa: E402,F401  (registers models, architectures and tasks)

__version__ = "0.1.0"
