"""rfa_transformer with --encoder-attention / --decoder-attention: what each choice builds, that
it trains (finite gradients everywhere), what the defaults build, validation errors, and distinct
random draws."""
import pytest
import torch
from fairseq.models.transformer import TransformerDecoderBase, TransformerEncoderBase
from fairseq.modules import MultiheadAttention

from rfa_fairseq.models import RFATransformerDecoder, RFATransformerModel
from rfa_fairseq.models.rfa_encoder import RFATransformerEncoder, SoftmaxTransformerEncoder
from rfa_fairseq.modules import EncoderRFAttention, LARAttention, SoftmaxCrossAttention
from rfa_test_utils import random_tokens

EXPECTED = {"rfa": EncoderRFAttention, "favor": EncoderRFAttention, "lara": LARAttention}


def batch(task, lengths=(9, 6, 3)):
    """Left-padded sources (fairseq's layout) and targets."""
    g = torch.Generator().manual_seed(0)
    src = random_tokens(task.source_dictionary, len(lengths), max(lengths), g)
    for row, n in enumerate(lengths):
        src[row, : max(lengths) - n] = task.source_dictionary.pad()
    prev = random_tokens(task.target_dictionary, len(lengths), 5, g)
    return src, torch.tensor(lengths), prev


@pytest.mark.parametrize("kind", ["rfa", "favor", "lara"])
@pytest.mark.parametrize("decoder", ["rfa", "softmax"])
def test_each_choice_builds_and_trains(translation_model, kind, decoder):
    extra = ["--encoder-attention", kind, "--decoder-attention", decoder, "--attention-dropout", "0.1"]
    task, model = translation_model(*extra, rfa_flags=decoder == "rfa")
    assert isinstance(model.encoder, RFATransformerEncoder)
    assert all(type(layer.self_attn) is EXPECTED[kind] for layer in model.encoder.layers)
    assert isinstance(model.decoder, RFATransformerDecoder if decoder == "rfa" else TransformerDecoderBase)
    if decoder == "softmax":
        assert not isinstance(model.decoder, RFATransformerDecoder)
    model.train()
    logits, _ = model(*batch(task))
    logits.float().logsumexp(-1).mean().backward()
    for name, p in model.named_parameters():
        if name.startswith("encoder.layers"):
            assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().max() > 0, name


def test_defaults_build_a_softmax_encoder_and_the_rfa_decoder(translation_model):
    """Without the encoder and decoder choices: fairseq's own softmax encoder, the RFA decoder, and a state dict that loads strictly into a model built with
    explicit defaults."""
    task, model = translation_model()
    assert type(model.encoder) is SoftmaxTransformerEncoder and isinstance(model.encoder, TransformerEncoderBase)
    assert isinstance(model.encoder.layers[0].self_attn, MultiheadAttention)
    assert isinstance(model.decoder, RFATransformerDecoder)
    _, explicit = translation_model("--encoder-attention", "softmax", "--decoder-attention", "rfa")
    explicit.load_state_dict(model.state_dict(), strict=True)
    assert model.state_dict().keys() == explicit.state_dict().keys()


def test_checkpoint_round_trip_keeps_encoder_draws(translation_model, tmp_path):
    task, model = translation_model("--encoder-attention", "favor", "--encoder-feature-dim", "16")
    model.eval()
    src = batch(task)
    expected = model(*src)[0]
    torch.save(model.state_dict(), tmp_path / "m.pt")
    _, other = translation_model("--encoder-attention", "favor", "--encoder-feature-dim", "16", "--seed", "9")
    other.encoder.layers[0].self_attn.feature_map.redraw(seed=5)
    other.load_state_dict(torch.load(tmp_path / "m.pt", weights_only=True))
    other.eval()
    torch.testing.assert_close(other(*src)[0], expected)


def test_encoder_draws_differ_from_decoder_draws(translation_model):
    _, model = translation_model("--encoder-attention", "rfa", "--encoder-feature-dim", "64",
                                 "--rfa-causal-feature-dim", "64", "--rfa-cross-feature-dim", "64")
    matrices = [layer.self_attn.feature_map.random_matrix for layer in model.encoder.layers]
    matrices += [m.feature_map.random_matrix for layer in model.decoder.layers for m in (layer.self_attn, layer.encoder_attn)]
    for i in range(len(matrices)):
        for j in range(i):
            assert not torch.equal(matrices[i], matrices[j]), (i, j)


