"""The fairseq command lines with --user-dir: preprocess, train, generate (beam), resume from a
checkpoint, and the language-model chain with fairseq-eval-lm. Tiny models on shipped data."""
import json
import math
import os
import re
import subprocess
import sys

import pytest
import torch

from rfa_fairseq.cli import redraw_features
from rfa_test_utils import BIN, REPO, USER_DIR, head_gz, multi30k_bin, run_cli

TINY = ["--encoder-layers", "1", "--decoder-layers", "2", "--encoder-embed-dim", "32", "--decoder-embed-dim", "32",
        "--encoder-ffn-embed-dim", "64", "--decoder-ffn-embed-dim", "64",
        "--encoder-attention-heads", "4", "--decoder-attention-heads", "4"]
TRAIN = ["--optimizer", "adam", "--lr", "1e-3", "--max-tokens", "1500", "--no-progress-bar", "--log-interval", "1",
         "--cpu", "--num-workers", "0", "--seed", "3"]


@pytest.fixture(scope="module")
def mt_data(tmp_path_factory):
    d = tmp_path_factory.mktemp("mt")
    multi30k_bin(d, (("train", 300), ("valid", 40), ("test", 12)), "bin", "--thresholdsrc", "2")
    return d


@pytest.mark.slow
def test_translation_train_generate_resume(mt_data):
    ckpt = mt_data / "ckpt"
    log = run_cli("fairseq-train", mt_data / "bin", "--user-dir", USER_DIR, "--arch", "rfa_transformer_iwslt_de_en",
              "--rfa-gate", "--share-all-embeddings", *TINY, *TRAIN, "--max-update", "4", "--save-dir", ckpt,
              "--criterion", "label_smoothed_cross_entropy", "--label-smoothing", "0.1",
              "--save-interval-updates", "2")
    assert "RFATransformerModel" in log and "num_updates 4" in log
    assert (ckpt / "checkpoint_last.pt").exists()

    # Checkpoint averaging: parameters averaged, random features from the newest checkpoint.
    avg = ckpt / "avg.pt"
    subprocess.run([os.path.join(BIN, "rfa-average-checkpoints"), "--inputs", str(ckpt),
                    "--num-update-checkpoints", "2", "--output", str(avg)], check=True, capture_output=True)
    import rfa_fairseq  # noqa: F401  (allow-list for weights_only loading)
    a, b, m = (torch.load(p, map_location="cpu", weights_only=True)["model"]
               for p in (ckpt / "checkpoint_1_2.pt", ckpt / "checkpoint_1_4.pt", avg))
    key = "decoder.layers.0.self_attn.in_proj.weight"
    torch.testing.assert_close(m[key], (a[key] + b[key]) / 2)
    rm = "decoder.layers.0.self_attn.feature_map.random_matrix"
    assert torch.equal(m[rm], b[rm]) and not torch.equal(a[rm], b[rm])
    out = run_cli("fairseq-generate", mt_data / "bin", "--user-dir", USER_DIR, "--path", avg,
              "--beam", "4", "--max-len-b", "12", "--batch-size", "12", "--required-batch-size-multiple", "1", "--cpu")
    assert "Translated 12 sentences" in out

    out = run_cli("fairseq-generate", mt_data / "bin", "--user-dir", USER_DIR, "--path", ckpt / "checkpoint_last.pt",
              "--beam", "4", "--max-len-b", "12", "--batch-size", "5", "--required-batch-size-multiple", "1", "--cpu")
    hyps = [line for line in out.splitlines() if line.startswith("H-")]
    assert len(hyps) == 12
    assert re.search(r"Translated 12 sentences", out)

    # the compiled step in int8, asked for at generation time
    out = run_cli("fairseq-generate", mt_data / "bin", "--user-dir", USER_DIR, "--path", ckpt / "checkpoint_last.pt",
                  "--beam", "4", "--max-len-b", "12", "--batch-size", "5", "--required-batch-size-multiple", "1", "--cpu",
                  "--model-overrides", "{'int8_inference': True, 'int8_min_weights': 0}")
    assert "Translated 12 sentences" in out

    # --cuda-graphs asked for at generation time: on the CPU the steps run eagerly, the same hypotheses
    out = run_cli("fairseq-generate", mt_data / "bin", "--user-dir", USER_DIR, "--path", ckpt / "checkpoint_last.pt",
                  "--beam", "4", "--max-len-b", "12", "--batch-size", "5", "--required-batch-size-multiple", "1", "--cpu",
                  "--model-overrides", "{'cuda_graphs': True}")
    assert [line for line in out.splitlines() if line.startswith("H-")] == hyps

    # Sources longer than the positions allowed: fairseq's own behaviour (stop with a message
    # naming the option that skips them; with it, those sentences are skipped).
    too_long = ["--user-dir", USER_DIR, "--path", ckpt / "checkpoint_last.pt", "--beam", "2", "--max-len-b", "5",
                "--batch-size", "12", "--required-batch-size-multiple", "1", "--cpu", "--max-source-positions", "12"]
    proc = run_cli("fairseq-generate", mt_data / "bin", *too_long, check=False)
    assert proc.returncode != 0 and "--skip-invalid-size-inputs-valid-test" in proc.stderr + proc.stdout
    out = run_cli("fairseq-generate", mt_data / "bin", *too_long, "--skip-invalid-size-inputs-valid-test")
    kept = int(re.search(r"Translated (\d+) sentences", out).group(1))
    assert 0 < kept < 12

    # Reload: training continues from checkpoint_last.pt (update 4) to update 6.
    log = run_cli("fairseq-train", mt_data / "bin", "--user-dir", USER_DIR, "--arch", "rfa_transformer_iwslt_de_en",
              "--rfa-gate", "--share-all-embeddings", *TINY, *TRAIN, "--max-update", "6", "--save-dir", ckpt,
              "--criterion", "label_smoothed_cross_entropy", "--label-smoothing", "0.1")
    assert re.search(r"Loaded checkpoint .*checkpoint_last\.pt .*\(epoch \d+ @ 4 updates\)", log)
    assert "num_updates 6" in log


