"""fairseq's SequenceGenerator over RFA: beam hypotheses re-scored by a full forward pass agree,
fairseq's way of beam search with fewer copies of the source gives the same hypotheses, and the
decoding state does not grow with the output length."""
import pytest
import torch
from fairseq.models.transformer import TransformerEncoderBase
from fairseq.sequence_generator import SequenceGenerator

from rfa_fairseq.modules import SoftmaxCrossAttention

from rfa_test_utils import random_tokens


def _sample(task, batch=5, src_len=9, seed=0):
    g = torch.Generator().manual_seed(seed)
    pad = task.source_dictionary.pad()
    src = random_tokens(task.source_dictionary, batch, src_len, g)
    lengths = torch.randint(3, src_len + 1, (batch,), generator=g)
    lengths[0] = src_len
    for i, n in enumerate(lengths.tolist()):  # left padding, as fairseq batches sources
        src[i, : src_len - n] = pad
        src[i, src_len - 1] = task.source_dictionary.eos()
    return {"id": torch.arange(batch), "net_input": {"src_tokens": src, "src_lengths": lengths}}


def _rescore(model, task, sample, hypo_tokens, row):
    eos = task.target_dictionary.eos()
    tokens = hypo_tokens.unsqueeze(0)
    prev = torch.cat([tokens.new_tensor([[eos]]), tokens[:, :-1]], dim=1)
    src = sample["net_input"]["src_tokens"][row : row + 1]
    lengths = sample["net_input"]["src_lengths"][row : row + 1]
    with torch.no_grad():
        logits, extra = model(src, lengths, prev)
        lprobs = model.get_normalized_probs((logits, extra), log_probs=True)
    return lprobs[0].gather(-1, tokens[0].unsqueeze(-1)).squeeze(-1)


@pytest.mark.parametrize("extra", [pytest.param([], id="rfa"), pytest.param(["--rfa-gate"], id="rfa-gate"),
                                   pytest.param(["--rfa-gate", "--cross-attention", "softmax"], id="gate-softmax-cross"),
                                   pytest.param(["--rfa-gate", "--rfa-short-conv", "3"], id="gate-conv")])
def test_beam_hypotheses_rescored_by_full_forward(translation_model, extra):
    task, model = translation_model(*extra, rfa_flags="--cross-attention" not in extra)
    model.eval()
    sample = _sample(task)
    # Without training every hypothesis would run to max_len; vary lengths by boosting EOS
    # differently per sentence through the output bias so that sentences finish at different
    # steps and the generator drops finished sentences from the batch (the reorder-by-sentence path).
    with torch.no_grad():
        model.decoder.output_projection.weight[task.target_dictionary.eos()] *= 3.0
    gen = SequenceGenerator([model], task.target_dictionary, beam_size=4, max_len_b=25, min_len=1)
    with torch.no_grad():
        hypos = gen.forward(sample)
    lengths = set()
    for row, nbest in enumerate(hypos):
        assert len(nbest) == 4
        for hypo in nbest:
            lengths.add(len(hypo["tokens"]))
            rescored = _rescore(model, task, sample, hypo["tokens"], row)
            assert (rescored - hypo["positional_scores"]).abs().max().item() <= 1e-4
    assert len(lengths) > 1, "hypotheses of one length do not exercise finished-sentence removal"


@pytest.mark.parametrize("extra", [pytest.param([], id="rfa"), pytest.param(["--rfa-gate"], id="rfa-gate"),
                                   pytest.param(["--rfa-short-conv", "4"], id="rfa-conv")])
def test_lm_beam_hypotheses_rescored_by_full_forward(lm_model, extra):
    """Language-model beam search continues prompts: the generator tells the model its beam, so
    every reorder moves the state rows (with beam 1 a same-size reorder is the identity)."""
    task, model = lm_model(*extra)
    model.eval()
    prompts = random_tokens(task.dictionary, 3, 4, torch.Generator().manual_seed(3))
    sample = {"id": torch.arange(3), "net_input": {"src_tokens": prompts, "src_lengths": torch.full((3,), 4)}}
    with torch.no_grad():
        model.decoder.output_projection.weight[task.dictionary.eos()] *= 3.0
    gen = SequenceGenerator([model], task.target_dictionary, beam_size=4, max_len_b=20, min_len=1)
    assert all(m.beam_size == 4 for m in model.decoder.modules() if hasattr(m, "beam_size"))
    with torch.no_grad():
        hypos = gen.forward(sample, prefix_tokens=prompts)
        for row, nbest in enumerate(hypos):
            assert len(nbest) == 4
            for hypo in nbest:
                tokens = hypo["tokens"].unsqueeze(0)
                prev = torch.cat([tokens.new_tensor([[task.dictionary.eos()]]), tokens[:, :-1]], dim=1)
                lprobs = model.get_normalized_probs(model(prev), log_probs=True)
                rescored = lprobs[0].gather(-1, tokens[0].unsqueeze(-1)).squeeze(-1)
                assert (rescored - hypo["positional_scores"]).abs().max().item() <= 1e-4


