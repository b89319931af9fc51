"""Resuming fairseq-train mid-epoch from checkpoint_last.pt continues exactly as the run that was
never interrupted: the same per-update losses, the same epoch, and bit-identical final weights,
including every random-feature matrix (redrawn each update from the seed and num_updates).

Run A trains uninterrupted to update 7. Run B stops at update 3 (mid-epoch; checkpoint_last.pt is
saved there) and the same command with --max-update 7 resumes from it. Dropout is 0.1, so the
per-update RNG state matters too. Validation is off (it is not what is tested, and it keeps the
test fast); checkpoints are still written every 3 updates and when training stops.
"""
import json
import os
import re

import pytest
import torch

from rfa_test_utils import REPO, USER_DIR, head_gz, run_cli

pytestmark = pytest.mark.slow  # fairseq-train runs

STOP, FINAL = 3, 7
TRAIN_PAIRS = 300  # with --max-tokens 500: 13 updates per epoch, so updates 1..7 are all in epoch 1
# Logged fields that depend on wall-clock time, not on the computation.
TIMING = {"wps", "ups", "train_wall", "wall"}

ARGS = [
    "--user-dir", USER_DIR, "--arch", "rfa_transformer_iwslt_de_en", "--rfa-gate", "--cross-attention", "rfa", "--share-all-embeddings",
    "--encoder-layers", "1", "--decoder-layers", "2", "--encoder-embed-dim", "32", "--decoder-embed-dim", "32",
    "--encoder-ffn-embed-dim", "64", "--decoder-ffn-embed-dim", "64",
    "--encoder-attention-heads", "4", "--decoder-attention-heads", "4", "--rfa-chunk-size", "8",
    "--dropout", "0.1",
    "--criterion", "label_smoothed_cross_entropy", "--label-smoothing", "0.1",
    "--optimizer", "adam", "--lr", "1e-3", "--max-tokens", "500",
    "--log-interval", "1", "--log-format", "json", "--cpu", "--num-workers", "0", "--seed", "5",
    "--save-interval-updates", "3", "--no-epoch-checkpoints", "--disable-validation",
]


def train_records(log):
    """The per-update json records of fairseq-train (log interval 1), keyed by num_updates."""
    records = {}
    for m in re.finditer(r"\| train_inner \| (\{.*\})\s*$", log, flags=re.M):
        rec = json.loads(m.group(1))
        records[int(rec["num_updates"])] = rec
    return records


def load(path):
    import rfa_fairseq  # noqa: F401  (allow-lists argparse.Namespace for weights_only)

    return torch.load(path, map_location="cpu", weights_only=True)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("resume")
    for lang in ("de", "en"):
        head_gz(os.path.join(REPO, "data", "multi30k", f"train.{lang}.gz"), d / f"train.{lang}", TRAIN_PAIRS)
    run_cli("fairseq-preprocess", "--source-lang", "de", "--target-lang", "en", "--joined-dictionary",
        "--trainpref", d / "train", "--destdir", d / "bin",
        "--thresholdsrc", "2", "--workers", "1")

    log_a = run_cli("fairseq-train", d / "bin", *ARGS, "--max-update", FINAL, "--save-dir", d / "A")
    log_b1 = run_cli("fairseq-train", d / "bin", *ARGS, "--max-update", STOP, "--save-dir", d / "B")
    # Snapshot of the interrupted run's checkpoint_last before the resumed run overwrites it.
    stopped = load(d / "B" / "checkpoint_last.pt")
    log_b2 = run_cli("fairseq-train", d / "bin", *ARGS, "--max-update", FINAL, "--save-dir", d / "B")
    return {"dir": d, "A": log_a, "B1": log_b1, "B2": log_b2, "stopped": stopped}


