"""Incremental decoding (one token at a time, state in incremental_state) equals the full pass."""
import pytest
import torch

from rfa_test_utils import random_tokens

VARIANTS = [
    pytest.param([], id="rfa"),
    pytest.param(["--rfa-gate"], id="rfa-gate"),
    pytest.param(["--rfa-kernel", "arccos"], id="arccos"),
    pytest.param(["--rfa-gate", "--rfa-random-matrix", "gaussian"], id="gate-gaussian-matrix"),
    pytest.param(["--rfa-gate", "--rfa-gate-form", "decay", "--rfa-gate-bias", "2"], id="gate-decay-bias2"),
    pytest.param(["--rfa-gate", "--rfa-kernel", "favor"], id="gate-favor"),
    pytest.param(["--rfa-kernel", "elu"], id="elu"),
    pytest.param(["--rfa-eps", "1.5"], id="eps1.5"),
]


def _incremental_logits(decoder, prev, encoder_out=None):
    state = {}
    steps = []
    for t in range(prev.size(1)):
        logits, _ = decoder(prev[:, : t + 1], encoder_out=encoder_out, incremental_state=state)
        steps.append(logits[:, -1])
    return torch.stack(steps, dim=1)


# fairseq's softmax cross attention behind the RFA self-attention (no --rfa-cross-* sizes)
SOFTMAX_CROSS = ["--cross-attention", "softmax", "--rfa-causal-feature-dim", "64", "--rfa-chunk-size", "8"]


@pytest.mark.parametrize("extra", VARIANTS + [pytest.param(SOFTMAX_CROSS + ["--rfa-gate"], id="gate-softmax-cross")])
def test_translation_incremental_matches_full(translation_model, extra):
    task, model = translation_model(*extra, rfa_flags="--cross-attention" not in extra)
    model.eval()
    g = torch.Generator().manual_seed(1)
    src = random_tokens(task.source_dictionary, 3, 11, g)
    src[0, :4] = task.source_dictionary.pad()  # a left-padded source (fairseq's default)
    lengths = src.ne(task.source_dictionary.pad()).sum(1)
    prev = random_tokens(task.target_dictionary, 3, 19, g)
    prev[:, 0] = task.target_dictionary.eos()
    with torch.no_grad():
        full, _ = model(src, lengths, prev)
        enc = model.encoder(src, src_lengths=lengths)
        incr = _incremental_logits(model.decoder, prev, enc)
    assert full.shape == incr.shape
    assert (full - incr).abs().max().item() <= 1e-5


@pytest.mark.parametrize("extra", VARIANTS)
def test_lm_incremental_matches_full(lm_model, extra):
    task, model = lm_model(*extra)
    model.eval()
    tokens = random_tokens(task.dictionary, 2, 150, torch.Generator().manual_seed(2))
    with torch.no_grad():
        full, _ = model(tokens)
        incr = _incremental_logits(model.decoder, tokens)
    assert (full - incr).abs().max().item() <= 1e-5


def test_lm_multi_token_incremental_call(lm_model):
    """A call with several new tokens (chunked form with an initial state) continues the state."""
    task, model = lm_model("--rfa-gate")
    model.eval()
    with torch.no_grad():
        layer = model.decoder.layers[0].self_attn
        x = torch.randn(40, 2, 32)
        whole, _ = layer(x)
        state = {}
        first, _ = layer(x[:23], incremental_state=state)
        second, _ = layer(x[23:], incremental_state=state)
    assert (torch.cat([first, second]) - whole).abs().max().item() <= 1e-5


def test_training_mode_redraws_and_eval_keeps_features(lm_model):
    task, model = lm_model()
    fmap = model.decoder.layers[0].self_attn.feature_map
    tokens = random_tokens(task.dictionary, 2, 9)
    model.eval()
    before = fmap.random_matrix.clone()
    model(tokens)
    assert torch.equal(before, fmap.random_matrix), "evaluation must not redraw random features"
    model.train()
    model.set_num_updates(5)
    model(tokens)
    drawn = fmap.random_matrix.clone()
    assert not torch.equal(before, drawn), "a new training step must redraw"
    model(tokens)
    assert torch.equal(drawn, fmap.random_matrix), "same step, same features"
    other = model.decoder.layers[1].self_attn.feature_map.random_matrix
    assert not torch.equal(drawn, other), "layers draw different matrices"
