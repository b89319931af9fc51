"""Checkpoints saved by the release that had ``--rfa-decode-kernel`` (tests/data/
checkpoints_with_decode_kernel, with the outputs that release printed) load with the current code
and decode and score exactly as before: the flag is dropped from their saved arguments (and the
translation model, whose cross attention is RFA, needs --model-overrides to say so)."""
import math
import re
import shutil

import torch

import rfa_fairseq  # noqa: F401  (allow-list for weights_only loading)
from rfa_test_utils import REPO, USER_DIR, run_cli

DATA = REPO + "/tests/data/checkpoints_with_decode_kernel"


def _lines(text):
    return sorted((line for line in text.splitlines() if line[:2] in ("H-", "P-")),
                  key=lambda line: (line[:2], int(line.split("\t")[0][2:])))


def _saved_flag(path):
    model_args = torch.load(path, map_location="cpu", weights_only=True)["cfg"]["model"]
    return model_args["rfa_decode_kernel"] if isinstance(model_args, dict) else model_args.rfa_decode_kernel


def test_translation_checkpoint_decodes_as_before(tmp_path):
    """Its cross attention is RFA, and the default is now softmax: loading it says how to load it."""
    assert _saved_flag(DATA + "/translation/translation_rfa_gate.pt") == "cpp"
    bin_dir = shutil.copytree(DATA + "/translation", tmp_path / "bin")
    generate = ["fairseq-generate", bin_dir, "--user-dir", USER_DIR, "--path", bin_dir / "translation_rfa_gate.pt",
                "--beam", "4", "--max-len-b", "12", "--batch-size", "12", "--required-batch-size-multiple", "1", "--cpu"]
    refused = run_cli(*generate, check=False)
    assert refused.returncode != 0 and "the checkpoint has rfa cross attention" in refused.stderr and \
        "--model-overrides \"{'cross_attention': 'rfa'}\"" in refused.stderr, refused.stderr[-2000:]
    out = run_cli(*generate, "--model-overrides", "{'cross_attention': 'rfa'}")
    got, expected = _lines(out), _lines(open(DATA + "/translation/generate.txt").read())
    assert len(got) == len(expected) == 24
    for g, e in zip(got, expected):
        g_id, g_score, *g_text = g.split("\t")  # H-: id, score, text; P-: id, per-token scores
        e_id, e_score, *e_text = e.split("\t")
        assert (g_id, g_text) == (e_id, e_text)  # the same hypotheses, token for token
        # the scores up to fp32 rounding (the feature map's operations are ordered differently)
        for a, b in zip(g_score.split(), e_score.split(), strict=True):
            assert abs(float(a) - float(b)) <= 1e-4, (g, e)


def test_language_model_checkpoint_scores_as_before(tmp_path):
    assert _saved_flag(DATA + "/lm/lm_rfa_gate.pt") == "cpp"
    bin_dir = shutil.copytree(DATA + "/lm", tmp_path / "bin")
    out = run_cli("fairseq-eval-lm", bin_dir, "--user-dir", USER_DIR, "--path", bin_dir / "lm_rfa_gate.pt",
                  "--gen-subset", "test", "--tokens-per-sample", "64", "--max-tokens", "2048", "--cpu")
    pattern = r"Loss \(base 2\): ([\d.]+), Perplexity: ([\d.]+)"
    got = re.search(pattern, out)
    expected = re.search(pattern, open(DATA + "/lm/eval_lm.txt").read())
    assert got, out[-2000:]
    assert math.isclose(float(got.group(2)), float(expected.group(2)), rel_tol=1e-4)
