"""bench/profile_real_decode.py on two tiny trained checkpoints (softmax and RFA-Gate)."""

import pytest

from bench import profile_real_decode
from rfa_test_utils import USER_DIR, multi30k_bin, run_cli

TINY = ["--encoder-layers", "1", "--decoder-layers", "2", "--encoder-embed-dim", "32", "--decoder-embed-dim", "32",
        "--encoder-ffn-embed-dim", "64", "--decoder-ffn-embed-dim", "64",
        "--encoder-attention-heads", "4", "--decoder-attention-heads", "4", "--share-all-embeddings"]
TRAIN = ["--optimizer", "adam", "--lr", "1e-3", "--max-tokens", "1500", "--no-progress-bar", "--cpu",
         "--num-workers", "0", "--seed", "3", "--max-update", "1", "--no-epoch-checkpoints"]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    d = tmp_path_factory.mktemp("profile")
    data = multi30k_bin(d, (("train", 60), ("valid", 8), ("test", 9)))
    archs = {"softmax": ["--arch", "transformer_iwslt_de_en"],
             "rfa_gate": ["--user-dir", USER_DIR, "--arch", "rfa_transformer_iwslt_de_en", "--rfa-gate"]}
    paths = {}
    for name, arch in archs.items():
        run_cli("fairseq-train", data, *arch, *TINY, *TRAIN, "--save-dir", d / name)
        paths[name] = d / name / "checkpoint_last.pt"
    return data, paths


def test_profile_counts_every_operator_of_a_step_in_one_range(checkpoints, tmp_path):
    data, paths = checkpoints
    out = tmp_path / "profile.json"
    rows = profile_real_decode.main([str(data), "--source-lang", "de", "--target-lang", "en",
                                     "--model", f"softmax={paths['softmax']}", "--model", f"rfa_gate={paths['rfa_gate']}",
                                     "--batch", "4", "--batches", "1", "--beam", "2", "--out", str(out)])
    assert [r["model"] for r in rows] == ["softmax", "rfa_gate"] and out.exists()
    for r in rows:
        assert r["steps"] > 0 and r["tokens"] > 0 and r["page_faults_per_step"] >= 0
        # every operator is in exactly one range: the ranges add up to the whole step
        assert sum(r["ms_per_step_by_range"].values()) == pytest.approx(r["ms_per_step"], rel=1e-6)
        for where in ("self_attn", "encoder_attn", "ffn", "output projection", "encoder"):
            assert r["ops_per_step_by_range"][where] > 0, where
    rfa_ops = rows[1]["ops"]["self_attn"]
    # RFA-Gate's decoding step: the feature map's sin and cos, once per layer and step
    assert rfa_ops["aten::sin"]["calls_per_step_and_layer"] == pytest.approx(1.0)
    assert "aten::sin" not in rows[0]["ops"]["self_attn"]


def test_profile_rejects_a_model_without_a_checkpoint(checkpoints):
    data, _ = checkpoints
    with pytest.raises(SystemExit):
        profile_real_decode.main([str(data), "--source-lang", "de", "--target-lang", "en", "--model", "nothing.pt"])
