"""A sentence's output does not depend on what it is batched with (left- and right-padded
sources, right-padded targets, LM batches), and degenerate inputs decode as fairseq's own
transformer does."""
import pytest
import torch
from fairseq.sequence_generator import SequenceGenerator

from rfa_test_utils import random_tokens


def _pad_batch(seqs, pad, left):
    T = max(len(s) for s in seqs)
    out = torch.full((len(seqs), T), pad, dtype=torch.long)
    for i, s in enumerate(seqs):
        if left:
            out[i, T - len(s):] = s
        else:
            out[i, : len(s)] = s
    return out


@pytest.mark.parametrize("extra", [pytest.param([], id="rfa"), pytest.param(["--rfa-gate"], id="rfa-gate")])
@pytest.mark.parametrize("left_pad_source", [True, False], ids=["left-pad-src", "right-pad-src"])
def test_translation_output_independent_of_batch(translation_model, extra, left_pad_source):
    task, model = translation_model(*extra)
    model.eval()
    d, eos, pad = task.source_dictionary, task.source_dictionary.eos(), task.source_dictionary.pad()
    g = torch.Generator().manual_seed(5)
    srcs = [torch.cat([random_tokens(d, 1, n, g)[0], torch.tensor([eos])]) for n in (4, 12, 9)]
    tgts = [torch.cat([torch.tensor([eos]), random_tokens(d, 1, n, g)[0]]) for n in (5, 15, 2)]
    src = _pad_batch(srcs, pad, left=left_pad_source)
    prev = _pad_batch(tgts, pad, left=False)  # fairseq pads targets on the right
    lengths = torch.tensor([len(s) for s in srcs])
    with torch.no_grad():
        batched, _ = model(src, lengths, prev)
        for i in range(3):
            alone, _ = model(srcs[i][None], lengths[i : i + 1], tgts[i][None])
            n = len(tgts[i])
            assert (batched[i, :n] - alone[0]).abs().max().item() <= 1e-5


@pytest.mark.parametrize("extra", [pytest.param([], id="rfa"), pytest.param(["--rfa-gate"], id="rfa-gate")])
def test_lm_output_independent_of_batch(lm_model, extra):
    task, model = lm_model(*extra)
    model.eval()
    g = torch.Generator().manual_seed(6)
    seqs = [random_tokens(task.dictionary, 1, n, g)[0] for n in (7, 70, 33)]
    batch = _pad_batch(seqs, task.dictionary.pad(), left=False)
    with torch.no_grad():
        batched, _ = model(batch)
        for i, s in enumerate(seqs):
            alone, _ = model(s[None])
            assert (batched[i, : len(s)] - alone[0]).abs().max().item() <= 1e-5


@pytest.mark.parametrize("extra", [pytest.param([], id="rfa"), pytest.param(["--rfa-gate"], id="rfa-gate")])
def test_degenerate_sources_decode(translation_model, extra):
    """An empty line (only EOS after fairseq-preprocess) and a single token, batched with a
    longer sentence, decode to finite beam hypotheses."""
    task, model = translation_model(*extra)
    model.eval()
    d = task.source_dictionary
    srcs = [torch.tensor([d.eos()]), torch.tensor([d.nspecial + 3, d.eos()]),
            torch.cat([random_tokens(d, 1, 10)[0], torch.tensor([d.eos()])])]
    sample = {"id": torch.arange(3), "net_input": {"src_tokens": _pad_batch(srcs, d.pad(), left=True),
                                                   "src_lengths": torch.tensor([len(s) for s in srcs])}}
    gen = SequenceGenerator([model], task.target_dictionary, beam_size=4, max_len_b=8)
    with torch.no_grad():
        hypos = gen.forward(sample)
    assert len(hypos) == 3
    for nbest in hypos:
        assert len(nbest) == 4
        assert all(torch.isfinite(h["positional_scores"]).all() for h in nbest)
