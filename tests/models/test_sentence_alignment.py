"""Sentence-aligned decoding (models with ``--sentence-index``): a step forbids ``</s>`` while a row has written fewer
separators than its source has, and ``<sep>`` once it has written as many, both while a sentence is shorter than
the decoder's ``sentence_min`` of its source sentence's length, and ends a sentence as long as the limit (SENTENCE_LENGTH) of it, as a
naive count over the tokens says; so beam search and sampling write one sentence per source sentence, however eager the
model is to end, to split or to go on; the other tokens keep their scores; ``--no-sentence-alignment`` turns it off."""
import math

import pytest
import torch
from fairseq.sequence_generator import SequenceGenerator

from rfa_fairseq.inference import to_decoding_form_
from rfa_fairseq.models import rfa_decoder
from rfa_fairseq.models.rfa_decoder import FORBIDDEN_EOS
from rfa_fairseq.tasks import CompiledSearch

from rfa_test_utils import random_tokens

RFA_GATE = ["--cross-attention", "softmax", "--rfa-gate"]
DECODERS = [pytest.param(RFA_GATE, id="rfa-gate"), pytest.param(RFA_GATE + ["--cross-sentence-window", "1"], id="window"),
            pytest.param(["--decoder-attention", "softmax"], id="softmax")]


