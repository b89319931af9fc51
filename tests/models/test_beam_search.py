"""fairseq's SequenceGenerator over RFA: beam hypotheses re-scored by a full forward pass agree,
and the decoding state does not grow with the output length."""
import pytest
import torch
from fairseq.sequence_generator import SequenceGenerator

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
                                   pytest.param(["--rfa-gate", "--cross-attention", "softmax"], id="gate-softmax-cross")])
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


@pytest.mark.parametrize("extra", [pytest.param([], id="rfa"), pytest.param(["--rfa-gate"], id="rfa-gate")])
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


def test_cross_state_not_copied_per_beam(translation_model):
    task, model = translation_model()
    model.eval()
    sample = _sample(task, batch=3)
    gen = SequenceGenerator([model], task.target_dictionary, beam_size=4, max_len_b=5)
    states = []
    original = model.decoder.forward

    def spy(*args, **kwargs):
        out = original(*args, **kwargs)
        inc = kwargs.get("incremental_state")
        states.append({k: v["state"] if "state" in v else v["k"] for k, v in inc.items() if k.endswith(".cross_rfa")})
        return out

    model.decoder.forward = spy
    with torch.no_grad():
        gen.forward(sample)
    first = states[0]
    assert first and all(S.shape[0] == 3 for S in first.values()), "one cross state per sentence, not per beam"
    # While no sentence has finished the generator only reorders beams within sentences:
    # the same state tensors stay in place (no copy).
    assert all(states[1][k] is first[k] for k in first)


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
            if t + 1 in (1, 16, 1024):
                sizes[t + 1] = _state_bytes(state)
    assert sizes[1] == sizes[16] == sizes[1024] > 0


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
            if t + 1 in (1, 16, 1024):
                sizes[t + 1] = _state_bytes(state)
    assert sizes[1] == sizes[16] == sizes[1024] > 0