@pytest.mark.parametrize("cross", ["rfa", "softmax"])
def test_cross_state_not_copied_per_beam(translation_model, cross):
    task, model = translation_model("--cross-attention", cross, rfa_flags=False)
    model.eval()
    sample = _sample(task, batch=3)
    gen = SequenceGenerator([model], task.target_dictionary, beam_size=4, max_len_b=5)
    states = []
    original = model.decoder.forward

    def spy(*args, **kwargs):
        out = original(*args, **kwargs)
        inc = kwargs.get("incremental_state")
        states.append({k: v["state"] if "state" in v else v["k"] if "k" in v else v["prev_key"] for k, v in inc.items()
                       if k.endswith((".cross_rfa", ".attn_state"))})
        return out

    model.decoder.forward = spy
    with torch.no_grad():
        gen.forward(sample)
    first = states[0]
    assert first and all(S.shape[0] == 3 for S in first.values()), "one cross state per sentence, not per beam"
    # While no sentence has finished the generator only reorders beams within sentences:
    # the state stays in place (no copy; fairseq's attention keeps views of it).
    assert all(states[1][k].data_ptr() == first[k].data_ptr() for k in first)


def _generate_with_copies(model, task, sample, fairseq_way=False):
    """Beam-4 hypotheses, and how many times the encoder output was copied (fairseq's reorder run);
    fairseq_way=True: the reference, reordering the encoder output and keeping the softmax cross
    attention's keys and values per beam, as fairseq's transformer does."""
    with torch.no_grad():
        model.decoder.output_projection.weight[task.target_dictionary.eos()] *= 3.0
    copies, original = [0], TransformerEncoderBase.reorder_encoder_out

    def counted(encoder, encoder_out, new_order):
        copies[0] += 1
        return original(encoder, encoder_out, new_order)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(TransformerEncoderBase, "reorder_encoder_out", counted)
        if fairseq_way:
            m.setattr(model.encoder, "reorder_encoder_out", lambda out, order: counted(model.encoder, out, order))
            m.setattr(SoftmaxCrossAttention, "set_beam_size", lambda self, beam: None)
        gen = SequenceGenerator([model], task.target_dictionary, beam_size=4, max_len_b=25, min_len=1)
        with torch.no_grad():
            return gen.forward(sample), copies[0]


@pytest.mark.parametrize("extra", [pytest.param(["--cross-attention", "softmax"], id="softmax-encoder"),
                                   pytest.param(["--cross-attention", "softmax", "--encoder-attention", "rfa"],
                                                id="rfa-encoder"),
                                   pytest.param(["--cross-attention", "rfa"], id="rfa-cross")])
def test_beam_search_agrees_with_fairseqs_copies(translation_model, extra):
    """Hypotheses and scores are those of fairseq's way, with the encoder output copied once to
    expand the beams and once per step that drops finished sentences (fairseq: after every step),
    and the softmax cross attention's keys and values kept once per sentence."""
    sample = _sample(task := translation_model("--rfa-gate", *extra, rfa_flags=False)[0])
    runs = []
    for fairseq_way in (False, True):
        model = translation_model("--rfa-gate", *extra, rfa_flags=False)[1].eval()
        runs.append(_generate_with_copies(model, task, sample, fairseq_way))
    (ours, copies), (reference, fairseq_copies) = runs
    for a, b in zip(ours, reference):
        for x, y in zip(a, b):
            assert torch.equal(x["tokens"], y["tokens"])
            torch.testing.assert_close(x["positional_scores"], y["positional_scores"], rtol=0, atol=1e-5)
    assert fairseq_copies >= max(len(h["tokens"]) for nbest in reference for h in nbest)
    assert 1 <= copies < fairseq_copies


@pytest.mark.parametrize("extra", [pytest.param(["--cross-attention", "softmax"], id="softmax-cross"),
                                   pytest.param(["--cross-attention", "rfa"], id="rfa-cross"),
                                   pytest.param(["--decoder-attention", "softmax"], id="softmax-decoder")])