def _documents(task, sep, sentences, length=24, seed=0):
    """One source a row, with ``sentences[i]`` sentences (separators spread over its tokens), left-padded."""
    d = task.source_dictionary
    src = torch.full((len(sentences), length), d.pad())
    for i, n in enumerate(sentences):
        tokens = random_tokens(d, 1, length - 2 * i - 1, torch.Generator().manual_seed(seed + i))[0]
        tokens[tokens == sep] = d.unk()
        for j in range(1, n):
            tokens[j * tokens.numel() // n] = sep
        src[i, length - tokens.numel() - 1:-1], src[i, -1] = tokens, d.eos()
    return src, src.ne(d.pad()).sum(1)


def naive_forbidden(src, prefix, sep, eos, pad, least):
    """Per row, the tokens a step after ``prefix`` forbids, and the one it forces (None if none): one row at a time."""
    a, b = rfa_decoder.SENTENCE_LENGTH
    out = []
    for s, p in zip(src.tolist(), prefix.tolist()):
        have, written = s.count(sep), p.count(sep)
        lengths, n = [], 0  # the source sentences' tokens, with the <sep> or </s> that ends each
        for t in s:
            n += t != pad
            if t in (sep, eos):
                lengths, n = lengths + [n], 0
        since = len(p) - 1 - max([0] + [i for i, t in enumerate(p) if t == sep])  # tokens since the last <sep>
        ending, m = eos if written >= have else sep, lengths[min(written, have)]
        forbidden = {eos, sep} if since < least * m else {eos} if written < have else {sep}
        out.append((forbidden, ending if since >= a * m + b else None))
    return out


@pytest.mark.parametrize("extra", DECODERS)
@pytest.mark.parametrize("limit", [None, (0.5, 1.0), 0.0, 0.3],
                         ids=["default", "tight-limit", "no-least", "least-0.3"])
def test_a_step_forbids_what_the_naive_count_says_and_keeps_the_other_scores(documents_model, extra, limit,
                                                                             monkeypatch):
    if isinstance(limit, tuple):
        monkeypatch.setattr(rfa_decoder, "SENTENCE_LENGTH", limit)
    task, model, sep = documents_model("--sentence-index", *extra)
    if isinstance(limit, float):  # the floor a model keeps (--sentence-min)
        model.decoder.sentence_min = limit
    eos, beam = task.target_dictionary.eos(), 2
    src, lengths = _documents(task, sep, [3, 1, 4])
    rows = torch.arange(3).repeat_interleave(beam)
    prefix = random_tokens(task.target_dictionary, 6, 7, torch.Generator().manual_seed(4))
    prefix[:, 0] = eos
    prefix[[0, 2, 3, 4, 4, 5], [2, 5, 1, 3, 6, 2]] = sep  # rows with 0, 1 and 2 separators written
    model.decoder.set_beam_size(beam)
    with torch.no_grad():
        full = model.get_normalized_probs(model(src[rows], lengths[rows], prefix), log_probs=True)
        enc = model.encoder.reorder_encoder_out(model.encoder(src, src_lengths=lengths), rows)
        state, forced, both = {}, 0, 0
        for t in range(prefix.size(1)):
            step = model.get_normalized_probs(model.decoder(prefix[:, :t + 1], encoder_out=enc, incremental_state=state),
                                              log_probs=True)[:, -1]
            naive = naive_forbidden(src[rows], prefix[:, :t + 1], sep, eos, task.source_dictionary.pad(),
                                    model.decoder.sentence_min)
            for row, (forbidden, force) in enumerate(naive):
                if force is not None:  # one token left, with its score (and </s> as forbidden, for the length limit)
                    forced += 1
                    left = {force, eos} if force == sep else {force}
                    assert set(step[row].isfinite().nonzero()[:, 0].tolist()) == left, f"step {t}, row {row}"
                    assert force == eos or step[row, eos] == FORBIDDEN_EOS
                    torch.testing.assert_close(step[row, force], full[row, t, force], rtol=1e-5, atol=1e-5)
                    continue
                got = {v for v in (eos, sep) if step[row, v] == (FORBIDDEN_EOS if v == eos else float("-inf"))}
                assert got == forbidden, f"step {t}, row {row}"
                both += len(forbidden) == 2
                keep = torch.ones_like(step[row], dtype=torch.bool)
                keep[list(forbidden)] = False
                torch.testing.assert_close(step[row][keep], full[row, t][keep], rtol=1e-5, atol=1e-5)
    assert (forced > 0) == isinstance(limit, tuple)  # the tight limit ends sentences, the default none of these
    assert (both > 0) == (model.decoder.sentence_min > 0)  # a sentence too short to end: </s> and <sep> forbidden


@pytest.mark.parametrize("extra", DECODERS)
@pytest.mark.parametrize("engine", ["eager", "compiled"])
def test_beam_search_writes_one_sentence_per_source_sentence(documents_model, extra, engine):
    if engine == "compiled" and "softmax" in extra and "--decoder-attention" in extra:
        pytest.skip("the compiled step is RFA's")
    task, model, sep = documents_model("--sentence-index", *extra)
    eos = task.target_dictionary.eos()
    with torch.no_grad():  # a model that ends early and opens sentences often
        model.decoder.output_projection.weight[eos] *= 4.0
        model.decoder.output_projection.weight[sep] *= 3.0
    if engine == "compiled":
        to_decoding_form_(model, compiled_step=True)
    sentences = [4, 1, 2, 6]
    src, lengths = _documents(task, sep, sentences)
    search = CompiledSearch if engine == "compiled" else SequenceGenerator  # compiled: the search in C++ too
    gen = search([model], task.target_dictionary, beam_size=3, max_len_b=200)
    with torch.no_grad():
        hypos = gen.forward({"id": torch.arange(4), "net_input": {"src_tokens": src, "src_lengths": lengths}})
    for n, nbest in zip(sentences, hypos):
        for h in nbest:
            assert int((h["tokens"] == sep).sum()) == n - 1 and h["tokens"][-1] == eos
            assert h["positional_scores"][-1] > FORBIDDEN_EOS  # none ended at the length limit


@pytest.mark.parametrize("extra", DECODERS)
@pytest.mark.parametrize("push", [-30.0, 30.0], ids=["never-ends", "always-ends"])
def test_a_model_that_never_or_always_ends_a_sentence_writes_each_between_the_bounds(documents_model, extra, push):
    task, model, sep = documents_model("--sentence-index", *extra)
    eos = task.target_dictionary.eos()

    def push_ends(module, args, logits):  # <sep> and </s> far below (a loop inside a sentence) or above every token
        return logits.index_add(-1, torch.tensor([sep, eos]), torch.full((*logits.shape[:-1], 2), push))
    model.decoder.output_projection.register_forward_hook(push_ends)
    sentences = [4, 1, 3]
    src, lengths = _documents(task, sep, sentences)
    gen = SequenceGenerator([model], task.target_dictionary, beam_size=3, max_len_b=200)
    with torch.no_grad():
        hypos = gen.forward({"id": torch.arange(3), "net_input": {"src_tokens": src, "src_lengths": lengths}})
    a, b = rfa_decoder.SENTENCE_LENGTH
    bound = (lambda m: math.ceil(a * m + b)) if push < 0 else (lambda m: math.ceil(model.decoder.sentence_min * m))
    for s, n, nbest in zip(src.tolist(), sentences, hypos):
        pad = task.source_dictionary.pad()
        source = [len(x) + 1 for x in _split([t for t in s if t not in (pad, eos)], sep)]  # with the token ending it
        for h in nbest:
            written = [len(x) for x in _split(h["tokens"].tolist()[:-1], sep)]
            assert len(written) == n and h["tokens"][-1] == eos and len(h["tokens"]) < 200
            assert written == [bound(m) for m in source]  # each ended at its bound, and not past it


def _split(tokens, sep):
    out = [[]]
    for t in tokens:
        out[-1:] = [out[-1], []] if t == sep else [out[-1] + [t]]
    return out


def test_sampling_writes_one_sentence_per_source_sentence(documents_model):
    task, model, sep = documents_model("--sentence-index", *RFA_GATE)
    with torch.no_grad():
        model.decoder.output_projection.weight[task.target_dictionary.eos()] *= 4.0
        model.decoder.output_projection.weight[sep] *= 3.0
    src, lengths = _documents(task, sep, [5, 2])
    gen = SequenceGenerator([model], task.target_dictionary, beam_size=2, max_len_b=60,
                            search_strategy=__import__("fairseq.search", fromlist=["Sampling"]).Sampling(
                                task.target_dictionary, sampling_topk=5))
    torch.manual_seed(0)
    with torch.no_grad():
        hypos = gen.forward({"id": torch.arange(2), "net_input": {"src_tokens": src, "src_lengths": lengths}})
    assert [[int((h["tokens"] == sep).sum()) for h in nbest] for nbest in hypos] == [[4, 4], [1, 1]]
    assert all(h["positional_scores"][-1] > FORBIDDEN_EOS for nbest in hypos for h in nbest)


def test_the_flag_turns_it_off(documents_model):
    task, model, sep = documents_model("--sentence-index", "--no-sentence-alignment", *RFA_GATE)
    with torch.no_grad():
        model.decoder.output_projection.weight[task.target_dictionary.eos()] *= 4.0
    src, lengths = _documents(task, sep, [6, 6])
    gen = SequenceGenerator([model], task.target_dictionary, beam_size=2, max_len_b=60)
    with torch.no_grad():
        hypos = gen.forward({"id": torch.arange(2), "net_input": {"src_tokens": src, "src_lengths": lengths}})
    assert any(int((h["tokens"] == sep).sum()) != 5 for nbest in hypos for h in nbest)


def test_the_flag_needs_the_sentence_index(documents_model):
    with pytest.raises(ValueError, match="--no-sentence-alignment .* --sentence-index"):
        documents_model("--no-sentence-alignment", *RFA_GATE)
