"""``--task rfa_translation``'s beam search (CompiledSearch: the compiled step's C++ search) against fairseq's
SequenceGenerator over the same steps, the naive reference: the same hypotheses (tokens, scores, positional scores,
order) over decoders, int8 and float32 steps, beams, length limits, penalties and temperature, with sentences finishing
at different steps (the batch shrinks), candidates ending among the first beam and sentence-aligned decoding's ends
forced; what it does not cover goes to fairseq's generator; fairseq's command lines build it through the task."""
import argparse

import pytest
import torch
from fairseq.sequence_generator import SequenceGenerator

from rfa_fairseq.engines import compiled
from rfa_fairseq.inference import to_decoding_form_
from rfa_fairseq.models import rfa_decoder
from rfa_fairseq.tasks import CompiledSearch, RFATranslationTask

from rfa_test_utils import random_tokens

# the flags, and a factor on </s>'s output weights that makes the untrained decoder end at different steps
DECODERS = [pytest.param(["--rfa-gate"], 6.0, id="rfa-gate"),
            pytest.param(["--rfa-gate", "--cross-attention", "rfa"], 6.0, id="rfa-cross"),
            pytest.param(["--rfa-gate", "--sentence-index", "--cross-sentence-window", "1"], 6.0, id="documents")]
SETTINGS = [dict(beam_size=4, max_len_b=30), dict(beam_size=1, max_len_b=30),
            dict(beam_size=5, max_len_b=20, min_len=3, len_penalty=0.6, unk_penalty=0.5),
            dict(beam_size=3, max_len_a=1.5, max_len_b=2, normalize_scores=False, temperature=0.7)]
SETTING_IDS = ["beam4", "greedy", "limits-penalties", "max-len-a-temperature"]


def _sample(task, sep, batch=6, length=20, seed=0):
    """Left-padded sources of different lengths, a separator every few tokens."""
    d, g = task.source_dictionary, torch.Generator().manual_seed(seed)
    src = torch.full((batch, length), d.pad())
    for i in range(batch):
        n = length - 1 - 2 * i
        tokens = random_tokens(d, 1, n, g)[0]
        tokens[tokens == sep] = d.unk()
        tokens[3::5] = sep
        src[i, length - n - 1:-1], src[i, -1] = tokens, d.eos()
    return {"id": torch.arange(batch), "net_input": {"src_tokens": src, "src_lengths": src.ne(d.pad()).sum(1)}}


def _same(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert [h["tokens"].tolist() for h in g] == [h["tokens"].tolist() for h in w]
        for a, b in zip(g, w):
            assert a["score"].item() == b["score"].item()
            assert torch.equal(a["positional_scores"], b["positional_scores"])


@pytest.mark.skipif(compiled.load() is None, reason="the compiled step could not be built here")
@pytest.mark.parametrize("extra, ending", DECODERS)
@pytest.mark.parametrize("settings", SETTINGS, ids=SETTING_IDS)
@pytest.mark.parametrize("int8", [False, True], ids=["float32", "int8"])
def test_the_compiled_search_gives_fairseqs_hypotheses_over_its_steps(documents_model, extra, ending, settings, int8,
                                                                      monkeypatch):
    """With the compiled step the whole search runs in C++ (Decoder::generate): fairseq's generator over the same
    steps is its reference; sentence-aligned decoding's bounds as the decoder reads them (some forced here)."""
    task, model, sep = documents_model(*extra)
    with torch.no_grad():
        model.decoder.output_projection.weight[task.target_dictionary.eos()] *= ending
        model.decoder.output_projection.weight[sep] *= 2.0
    to_decoding_form_(model, compiled_step=True, int8=int8)
    engine, searches = model.decoder.step_engine, []
    generate = engine.generate
    monkeypatch.setattr(engine, "generate", lambda *a: searches.append(a) or generate(*a))
    sample = _sample(task, sep)
    with torch.no_grad():
        free = CompiledSearch([model], task.target_dictionary, **settings).forward(sample)
        if model.decoder.sentence_alignment:  # forces most sentences' ends, at a floor of the model's own
            monkeypatch.setattr(rfa_decoder, "SENTENCE_LENGTH", (0.5, 1.0))
            model.decoder.sentence_min = 0.3
        want = SequenceGenerator([model], task.target_dictionary, **settings).forward(sample)
        got = CompiledSearch([model], task.target_dictionary, **settings).forward(sample)
    assert len(searches) == 2
    _same(got, want)
    assert len({len(h["tokens"]) for nbest in want for h in nbest}) > 2, "few lengths do not shrink the batch"
    if model.decoder.sentence_alignment and settings["max_len_b"] > 2:
        assert [h["tokens"].tolist() for n in got for h in n] != [h["tokens"].tolist() for n in free for h in n]


def test_what_it_does_not_cover_is_fairseqs(documents_model, monkeypatch):
    task, model, sep = documents_model("--rfa-gate")
    sample, called = _sample(task, sep, batch=2), []
    monkeypatch.setattr(SequenceGenerator, "_generate", lambda self, *a, **k: called.append(a) or "fairseq's")
    with torch.no_grad():
        search = CompiledSearch([model], task.target_dictionary, beam_size=2, max_len_b=10)
        assert search.forward(sample) == "fairseq's"  # eager steps
        to_decoding_form_(model, compiled_step=True)
        search = CompiledSearch([model], task.target_dictionary, beam_size=2, max_len_b=10, no_repeat_ngram_size=2)
        assert search.forward(sample) == "fairseq's"
        search = CompiledSearch([model], task.target_dictionary, beam_size=2, max_len_b=10)
        assert search.forward(sample, prefix_tokens=torch.ones(2, 1, dtype=torch.long)) == "fairseq's"
        built = compiled.load() is not None  # where the C++ cannot be built, every search is fairseq's
        assert (search.forward(sample) != "fairseq's") == built
    assert len(called) == 4 - built


def test_the_task_builds_it_for_beam_search_and_fairseqs_where_attention_is_asked_for(documents_model):
    task, model, _ = documents_model("--rfa-gate")
    ours = RFATranslationTask(task.cfg, task.source_dictionary, task.target_dictionary)
    args = argparse.Namespace(beam=4, print_alignment=False)
    assert type(ours.build_generator([model], args)) is CompiledSearch
    model.decoder.decoding_attention = True
    assert type(ours.build_generator([model], args)) is SequenceGenerator
    model.decoder.decoding_attention, args.print_alignment = False, "hard"
    assert type(ours.build_generator([model], args)) is not CompiledSearch
