"""rfa-convert-from-softmax: softmax transformer checkpoints (translation and language
model, current and legacy format) become RFA checkpoints with every shared weight copied, that
fairseq-generate (beam search), fairseq-eval-lm and fairseq-train --finetune-from-model accept;
non-transformer and already-RFA inputs are refused by name."""
import argparse
import re

import pytest
import torch

from rfa_fairseq.cli import convert_from_softmax
from rfa_test_utils import USER_DIR, multi30k_bin, run_cli

pytestmark = pytest.mark.slow  # trains softmax models with fairseq-train

DIMS = ["--decoder-layers", "2", "--decoder-embed-dim", "32", "--decoder-ffn-embed-dim", "64",
        "--decoder-attention-heads", "4"]
ENCODER = ["--encoder-layers", "2", "--encoder-embed-dim", "32", "--encoder-ffn-embed-dim", "64",
           "--encoder-attention-heads", "4"]
TRAIN = ["--optimizer", "adam", "--lr", "1e-3", "--max-tokens", "1500", "--no-progress-bar", "--cpu",
         "--num-workers", "0", "--seed", "3", "--max-update", "3"]
RFA_ONLY = re.compile(r"(feature_map\.(sigma|random_matrix)|self_attn\.in_proj\.(weight|bias)|rfa_version)$")


@pytest.fixture(scope="module")
def softmax(tmp_path_factory):
    """Tiny softmax checkpoints trained by fairseq-train: translation (de-en) and language model."""
    d = tmp_path_factory.mktemp("softmax")
    multi30k_bin(d, (("train", 300), ("valid", 40), ("test", 12)), "mt", "--thresholdsrc", "2")
    run_cli("fairseq-preprocess", "--only-source", "--trainpref", d / "train.en", "--validpref", d / "valid.en",
            "--testpref", d / "test.en", "--destdir", d / "lm", "--workers", "1")
    run_cli("fairseq-train", d / "mt", "--arch", "transformer_iwslt_de_en", "--share-all-embeddings", *ENCODER, *DIMS,
            *TRAIN, "--save-dir", d / "mt_ckpt")
    run_cli("fairseq-train", d / "lm", "--task", "language_modeling", "--arch", "transformer_lm",
            "--tokens-per-sample", "32", *DIMS, *TRAIN, "--save-dir", d / "lm_ckpt")
    return {"dir": d, "mt": d / "mt_ckpt" / "checkpoint_last.pt", "lm": d / "lm_ckpt" / "checkpoint_last.pt"}


def convert(src, dst, *flags):
    convert_from_softmax.main(["--input", str(src), "--output", str(dst), *map(str, flags)])
    return torch.load(dst, weights_only=True)


def assert_shared_weights_copied(source_weights, converted):
    weights = converted["model"]
    for name, tensor in source_weights.items():
        layer, proj, part = (["", ""] + name.rsplit(".", 2))[-3:]
        if f"{layer}.in_proj.{part}" in weights and proj in ("q_proj", "k_proj", "v_proj"):  # causal RFA's rows
            rows = tensor.size(0)
            assert torch.equal(weights[f"{layer}.in_proj.{part}"][rows * "qkv".index(proj[0]):][:rows], tensor), name
            continue
        assert torch.equal(weights[name], tensor), f"{name} not copied"
    extra = sorted(set(weights) - set(source_weights))
    assert extra and all(RFA_ONLY.search(n) for n in extra), extra


@pytest.mark.parametrize("kind,arch", [("mt", "rfa_transformer_iwslt_de_en"), ("lm", "rfa_transformer_lm")])
def test_converted_weights_equal_the_source(softmax, tmp_path, kind, arch):
    out = convert(softmax[kind], tmp_path / "rfa.pt", "--rfa-gate", "--rfa-gate-bias", "2", "--rfa-causal-feature-dim", "16")
    source = torch.load(softmax[kind], weights_only=True)
    assert_shared_weights_copied(source["model"], out)
    model_cfg = out["cfg"]["model"]
    get = (lambda n: getattr(model_cfg, n)) if isinstance(model_cfg, argparse.Namespace) else model_cfg.get
    assert get("_name") == arch and get("rfa_gate") is True and get("rfa_gate_bias") == 2.0
    gate_bias = [v[-4:] for n, v in out["model"].items() if n.endswith("self_attn.in_proj.bias")]  # 4 heads
    assert len(gate_bias) == 2 and all(torch.all(b == 2.0) for b in gate_bias)
    assert all(v.size(1) == 16 for n, v in out["model"].items() if n.endswith("self_attn.feature_map.random_matrix"))
    assert out["cfg"]["task"] == source["cfg"]["task"], "dictionaries and task arguments are the source's"