def test_redraw_features_keeps_a_linear_encoders_matrices_and_refuses_cross_dims_without_rfa_cross():
    encoder, decoder = (f"{part}.layers.0.self_attn.feature_map.random_matrix" for part in ("encoder", "decoder"))
    state = {"cfg": {"model": {"rfa_random_matrix": "orthogonal"}},
             "model": {encoder: torch.zeros(4, 8, 8), decoder: torch.zeros(4, 8, 8)}}
    with pytest.raises(ValueError, match="--cross-feature-dim: this model's cross attention has no random features"):
        redraw_features.redraw(state, seed=1, cross_dim=16)
    assert redraw_features.redraw(state, seed=1) == 1
    assert torch.equal(state["model"][encoder], torch.zeros(4, 8, 8)) and state["model"][decoder].abs().sum() > 0


@pytest.mark.slow
def test_checkpoint_loads_with_weights_only(mt_data):
    """fairseq checkpoints load under torch's safe unpickler once rfa_fairseq is imported, and
    only because of its allow-list (a fresh interpreter without it refuses the same file)."""
    ckpt = mt_data / "ckpt_wo"
    run_cli("fairseq-train", mt_data / "bin", "--user-dir", USER_DIR, "--arch", "rfa_transformer", *TINY, *TRAIN,
        "--max-update", "1", "--save-dir", ckpt, "--no-epoch-checkpoints")
    path = str(ckpt / "checkpoint_last.pt")
    code = "import sys, torch{imp}; torch.load(sys.argv[1], map_location='cpu', weights_only=True); print('LOADED')"
    ok = subprocess.run([sys.executable, "-c", code.format(imp=", rfa_fairseq"), path], cwd=REPO,
                        capture_output=True, text=True)
    assert "LOADED" in ok.stdout, ok.stderr[-2000:]
    refused = subprocess.run([sys.executable, "-c", code.format(imp=""), path], cwd="/",
                             capture_output=True, text=True)
    assert "LOADED" not in refused.stdout and "Weights only load failed" in refused.stderr


