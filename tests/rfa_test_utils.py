"""Helpers shared by the tests: tiny fairseq models built through fairseq's own argument parser.

(A module of its own, not conftest.py: pytest registers every conftest.py under the same name,
so ``from conftest import ...`` could pick tests/ops/conftest.py.)"""
import os
import sys

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

TINY_DECODER = [
    "--decoder-layers", "2", "--decoder-embed-dim", "32", "--decoder-ffn-embed-dim", "64",
    "--decoder-attention-heads", "4", "--dropout", "0.0",
]
TINY_RFA = ["--rfa-causal-feature-dim", "64", "--rfa-cross-feature-dim", "96", "--rfa-chunk-size", "8"]
TINY_MODEL = TINY_DECODER + TINY_RFA
TINY_ENCODER = [
    "--encoder-layers", "2", "--encoder-embed-dim", "32", "--encoder-ffn-embed-dim", "64",
    "--encoder-attention-heads", "4",
]


def write_dict(path, size):
    with open(path, "w") as f:
        for i in range(size):
            f.write(f"w{i} {1000 - i}\n")


def build_from_cli(data_dir, args):
    """Build (task, model, args) exactly as fairseq-train would, from command-line words."""
    from fairseq import options, tasks

    parser = options.get_training_parser()
    parsed = options.parse_args_and_arch(parser, input_args=[str(data_dir), "--user-dir", os.path.join(REPO, "rfa_fairseq")] + args)
    task = tasks.setup_task(parsed)
    model = task.build_model(parsed)
    return task, model, parsed


def random_tokens(dictionary, batch, length, generator=None):
    """Tokens drawn from the dictionary's real words (no special symbols)."""
    low = dictionary.nspecial
    return torch.randint(low, len(dictionary), (batch, length), generator=generator)
