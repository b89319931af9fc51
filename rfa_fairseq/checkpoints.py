"""Loading fairseq checkpoints under torch's safe unpickler (weights_only=True, torch >= 2.6): the few plain containers
fairseq pickles besides tensors are allow-listed when the plugin is imported; torch still refuses any other object."""
import argparse

import torch


def allow_fairseq_checkpoint_globals():
    # argparse.Namespace: the legacy ``args``/``cfg.model`` of argparse-based models (translation)
    torch.serialization.add_safe_globals([argparse.Namespace])  # torch >= 2.4
