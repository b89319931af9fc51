"""recipes/finetune_from_softmax/run.sh in smoke mode: every step runs (softmax training,
conversion, scoring before and after finetuning), and a second run skips them all."""
import os
import re
import subprocess
import sys

import pytest

from rfa_test_utils import REPO

pytestmark = pytest.mark.slow  # runs the recipe

SCRIPT = os.path.join(REPO, "recipes", "finetune_from_softmax", "run.sh")
STEPS = ["prepare", "softmax", "convert", "score_converted", "finetune", "score_finetuned"]


def run(work):
    bin_dir = os.path.dirname(sys.executable)
    env = dict(os.environ, SMOKE="1", WORK=str(work), RFA_USE_CURRENT_ENV="1", PYTHONWARNINGS="ignore",
               OMP_NUM_THREADS="1", PATH=bin_dir + os.pathsep + os.environ.get("PATH", ""))
    proc = subprocess.run(["bash", SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    return out


def test_recipe_smoke(tmp_path):
    out = run(tmp_path)
    assert re.findall(r"step (\S+): done", out) == STEPS, out[-4000:]
    assert re.search(r"converted: BLEU4 = [\d.]+", out) and re.search(r"finetuned: BLEU4 = [\d.]+", out)
    finetune_log = (tmp_path / "logs" / "finetune.log").read_text()
    assert "loading pretrained model from" in finetune_log and "num_updates 2" in finetune_log
    again = run(tmp_path)
    assert not re.findall(r"step (\S+): start", again), "a finished recipe redoes nothing"