@pytest.mark.slow
def test_language_model_train_and_eval_lm(tmp_path):
    for split, n in (("train", 400), ("valid", 40), ("test", 40)):
        head_gz(os.path.join(REPO, "data", "multi30k", f"{split}.en.gz"), tmp_path / f"{split}.txt", n)
    run_cli("fairseq-preprocess", "--only-source", "--trainpref", tmp_path / "train.txt",
        "--validpref", tmp_path / "valid.txt", "--testpref", tmp_path / "test.txt",
        "--destdir", tmp_path / "bin", "--workers", "1")
    ckpt = tmp_path / "ckpt"
    log = run_cli("fairseq-train", tmp_path / "bin", "--task", "language_modeling", "--user-dir", USER_DIR,
              "--arch", "rfa_transformer_lm", "--rfa-gate", "--tokens-per-sample", "64",
              "--decoder-layers", "2", "--decoder-embed-dim", "32", "--decoder-ffn-embed-dim", "64",
              "--decoder-attention-heads", "4", "--rfa-chunk-size", "16", *TRAIN, "--max-update", "5",
              "--save-dir", ckpt)
    assert "RFATransformerLanguageModel" in log and "num_updates 5" in log
    out = run_cli("fairseq-eval-lm", tmp_path / "bin", "--user-dir", USER_DIR, "--path", ckpt / "checkpoint_last.pt",
              "--gen-subset", "test", "--tokens-per-sample", "64", "--max-tokens", "2048", "--cpu")
    m = re.search(r"Loss \(base 2\): ([\d.]+), Perplexity: ([\d.]+)", out)
    assert m, out[-2000:]
    ppl = float(m.group(2))
    assert math.isfinite(ppl) and 1.0 < ppl < 10 * len(open(tmp_path / "bin" / "dict.txt").readlines())


def _diagnostics(data, ckpt, tmp_path, split="valid"):
    out = tmp_path / "diagnostics.json"
    subprocess.run([os.path.join(BIN, "rfa-diagnostics"), data, "--path", ckpt,
                    "--gen-subset", split, "--json", out], check=True, capture_output=True)
    return json.loads(out.read_text())["modules"]


@pytest.mark.parametrize("kernel", ["favor", "elu"])
@pytest.mark.slow
def test_other_feature_maps_end_to_end(mt_data, tmp_path, kernel):
    """FAVOR+ and elu: fairseq-train, fairseq-generate and (for the LM) fairseq-eval-lm, and the
    diagnostics command on both checkpoints (the gate's mean, sigma, the clamped denominators)."""
    ckpt = tmp_path / "mt"
    run_cli("fairseq-train", mt_data / "bin", "--user-dir", USER_DIR, "--arch", "rfa_transformer_iwslt_de_en",
            "--rfa-kernel", kernel, "--rfa-gate", "--rfa-gate-form", "decay", "--cross-attention", "rfa",
            "--share-all-embeddings", *TINY, *TRAIN,
            "--max-update", "3", "--save-dir", ckpt, "--no-epoch-checkpoints")
    out = run_cli("fairseq-generate", mt_data / "bin", "--user-dir", USER_DIR, "--path", ckpt / "checkpoint_last.pt",
                  "--gen-subset", "test", "--beam", "3", "--max-len-b", "8", "--required-batch-size-multiple", "1", "--cpu")
    assert len(re.findall(r"^H-\d+\t", out, flags=re.M)) == 12
    rows = _diagnostics(mt_data / "bin", ckpt / "checkpoint_last.pt", tmp_path)
    assert [r["module"] for r in rows] == [f"decoder.layers.{i}.{m}" for i in range(2)
                                           for m in ("self_attn", "encoder_attn")]
    for r in rows:
        assert r["kernel"] == kernel and r["denominators"] > 0 and 0 <= r["clamped_pct"] <= 100
        assert r["negative_pct"] == 0  # positive features
        assert (0 < r["mean_gate"] < 1) if r["module"].endswith("self_attn") else r["mean_gate"] is None

    lm = tmp_path / "lm"
    lm.mkdir()
    for split, n in (("train", 200), ("valid", 20), ("test", 20)):
        head_gz(os.path.join(REPO, "data", "multi30k", f"{split}.en.gz"), lm / f"{split}.txt", n)
    run_cli("fairseq-preprocess", "--only-source", "--trainpref", lm / "train.txt", "--validpref", lm / "valid.txt",
            "--testpref", lm / "test.txt", "--destdir", lm / "bin", "--workers", "1")
    run_cli("fairseq-train", lm / "bin", "--task", "language_modeling", "--user-dir", USER_DIR,
            "--arch", "rfa_transformer_lm", "--rfa-kernel", kernel, "--tokens-per-sample", "32",
            "--decoder-layers", "1", "--decoder-embed-dim", "32", "--decoder-ffn-embed-dim", "64",
            "--decoder-attention-heads", "4", *TRAIN, "--max-update", "3", "--save-dir", lm / "ckpt")
    out = run_cli("fairseq-eval-lm", lm / "bin", "--user-dir", USER_DIR, "--path", lm / "ckpt" / "checkpoint_last.pt",
                  "--gen-subset", "test", "--tokens-per-sample", "32", "--max-tokens", "1024", "--cpu")
    assert math.isfinite(float(re.search(r"Perplexity: ([\d.]+)", out).group(1)))
    rows = _diagnostics(lm / "bin", lm / "ckpt" / "checkpoint_last.pt", tmp_path)
    assert [r["module"] for r in rows] == ["decoder.layers.0.self_attn"] and rows[0]["mean_gate"] is None


