"""Loading fairseq checkpoints under torch's safe unpickler (weights_only=True, torch >= 2.6).

fairseq checkpoints pickle a few plain containers besides tensors: exactly those classes are
allow-listed (torch.serialization.add_safe_globals) when the plugin is imported; any other pickled
object is still refused by torch.
"""
import argparse

import torch

# argparse.Namespace: the legacy ``args``/``cfg.model`` of argparse-based models (translation).
SAFE_CHECKPOINT_GLOBALS = [argparse.Namespace]


def allow_fairseq_checkpoint_globals():
    add = getattr(torch.serialization, "add_safe_globals", None)
    if add is not None:  # torch < 2.4 has no safe unpickler allow-list (and loads everything)
        add(list(SAFE_CHECKPOINT_GLOBALS))