@pytest.mark.parametrize("cross", [[], ["--cross-attention", "rfa"]], ids=["softmax-cross", "rfa-cross"])
def test_converted_translation_decodes_with_beam_search_and_finetunes(softmax, tmp_path, cross):
    rfa = tmp_path / "rfa.pt"
    convert(softmax["mt"], rfa, "--rfa-gate", *cross)
    out = run_cli("fairseq-generate", softmax["dir"] / "mt", "--user-dir", USER_DIR, "--path", rfa, "--beam", "4",
                  "--batch-size", "4", "--required-batch-size-multiple", "1", "--max-len-b", "20", "--cpu")
    assert len(re.findall(r"^H-\d+", out, re.M)) == 12 and "BLEU4" in out
    log = run_cli("fairseq-train", softmax["dir"] / "mt", "--user-dir", USER_DIR, "--arch", "rfa_transformer_iwslt_de_en",
                  "--rfa-gate", *cross, "--share-all-embeddings", *ENCODER, *DIMS, *TRAIN[:-2], "--max-update", "2",
                  "--finetune-from-model", rfa, "--save-dir", tmp_path / "ft")
    assert "Loaded checkpoint" in log and "num_updates 2" in log
    tuned = torch.load(tmp_path / "ft" / "checkpoint_last.pt", weights_only=True)["model"]
    start = torch.load(rfa, weights_only=True)["model"]
    name = "encoder.layers.0.fc1.weight"
    assert not torch.equal(tuned[name], start[name]) and (tuned[name] - start[name]).abs().max() < 0.1, \
        "finetuning starts from the converted weights"


def test_cross_attention_is_kept_as_trained_unless_rfa_is_asked_for(softmax, tmp_path):
    """By default the decoder's cross attention stays fairseq's, its weights the source's: only
    self-attention gains RFA parameters. --cross-attention rfa gives it RFA parameters too. A
    language model has no cross attention to choose."""
    source = torch.load(softmax["mt"], weights_only=True)
    for cross, kind in (([], "softmax"), (["--cross-attention", "rfa"], "rfa")):
        out = convert(softmax["mt"], tmp_path / "rfa.pt", "--rfa-gate", *cross)
        assert_shared_weights_copied(source["model"], out)
        assert any(".encoder_attn.feature_map" in n for n in out["model"]) == (kind == "rfa")
        assert vars(out["cfg"]["model"])["cross_attention"] == kind  # fairseq-train saved a Namespace
    with pytest.raises(SystemExit, match="--cross-attention and --decoder-attention apply to translation models"):
        convert(softmax["lm"], tmp_path / "lm.pt", "--cross-attention", "softmax")


def test_softmax_decoder_kept_decodes_as_the_source(softmax, tmp_path):
    """--decoder-attention softmax: every weight as it was and none added; fairseq-generate writes
    the source model's hypotheses (the plugin's cross attention: one copy of the source per sentence)."""
    plugin = tmp_path / "plugin.pt"
    out = convert(softmax["mt"], plugin, "--decoder-attention", "softmax")
    assert set(out["model"]) == set(torch.load(softmax["mt"], weights_only=True)["model"])
    generate = ["--beam", "4", "--batch-size", "4", "--required-batch-size-multiple", "1", "--max-len-b", "20", "--cpu"]
    hyps = [sorted(re.findall(r"^H-(\d+)\t(\S+)\t(.*)$", run_cli("fairseq-generate", softmax["dir"] / "mt", "--user-dir",
                                                                 USER_DIR, "--path", path, *generate), re.M))
            for path in (softmax["mt"], plugin)]
    assert len(hyps[0]) == 12 and [(i, text) for i, _, text in hyps[0]] == [(i, text) for i, _, text in hyps[1]]
    assert all(abs(float(a[1]) - float(b[1])) < 1e-5 for a, b in zip(*hyps))  # summed in another order
    with pytest.raises(SystemExit, match="--rfa-gate"):
        convert(softmax["mt"], tmp_path / "x.pt", "--decoder-attention", "softmax", "--rfa-gate")


