"""Loading fairseq checkpoints under torch's safe unpickler (weights_only=True, torch >= 2.6): the few
plain containers fairseq pickles besides tensors are allow-listed (torch.serialization.add_safe_globals)
when the plugin is imported; any other pickled object is still refused by torch."""
import argparse

import torch

# argparse.Namespace: the legacy ``args``/``cfg.model`` of argparse-based models (translation).
SAFE_CHECKPOINT_GLOBALS = [argparse.Namespace]


def allow_fairseq_checkpoint_globals():
    torch.serialization.add_safe_globals(list(SAFE_CHECKPOINT_GLOBALS))  # torch >= 2.4
