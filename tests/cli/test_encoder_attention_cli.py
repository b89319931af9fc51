"""--encoder-attention through the stock command lines: fairseq-train, then fairseq-generate (beam
search) from the saved checkpoint, for each linear encoder (and LARA behind a softmax decoder);
for LARA also resuming training from the checkpoint. Tiny models on the shipped Multi30k sample
(each command line costs several seconds of start-up, so the resume runs once)."""
import re

import pytest
import torch

import rfa_fairseq  # noqa: F401  (allow-list for weights_only loading)
from rfa_test_utils import USER_DIR, multi30k_bin, run_cli

pytestmark = pytest.mark.slow  # fairseq-train and fairseq-generate

TINY = ["--encoder-layers", "1", "--decoder-layers", "1", "--encoder-embed-dim", "32", "--decoder-embed-dim", "32",
        "--encoder-ffn-embed-dim", "64", "--decoder-ffn-embed-dim", "64",
        "--encoder-attention-heads", "4", "--decoder-attention-heads", "4"]
TRAIN = ["--optimizer", "adam", "--lr", "1e-3", "--max-tokens", "1500", "--no-progress-bar", "--log-interval", "1",
         "--cpu", "--num-workers", "0", "--seed", "3", "--no-epoch-checkpoints", "--share-all-embeddings"]
GENERATE = ["--beam", "3", "--max-len-b", "8", "--batch-size", "12", "--required-batch-size-multiple", "1", "--cpu"]


@pytest.fixture(scope="module")
def mt_data(tmp_path_factory):
    d = tmp_path_factory.mktemp("mt_encoder")
    multi30k_bin(d, (("train", 200), ("valid", 20), ("test", 12)), "bin", "--thresholdsrc", "2")
    return d


@pytest.mark.parametrize("flags,module_key", [
    (["--encoder-attention", "rfa", "--encoder-feature-dim", "16"], "feature_map.random_matrix"),
    (["--encoder-attention", "favor", "--encoder-feature-dim", "16"], "feature_map.random_matrix"),
    (["--encoder-attention", "lara", "--lara-landmarks", "4"], None),
    (["--encoder-attention", "lara", "--lara-landmarks", "4", "--decoder-attention", "softmax"], None),
], ids=["rfa", "favor", "lara", "lara-softmax-decoder"])
def test_train_generate(mt_data, tmp_path, flags, module_key):
    ckpt = tmp_path / "ckpt"
    log = run_cli("fairseq-train", mt_data / "bin", "--user-dir", USER_DIR, "--arch", "rfa_transformer_iwslt_de_en",
                  *flags, *TINY, *TRAIN, "--max-update", "2", "--save-dir", ckpt)
    assert "RFATransformerEncoder" in log and "num_updates 2" in log
    assert ("SoftmaxTransformerDecoder" in log) == ("softmax" in flags)

    state = torch.load(ckpt / "checkpoint_last.pt", map_location="cpu", weights_only=True)
    saved = state["cfg"]["model"]
    saved = saved if isinstance(saved, dict) else vars(saved)
    assert saved["encoder_attention"] == flags[1]
    keys = [k for k in state["model"] if k.startswith("encoder.layers.0.self_attn.")]
    if module_key:
        assert f"encoder.layers.0.self_attn.{module_key}" in keys
    else:
        assert not any("feature_map" in k for k in keys)

    out = run_cli("fairseq-generate", mt_data / "bin", "--user-dir", USER_DIR, "--path", ckpt / "checkpoint_last.pt",
                  "--gen-subset", "test", *GENERATE)
    assert len(re.findall(r"^H-\d+\t", out, flags=re.M)) == 12 and "Translated 12 sentences" in out

    if flags[1:] != ["lara", "--lara-landmarks", "4"]:
        return
    log = run_cli("fairseq-train", mt_data / "bin", "--user-dir", USER_DIR, "--arch", "rfa_transformer_iwslt_de_en",
                  *flags, *TINY, *TRAIN, "--max-update", "3", "--save-dir", ckpt)
    assert re.search(r"Loaded checkpoint .*checkpoint_last\.pt .*\(epoch \d+ @ 2 updates\)", log)
    assert "num_updates 3" in log