def test_converted_language_model_evaluates_with_and_without_state(softmax, tmp_path):
    rfa = tmp_path / "rfa.pt"
    convert(softmax["lm"], rfa, "--rfa-gate")
    for task in ("language_modeling", "rfa_stateful_lm"):
        out = run_cli("fairseq-eval-lm", softmax["dir"] / "lm", "--user-dir", USER_DIR, "--task", task, "--path", rfa,
                      "--gen-subset", "test", "--tokens-per-sample", "32", "--max-tokens", "2048", "--cpu")
        assert re.search(r"Perplexity: [\d.]+", out), out[-2000:]


def test_legacy_namespace_checkpoint_converts(softmax, tmp_path):
    """Arguments as an argparse Namespace under 'args' (no 'cfg'), and the old key layout that
    fairseq upgrades on load (fused in_proj of the encoder's attention, layer_norms.N)."""
    state = torch.load(softmax["mt"], weights_only=True)
    modern = dict(state["model"])
    weights = dict(modern)
    for i in range(2):
        p = f"encoder.layers.{i}.self_attn."
        for part in ("weight", "bias"):
            weights[p + "in_proj_" + part] = torch.cat([weights.pop(p + f"{x}_proj.{part}") for x in "qkv"])
        for old, new in (("0", "self_attn_layer_norm"), ("1", "encoder_attn_layer_norm"), ("2", "final_layer_norm")):
            for part in ("weight", "bias"):
                weights[f"decoder.layers.{i}.layer_norms.{old}.{part}"] = weights.pop(f"decoder.layers.{i}.{new}.{part}")
    legacy = {"args": state["cfg"]["model"], "model": weights, "optimizer_history": state["optimizer_history"],
              "extra_state": state["extra_state"]}
    torch.save(legacy, tmp_path / "legacy.pt")
    out = convert(tmp_path / "legacy.pt", tmp_path / "rfa.pt")
    assert_shared_weights_copied(modern, out)


def test_refuses_rfa_and_non_transformer_checkpoints(softmax, tmp_path, capsys):
    rfa = tmp_path / "rfa.pt"
    convert(softmax["lm"], rfa)
    with pytest.raises(SystemExit, match="already an RFA model"):
        convert(rfa, tmp_path / "again.pt")
    state = torch.load(softmax["lm"], weights_only=True)
    state["cfg"]["model"]["_name"] = "lstm_lm"
    torch.save(state, tmp_path / "lstm.pt")
    with pytest.raises(SystemExit, match="'lstm_lm' .*is not a fairseq softmax transformer"):
        convert(tmp_path / "lstm.pt", tmp_path / "out.pt")
    with pytest.raises(SystemExit, match="--rfa-gate-bias.*need --rfa-gate"):
        convert(softmax["lm"], tmp_path / "out.pt", "--rfa-gate-bias", "3")
    assert not (tmp_path / "out.pt").exists()


def test_loading_softmax_into_rfa_points_to_the_conversion(softmax, tmp_path):
    proc = run_cli("fairseq-eval-lm", softmax["dir"] / "lm", "--user-dir", USER_DIR, "--path", softmax["lm"],
                   "--model-overrides", "{'_name': 'rfa_transformer_lm'}", "--gen-subset", "test",
                   "--tokens-per-sample", "32", "--max-tokens", "2048", "--cpu", check=False)
    assert proc.returncode != 0 and "rfa-convert-from-softmax" in proc.stderr, proc.stderr[-2000:]