def test_resumed_losses_equal_uninterrupted(runs):
    a, b1, b2 = (train_records(runs[k]) for k in ("A", "B1", "B2"))
    assert sorted(a) == list(range(1, FINAL + 1)), runs["A"][-3000:]
    assert sorted(b1) == list(range(1, STOP + 1)), runs["B1"][-3000:]
    # The resumed run starts at update STOP + 1: nothing is redone, nothing skipped.
    assert sorted(b2) == list(range(STOP + 1, FINAL + 1)), runs["B2"][-3000:]
    for u in range(1, FINAL + 1):
        rec_b = b1[u] if u <= STOP else b2[u]
        got = {k: v for k, v in rec_b.items() if k not in TIMING}
        want = {k: v for k, v in a[u].items() if k not in TIMING}
        assert got == want, f"update {u}: resumed run logged {got}, uninterrupted run {want}"
    # The losses do change from update to update (the comparison is not of constants).
    assert len({a[u]["loss"] for u in a}) == FINAL


def test_resume_is_mid_epoch(runs):
    stopped = runs["stopped"]
    itr = stopped["extra_state"]["train_iterator"]
    assert itr["epoch"] == 1 and itr["iterations_in_epoch"] == STOP, itr
    assert stopped["optimizer_history"][-1]["num_updates"] == STOP
    m = re.search(r"Loaded checkpoint \S*checkpoint_last\.pt \(epoch (\d+) @ (\d+) updates\)", runs["B2"])
    assert m and (int(m.group(1)), int(m.group(2))) == (1, STOP), runs["B2"][-3000:]
    # The epoch iterator has more batches than FINAL: all updates of both runs lie in epoch 1,
    # and the resumed run did not start a new epoch.
    total = re.search(r"grouped total_num_itrs = (\d+)", runs["A"])
    assert total and int(total.group(1)) > FINAL, runs["A"][-3000:]
    assert "begin training epoch 2" not in runs["A"] + runs["B2"]
    for log in (runs["A"], runs["B2"]):
        for u, rec in train_records(log).items():
            assert rec["epoch"] == 1, (u, rec)
            assert 0 < float(rec["update"]) < 1  # fairseq logs epoch - 1 + fraction of the epoch done


def test_final_checkpoints_identical(runs):
    d = runs["dir"]
    a, b = load(d / "A" / "checkpoint_last.pt"), load(d / "B" / "checkpoint_last.pt")
    assert a["optimizer_history"][-1]["num_updates"] == b["optimizer_history"][-1]["num_updates"] == FINAL
    assert a["extra_state"]["train_iterator"] == b["extra_state"]["train_iterator"]
    assert set(a["model"]) == set(b["model"])

    matrices = sorted(k for k in a["model"] if k.endswith(".feature_map.random_matrix"))
    # 2 decoder layers x (causal self-attention + cross attention)
    assert len(matrices) == 4, matrices
    for name, value in a["model"].items():
        assert torch.equal(value, b["model"][name]), (
            f"{name}: resumed run differs by {(value.double() - b['model'][name].double()).abs().max()}")

    # The resumed optimizer (Adam moments and step counts) is the uninterrupted one as well.
    sa, sb = a["last_optimizer_state"]["state"], b["last_optimizer_state"]["state"]
    assert sa.keys() == sb.keys() and len(sa) > 0
    for key in sa:
        for field in sa[key]:
            assert torch.equal(torch.as_tensor(sa[key][field]), torch.as_tensor(sb[key][field])), (key, field)

    # The random matrices were redrawn after the interruption (the comparison above is not of
    # matrices frozen at update 3), and they differ between layers and attention kinds.
    stopped = runs["stopped"]["model"]
    for name in matrices:
        assert not torch.equal(stopped[name], a["model"][name]), f"{name} not redrawn after update {STOP}"
    for i, x in enumerate(matrices):
        for y in matrices[i + 1:]:
            if a["model"][x].shape == a["model"][y].shape:
                assert not torch.equal(a["model"][x], a["model"][y]), (x, y)
    # The weights themselves moved between update 3 and 7.
    assert any(not torch.equal(stopped[k], a["model"][k]) for k in a["model"] if k.endswith(".weight"))
