"""Loading fairseq checkpoints under torch's safe unpickler (weights_only=True, torch >= 2.6): the few
plain containers fairseq pickles besides tensors are allow-listed (torch.serialization.add_safe_globals)
when the plugin is imported; any other pickled object is still refused by torch."""
import argparse

import torch


def allow_fairseq_checkpoint_globals():
    # argparse.Namespace: the legacy ``args``/``cfg.model`` of argparse-based models (translation)
    torch.serialization.add_safe_globals([argparse.Namespace])  # torch >= 2.4