def test_decoding_attention_only_when_asked(translation_model, extra):
    """Decoding returns no cross-attention weights by default (the generator then keeps none:
    hypo["attention"] is empty) and writes the same hypotheses; with --decoding-attention,
    hypo["attention"] is fairseq's: the last layer's weights, as a full forward gives them."""
    flags = (["--rfa-gate"] if "--decoder-attention" not in extra else []) + extra
    sample = _sample(task := translation_model(*flags, rfa_flags=False)[0])
    runs = {}
    for asked in (False, True):
        model = translation_model(*flags, *(["--decoding-attention"] if asked else []), rfa_flags=False)[1].eval()
        runs[asked] = _generate_with_copies(model, task, sample)[0]
    for row, (plain, attended) in enumerate(zip(runs[False], runs[True])):
        for x, y in zip(plain, attended):
            assert torch.equal(x["tokens"], y["tokens"])
            torch.testing.assert_close(x["positional_scores"], y["positional_scores"], rtol=0, atol=1e-5)
            assert x["attention"].numel() == 0
            tokens = y["tokens"].unsqueeze(0)
            prev = torch.cat([tokens.new_tensor([[task.target_dictionary.eos()]]), tokens[:, :-1]], dim=1)
            with torch.no_grad():
                _, out = model(sample["net_input"]["src_tokens"][row : row + 1],
                               sample["net_input"]["src_lengths"][row : row + 1], prev)
            torch.testing.assert_close(y["attention"].t(), out["attn"][0][0], rtol=0, atol=1e-5)


def test_encoder_reorder_within_beams_returns_the_output_as_is(translation_model):
    task, model = translation_model("--cross-attention", "softmax", rfa_flags=False)
    model.eval().set_beam_size(2)
    sample = _sample(task, batch=2)
    with torch.no_grad():
        out = model.encoder(**sample["net_input"])
    out = TransformerEncoderBase.reorder_encoder_out(model.encoder, out, torch.tensor([0, 0, 1, 1]))
    assert model.encoder.reorder_encoder_out(out, torch.tensor([1, 0, 3, 2])) is out
    for order in ([0, 1, 3], [2, 3]):  # a finished hypothesis dropped; a finished sentence dropped
        order = torch.tensor(order)
        ours = model.encoder.reorder_encoder_out(out, order)
        reference = TransformerEncoderBase.reorder_encoder_out(model.encoder, out, order)
        assert all(torch.equal(a[0], b[0]) for a, b in zip(ours.values(), reference.values()) if a)


def _state_bytes(state):
    total = 0
    for buffer in state.values():
        for t in buffer.values():
            if isinstance(t, torch.Tensor):  # (a decoding state also holds its length, an int)
                total += t.numel() * t.element_size()
    return total


@pytest.mark.parametrize("extra", [pytest.param([], id="rfa"), pytest.param(["--rfa-gate"], id="rfa-gate")])
def test_lm_state_size_constant_in_length(lm_model, extra):
    task, model = lm_model(*extra)
    model.eval()
    tokens = random_tokens(task.dictionary, 2, 1024, torch.Generator().manual_seed(0))
    state = {}
    sizes = {}
    with torch.no_grad():
        for t in range(1024):
            model.decoder(tokens[:, : t + 1], incremental_state=state)
            if t + 1 in (2, 16, 1024):  # from the second step: the state and the buffer the steps alternate with
                sizes[t + 1] = _state_bytes(state)
    assert sizes[2] == sizes[16] == sizes[1024] > 0


def test_translation_state_size_constant_in_length(translation_model):
    task, model = translation_model("--rfa-gate", "--max-target-positions", "2048")
    model.eval()
    sample = _sample(task, batch=2)
    src, lengths = sample["net_input"]["src_tokens"], sample["net_input"]["src_lengths"]
    prev = random_tokens(task.target_dictionary, 2, 1024, torch.Generator().manual_seed(1))
    state = {}
    sizes = {}
    with torch.no_grad():
        enc = model.encoder(src, src_lengths=lengths)
        for t in range(1024):
            model.decoder(prev[:, : t + 1], encoder_out=enc, incremental_state=state)
            if t + 1 in (2, 16, 1024):  # from the second step: the state and the buffer the steps alternate with
                sizes[t + 1] = _state_bytes(state)
    assert sizes[2] == sizes[16] == sizes[1024] > 0
