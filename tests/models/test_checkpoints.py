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
    """Weights with one kind of cross attention loaded into a model built with the other (as a
    checkpoint saved before --cross-attention existed, which has rfa, into the default softmax)."""
    def model(kind):
        return translation_model("--rfa-gate", "--cross-attention", kind, rfa_flags=False)[1]

    fix = re.escape(f"--cross-attention {saved} (fairseq-train) or --model-overrides \"{{'cross_attention': '{saved}'}}\"")
    with pytest.raises(ValueError, match=f"checkpoint has {saved} cross attention and the model was built with {built}.*{fix}"):
        model(built).load_state_dict(model(saved).state_dict())
    model(saved).load_state_dict(model(saved).state_dict())  # the same kind loads