@pytest.mark.slow
def test_redraw_features_keeps_the_model_and_changes_the_draws(mt_data, tmp_path):
    """rfa-redraw-features: a seed gives the same matrices every time and other seeds other
    ones; more features load and decode; the rest of the checkpoint is unchanged."""
    ckpt = tmp_path / "ckpt"
    run_cli("fairseq-train", mt_data / "bin", "--user-dir", USER_DIR, "--arch", "rfa_transformer_iwslt_de_en",
            "--cross-attention", "rfa", "--share-all-embeddings", *TINY, *TRAIN, "--max-update", "1", "--save-dir", ckpt,
            "--no-epoch-checkpoints")
    script = os.path.join(BIN, "rfa-redraw-features")
    src = ckpt / "checkpoint_last.pt"
    for name, extra in (("a", ["--seed", "5"]), ("b", ["--seed", "5"]), ("c", ["--seed", "6"]),
                        ("big", ["--seed", "5", "--causal-feature-dim", "80", "--cross-feature-dim", "100"]),
                        ("x3", ["--seed", "5", "--feature-scale", "3"])):
        subprocess.run([script, src, tmp_path / f"{name}.pt", *extra], check=True, capture_output=True)
    load = lambda n: torch.load(tmp_path / f"{n}.pt", map_location="cpu", weights_only=False)  # noqa: E731
    old = torch.load(src, map_location="cpu", weights_only=False)
    a, b, c, big, x3 = load("a"), load("b"), load("c"), load("big"), load("x3")
    matrices = [n for n in old["model"] if n.endswith("feature_map.random_matrix")]
    assert len(matrices) == 4
    for n in old["model"]:
        if n in matrices:
            assert torch.equal(a["model"][n], b["model"][n]) and not torch.equal(a["model"][n], c["model"][n])
            assert not torch.equal(a["model"][n], old["model"][n])
            assert big["model"][n].shape[1] == (100 if "encoder_attn" in n else 80)
            assert x3["model"][n].shape[1] == 3 * old["model"][n].shape[1]
        else:
            assert torch.equal(a["model"][n], old["model"][n])
    out = run_cli("fairseq-generate", mt_data / "bin", "--user-dir", USER_DIR, "--path", tmp_path / "big.pt",
                  "--gen-subset", "test", "--beam", "2", "--max-len-b", "6", "--required-batch-size-multiple", "1",
                  "--cpu")
    assert len(re.findall(r"^H-\d+\t", out, flags=re.M)) == 12
    bad = subprocess.run([script, src, tmp_path / "x.pt", "--seed", "1", "--causal-feature-dim", "0"],
                         capture_output=True, text=True)
    assert bad.returncode != 0 and "--causal-feature-dim" in bad.stderr