def test_padding_does_not_change_encoder_output(translation_model):
    """The same sentence alone and in a left-padded batch encodes to the same vectors."""
    for kind in ("rfa", "favor", "lara"):
        task, model = translation_model("--encoder-attention", kind, "--lara-landmarks" if kind == "lara" else "--seed",
                                        "4" if kind == "lara" else "1")
        model.eval()
        src, lengths, _ = batch(task, lengths=(9, 5))
        both = model.encoder(src, lengths)["encoder_out"][0]
        alone = model.encoder(src[1:, 4:], lengths[1:])["encoder_out"][0]
        torch.testing.assert_close(both[4:, 1:], alone, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("extra,match", [
    (["--encoder-attention", "lara", "--lara-landmarks", "0"], "--lara-landmarks must be a positive integer"),
    (["--encoder-feature-dim", "32"], "--encoder-feature-dim .* does nothing with --encoder-attention softmax"),
    (["--encoder-attention", "lara", "--encoder-feature-dim", "32"], "--encoder-feature-dim .*--lara-landmarks"),
    (["--encoder-attention", "favor", "--lara-landmarks", "8"], "--lara-landmarks needs --encoder-attention lara"),
    (["--decoder-attention", "softmax", "--rfa-gate"], "--rfa-gate shapes the RFA decoder"),
    (["--rfa-cross-feature-dim", "32"], "--rfa-cross-feature-dim shapes RFA cross attention"),  # softmax: default
    (["--decoder-attention", "softmax", "--cross-attention", "rfa"], "--cross-attention rfa shapes the RFA decoder"),
    (["--encoder-attention", "rfa", "--encoder-attention-heads", "5"], "--encoder-embed-dim .* divisible"),
])
def test_bad_flags_are_refused_by_name(translation_model, extra, match):
    with pytest.raises(ValueError, match=match):
        translation_model(*extra, rfa_flags=False)


def test_softmax_cross_attention_builds_fairseqs_module(translation_model):
    """The default, --cross-attention softmax: fairseq's MultiheadAttention as cross attention
    behind RFA self-attention, trained through (finite gradients reach the encoder); a beam search's
    beam leaves a whole target's forward as it was (fairseq's own beam path would not)."""
    task, model = translation_model("--rfa-gate", rfa_flags=False)
    assert isinstance(model.decoder, RFATransformerDecoder)
    for layer in model.decoder.layers:
        assert type(layer.encoder_attn) is SoftmaxCrossAttention and not isinstance(layer.self_attn, MultiheadAttention)
    model.eval()
    sample = batch(task, lengths=(9, 6, 3, 5))
    with torch.no_grad():
        before = model(*sample)[0]
        model.set_beam_size(2)
        assert torch.equal(model(*sample)[0], before)
        for layer in model.decoder.layers:
            layer.encoder_attn.__class__ = MultiheadAttention  # fairseq's module, beam 2 set
        assert not torch.allclose(model(*sample)[0], before)
    model = translation_model("--rfa-gate", rfa_flags=False)[1]
    model.train()
    logits, _ = model(*batch(task))
    logits.float().logsumexp(-1).mean().backward()
    grads = [p.grad for name, p in model.named_parameters() if name.startswith("encoder.layers")]
    assert all(g is not None and torch.isfinite(g).all() for g in grads) and any(g.abs().max() > 0 for g in grads)


def test_unknown_choice_is_refused_by_argparse(translation_model):
    with pytest.raises(SystemExit):
        translation_model("--encoder-attention", "performer")


def test_feature_dim_with_softmax_at_its_default_is_accepted(translation_model):
    _, model = translation_model("--encoder-feature-dim", "64", "--lara-landmarks", "16")
    assert type(model.encoder) is SoftmaxTransformerEncoder  # fairseq's, with no weights added


@pytest.mark.parametrize("kind", ["rfa", "favor", "lara"])
def test_each_encoder_learns_a_batch(translation_model, kind):
    """Forty Adam steps on one batch whose rows share their decoder input and differ only in the
    source, which the targets copy: the loss falls far below log(3) (the best without the source),
    so training goes through the linear encoder, not around it."""
    task, model = translation_model("--encoder-attention", kind)
    src, lengths, prev = batch(task)
    prev = prev[:1].expand_as(prev).contiguous()
    target = src[:, -5:]
    model.train()
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(40):
        optimizer.zero_grad()
        logits, _ = model(src, lengths, prev)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1))
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.2, losses[::8]
