"""Checkpoint safety: weights_only loading refuses foreign pickled objects, the RFA format
version is checked and upgraded, and softmax/RFA checkpoints are not silently mixed."""
import collections
import pickle
import re

import pytest
import torch
from fairseq import checkpoint_utils

import rfa_fairseq  # noqa: F401  (allow-list)
from rfa_fairseq.models import RFA_CHECKPOINT_VERSION


class Payload:
    """Stands for any object a tampered checkpoint might carry."""

    def __reduce__(self):
        return (print, ("code ran while unpickling",))


def test_checkpoint_with_foreign_object_is_refused(translation_model, tmp_path):
    _, model = translation_model()
    path = tmp_path / "tampered.pt"
    torch.save({"model": model.state_dict(), "args": None, "extra": Payload()}, path)
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        checkpoint_utils.load_checkpoint_to_cpu(str(path))


def test_checkpoint_with_allowed_contents_loads(translation_model, tmp_path):
    import argparse

    _, model = translation_model()
    path = tmp_path / "ok.pt"
    torch.save({"model": model.state_dict(), "args": argparse.Namespace(arch="rfa_transformer"),
                "optimizer_history": [collections.OrderedDict(num_updates=3)]}, path)
    state = torch.load(path, map_location="cpu", weights_only=True)
    assert state["args"].arch == "rfa_transformer"


def test_unversioned_rfa_state_dict_is_upgraded(translation_model):
    _, model = translation_model()
    state = model.state_dict()
    del state["decoder.rfa_version"]
    upgraded = model.decoder.upgrade_state_dict_named(dict(state), "decoder")
    assert int(upgraded["decoder.rfa_version"][0]) == RFA_CHECKPOINT_VERSION
    model.load_state_dict(upgraded)


def test_newer_format_version_is_refused(translation_model):
    _, model = translation_model()
    state = model.state_dict()
    state["decoder.rfa_version"] = torch.tensor([RFA_CHECKPOINT_VERSION + 1])
    with pytest.raises(RuntimeError, match="newer than this rfa_fairseq"):
        model.decoder.upgrade_state_dict_named(state, "decoder")


def test_softmax_checkpoint_into_rfa_is_refused(translation_model):
    task, rfa = translation_model()
    _, softmax = translation_model(arch="transformer_iwslt_de_en", rfa_flags=False)
    state = softmax.state_dict()
    with pytest.raises(RuntimeError, match="softmax-attention decoder.*explicit conversion"):
        rfa.upgrade_state_dict(state)


def test_rfa_checkpoint_into_softmax_is_refused(translation_model):
    _, rfa = translation_model()
    _, softmax = translation_model(arch="transformer_iwslt_de_en", rfa_flags=False)
    with pytest.raises(RuntimeError, match="feature_map"):
        softmax.load_state_dict(rfa.state_dict(), strict=True)


def test_rfa_checkpoint_round_trip_keeps_random_features(translation_model, tmp_path):
    _, model = translation_model("--rfa-gate")
    path = tmp_path / "m.pt"
    torch.save(model.state_dict(), path)
    _, other = translation_model("--rfa-gate", "--seed", "7")
    other.decoder.layers[0].self_attn.feature_map.redraw(seed=123)
    other.load_state_dict(torch.load(path, weights_only=True))
    for a, b in zip(model.decoder.layers, other.decoder.layers):
        assert torch.equal(a.self_attn.feature_map.random_matrix, b.self_attn.feature_map.random_matrix)
        assert torch.equal(a.encoder_attn.feature_map.random_matrix, b.encoder_attn.feature_map.random_matrix)


@pytest.mark.parametrize("saved,built", [("rfa", "softmax"), ("softmax", "rfa")])
def test_cross_attention_mismatch_names_the_flag_that_loads_it(translation_model, saved, built):
    """Weights with one kind of cross attention loaded into a model built with the other (a
    checkpoint finetuned or decoded with another --cross-attention than it was trained with)."""
    def model(kind):
        return translation_model("--rfa-gate", "--cross-attention", kind, rfa_flags=False)[1]

    fix = re.escape(f"--cross-attention {saved} (fairseq-train) or --model-overrides \"{{'cross_attention': '{saved}'}}\"")
    with pytest.raises(ValueError, match=f"checkpoint has {saved} cross attention and the model was built with {built}.*{fix}"):
        model(built).load_state_dict(model(saved).state_dict())
    model(saved).load_state_dict(model(saved).state_dict())  # the same kind loads


def test_a_saved_checkpoint_loads_and_decodes_identically(tmp_path):
    """A checkpoint of the current format (fairseq's layout: the config as a plain container, the
    state dict with its rfa_version) loads through fairseq's loader into the same model: the same
    arguments, the same weights and random draws, the same beam search hypotheses and scores."""
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf
    from fairseq.sequence_generator import SequenceGenerator
    from omegaconf import OmegaConf

    from rfa_test_utils import TINY_ENCODER, TINY_MODEL, build_from_cli, random_tokens, write_dict

    write_dict(tmp_path / "dict.de.txt", 46)
    write_dict(tmp_path / "dict.en.txt", 46)
    torch.manual_seed(0)
    task, model, args = build_from_cli(tmp_path, ["--task", "translation", "--source-lang", "de", "--target-lang",
                                                  "en", "--arch", "rfa_transformer", "--rfa-gate", "--cross-attention", "rfa"]
                                       + TINY_ENCODER + TINY_MODEL)
    cfg = OmegaConf.to_container(convert_namespace_to_omegaconf(args), resolve=True, enum_to_str=True)
    path = tmp_path / "checkpoint_last.pt"
    torch.save({"cfg": cfg, "model": model.state_dict(), "extra_state": {},
                "optimizer_history": [{"criterion_name": "CrossEntropyCriterion", "optimizer_name": "Adam",
                                       "lr_scheduler_state": {}, "num_updates": 0}]}, path)

    (loaded,), saved_cfg, _ = checkpoint_utils.load_model_ensemble_and_task([str(path)])
    assert saved_cfg.model.rfa_gate is True and saved_cfg.model.cross_attention == "rfa"
    assert int(loaded.decoder.rfa_version[0]) == RFA_CHECKPOINT_VERSION
    assert model.state_dict().keys() == loaded.state_dict().keys()
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, loaded.state_dict()[name]), name

    src = random_tokens(task.source_dictionary, 3, 9, torch.Generator().manual_seed(1))
    sample = {"net_input": {"src_tokens": src, "src_lengths": torch.full((3,), 9)}}
    hyps = []
    for m in (model, loaded):
        m.eval()
        generator = SequenceGenerator([m], task.target_dictionary, beam_size=3, max_len_b=12)
        hyps.append(generator.generate([m], sample))
    for a, b in zip(*hyps):
        for x, y in zip(a, b):
            assert torch.equal(x["tokens"], y["tokens"]) and torch.equal(x["score"], y["score"])
