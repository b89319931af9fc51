"""Fixtures shared by the tests (helpers live in rfa_test_utils.py)."""
import os

import pytest
import torch

# Without a GPU, fla-core's kernels run in Triton's interpreter (rfa_test_utils.fla_on_this_machine). Triton reads
# TRITON_INTERPRET when its modules are first imported, which other tests' imports (torch's DDP, for one) may do
# before any fla test runs: so it is set here, before any test module is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from rfa_test_utils import TINY_DECODER, TINY_ENCODER, TINY_MODEL, build_from_cli, write_dict


@pytest.fixture
def translation_model(tmp_path):
    """factory(*extra_args) -> (task, model) for a tiny rfa_transformer (vocab 50)."""
    write_dict(tmp_path / "dict.de.txt", 46)
    write_dict(tmp_path / "dict.en.txt", 46)

    def make(*extra, arch="rfa_transformer", rfa_flags=True):
        """The RFA decoder with RFA cross attention (--cross-attention rfa), the model most tests are
        about; rfa_flags=False drops the --rfa-* sizes and that choice (for fairseq's own softmax
        architectures, and for --cross-attention softmax, which the extra arguments then give)."""
        torch.manual_seed(0)
        model_args = TINY_MODEL + ["--cross-attention", "rfa"] if rfa_flags else TINY_DECODER
        task, model, _ = build_from_cli(
            tmp_path, ["--task", "translation", "--source-lang", "de", "--target-lang", "en",
                       "--arch", arch] + TINY_ENCODER + model_args + list(extra))
        return task, model

    return make


@pytest.fixture
def documents_model(translation_model, tmp_path):
    """factory(*extra) -> (task, model, separator) with a <sep> in both dictionaries."""
    for lang in ("de", "en"):
        with open(tmp_path / f"dict.{lang}.txt", "a") as f:
            f.write("<sep> 10\n")

    def make(*extra):
        task, model = translation_model(*extra, rfa_flags=False)
        return task, model.eval(), task.target_dictionary.index("<sep>")
    return make


@pytest.fixture
def lm_model(tmp_path):
    """factory(*extra_args) -> (task, model) for a tiny rfa_transformer_lm (vocab 50)."""
    write_dict(tmp_path / "dict.txt", 46)

    def make(*extra, arch="rfa_transformer_lm"):
        torch.manual_seed(0)
        task, model, _ = build_from_cli(
            tmp_path, ["--task", "language_modeling", "--tokens-per-sample", "2048",
                       "--arch", arch] + TINY_MODEL + list(extra))
        return task, model

    return make

