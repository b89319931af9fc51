"""The graph-ready decoding step (``RFATransformerDecoder.forward_step``) and its graphs (``--cuda-graphs``).

On the CPU a CUDA graph is emulated by ``fx_capture`` (tests/rfa_test_utils.py): the step traced once into
an operator graph whose tensors are the ones it touched at capture and whose Python values (a position,
a shape) are frozen, then replayed; as a CUDA graph, it is right only if everything a step depends on is
in its input buffers and in state at the addresses captured. tests/gpu captures real CUDA graphs.
"""
from argparse import Namespace

import pytest
import torch
from fairseq.models.transformer import TransformerDecoderBase
from fairseq.sequence_generator import SequenceGenerator

from rfa_fairseq.inference import to_decoding_form_
from rfa_fairseq.modules import causal_rfa_attention
from rfa_fairseq.engines.step_graphs import StepGraphs

from rfa_test_utils import emulate_cuda_graphs, fx_capture, random_tokens

GENERATE_CFG = Namespace(generation=Namespace(beam=4))  # what prepare_for_inference_ reads of fairseq-generate's
# (flags, EOS boost): the boost makes sentences finish at different steps, so the batch shrinks and the states move
TRANSLATION = [pytest.param(["--rfa-gate"], 3.0, id="rfa-gate"),
               pytest.param(["--rfa-gate", "--cross-attention", "softmax"], 3.0, id="gate-softmax-cross"),
               pytest.param(["--decoder-learned-pos"], 2.0, id="rfa-learned-positions")]


def _source(task, batch, length=9, seed=0):
    src = random_tokens(task.source_dictionary, batch, length, torch.Generator().manual_seed(seed))
    src[:, -1] = task.source_dictionary.eos()
    return {"id": torch.arange(batch), "net_input": {"src_tokens": src, "src_lengths": torch.full((batch,), length)}}


def _translation(translation_model, extra, eos_boost=3.0):
    task, model = translation_model(*extra, rfa_flags="--cross-attention" not in extra)
    model.eval()
    with torch.no_grad():
        model.decoder.output_projection.weight[task.target_dictionary.eos()] *= eos_boost
    return task, model


@pytest.fixture
def counter(monkeypatch):
    """Steps captured on the CPU by ``fx_capture``, captures and replays counted."""
    counted = Counted()
    emulate_cuda_graphs(monkeypatch, counted)
    return counted


class Counted:
    """``fx_capture``, counting captures and replays."""

    def __init__(self):
        self.captures = self.replays = 0

    def __call__(self, *args):
        self.captures += 1
        graph = fx_capture(*args)

        def replay():
            self.replays += 1
            return graph()
        return replay


def _same_hypotheses(a, b):
    for nbest_a, nbest_b in zip(a, b, strict=True):
        for x, y in zip(nbest_a, nbest_b, strict=True):
            assert torch.equal(x["tokens"], y["tokens"])
            torch.testing.assert_close(x["positional_scores"], y["positional_scores"], rtol=0, atol=1e-5)


def _generate_both_ways(task, model, sample, beam, counter, max_graphs=16, **kwargs):
    """(eager hypotheses, graphed hypotheses, batch sizes the steps saw)."""
    gen = SequenceGenerator([model], task.target_dictionary, beam_size=beam, max_len_b=30, min_len=1)
    with torch.no_grad():
        eager = gen.forward(sample, **kwargs)
    rows, forward = set(), model.decoder.forward

    def spy(tokens, *a, **kw):
        rows.add(tokens.size(0))
        return forward(tokens, *a, **kw)
    model.decoder.step_engine = StepGraphs(model.decoder, max_graphs=max_graphs)
    model.decoder.forward = spy
    with torch.no_grad():
        graphed = gen.forward(sample, **kwargs)
    return eager, graphed, rows


@pytest.mark.parametrize("extra,eos_boost", TRANSLATION)
@pytest.mark.parametrize("beam", [1, 4])
def test_graphed_translation_equals_eager(translation_model, extra, eos_boost, beam, counter):
    """Each hypothesis as eager decoding gives it, while the batch shrinks (the states captured and reordered)."""
    task, model = _translation(translation_model, extra, eos_boost)
    eager, graphed, rows = _generate_both_ways(task, model, _source(task, 6), beam, counter)
    _same_hypotheses(eager, graphed)
    assert len(rows) > 1, "no sentence finished early: the states never moved"
    assert counter.captures >= 2 and counter.replays > counter.captures


@pytest.mark.parametrize("extra", [pytest.param([], id="rfa"), pytest.param(["--rfa-gate"], id="rfa-gate")])
def test_graphed_lm_equals_eager(lm_model, extra, counter):
    """Prompts continued by beam search, in the decoding form."""
    task, model = lm_model(*extra)
    model.eval()
    with torch.no_grad():
        model.decoder.output_projection.weight[task.dictionary.eos()] *= 3.0
    to_decoding_form_(model)
    prompts = random_tokens(task.dictionary, 3, 4, torch.Generator().manual_seed(3))
    sample = {"id": torch.arange(3), "net_input": {"src_tokens": prompts, "src_lengths": torch.full((3,), 4)}}
    eager, graphed, _ = _generate_both_ways(task, model, sample, 4, counter, prefix_tokens=prompts)
    _same_hypotheses(eager, graphed)
    assert counter.replays > 0


def test_graphed_sampling_equals_eager(lm_model, counter):
    """Sampling (top-k) draws from the step's output: with the same seed, the same samples."""
    from fairseq import search

    task, model = lm_model("--rfa-gate")
    model.eval()
    prompts = random_tokens(task.dictionary, 2, 3, torch.Generator().manual_seed(4))
    sample = {"id": torch.arange(2), "net_input": {"src_tokens": prompts, "src_lengths": torch.full((2,), 3)}}
    gen = SequenceGenerator([model], task.target_dictionary, beam_size=2, max_len_b=25, min_len=25,
                            search_strategy=search.Sampling(task.target_dictionary, sampling_topk=10))
    runs = []
    for graphs in (None, StepGraphs(model.decoder)):
        model.decoder.step_engine = graphs
        torch.manual_seed(5)
        with torch.no_grad():
            runs.append(gen.forward(sample, prefix_tokens=prompts))
    _same_hypotheses(*runs)
    assert counter.replays > 10


def test_few_graphs_kept_still_equal(translation_model, counter):
    """With room for one graph, layouts evict each other and run eagerly until seen twice more."""
    task, model = _translation(translation_model, ["--rfa-gate"])
    eager, graphed, _ = _generate_both_ways(task, model, _source(task, 6), 4, counter, max_graphs=1)
    _same_hypotheses(eager, graphed)
    assert len(model.decoder.step_engine.graphs) == 1 and counter.captures > 2


@pytest.mark.parametrize("extra", [pytest.param(["--rfa-gate"], id="rfa-gate"),
                                   pytest.param(["--rfa-gate", "--cross-attention", "softmax"], id="gate-softmax-cross")])
def test_forward_step_equals_fairseqs_step(translation_model, extra):
    """Token by token from the same states, the step entry gives fairseq's logits and leaves the same states."""
    task, model = _translation(translation_model, extra)
    sample = _source(task, 3)
    tokens = random_tokens(task.target_dictionary, 3, 12, torch.Generator().manual_seed(1))
    with torch.no_grad():
        enc = model.encoder(**sample["net_input"])
        ours, theirs = {}, {}
        for t in range(tokens.size(1)):
            a, _ = model.decoder(tokens[:, :t + 1], encoder_out=enc, incremental_state=ours)
            b, _ = TransformerDecoderBase.forward(model.decoder, tokens[:, :t + 1], encoder_out=enc,
                                                  incremental_state=theirs)
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert ours.keys() == theirs.keys()
    for key in ours:
        for field in ours[key]:
            torch.testing.assert_close(ours[key][field], theirs[key][field], rtol=1e-5, atol=1e-6)


def test_cuda_graphs_flag_runs_eagerly_on_the_cpu(translation_model):
    """--cuda-graphs (the model flag prepare_for_inference_ reads) keeps CPU decoding as it was."""
    task, model = _translation(translation_model, ["--rfa-gate", "--cuda-graphs"])
    assert model.cuda_graphs
    sample = _source(task, 4)
    gen = SequenceGenerator([model], task.target_dictionary, beam_size=4, max_len_b=20)
    with torch.no_grad():
        eager = gen.forward(sample)
        model.prepare_for_inference_(GENERATE_CFG)
        graphed = gen.forward(sample)
    assert isinstance(model.decoder.step_engine, StepGraphs) and not model.decoder.step_engine.graphs
    _same_hypotheses(eager, graphed)


@pytest.mark.parametrize("flags,error", [
    (["--decoder-attention", "softmax", "--cross-attention", "softmax"], "needs an RFA decoder"),
    (["--rfa-short-conv", "4"], "--rfa-short-conv's last inputs"),
])
def test_what_a_graph_cannot_replay_is_refused(translation_model, flags, error):
    _, model = translation_model(*flags, "--cuda-graphs", rfa_flags="--cross-attention" not in flags)
    with pytest.raises(ValueError, match=error):
        model.prepare_for_inference_(GENERATE_CFG)


def test_adaptive_input_is_refused(lm_model):
    _, model = lm_model("--adaptive-input", "--adaptive-input-cutoff", "20", "--adaptive-softmax-cutoff", "20",
                        "--cuda-graphs")
    with pytest.raises(ValueError, match="adaptive-input"):
        model.prepare_for_inference_(GENERATE_CFG)


def test_a_failed_capture_names_the_flag(translation_model, monkeypatch):
    task, model = _translation(translation_model, ["--rfa-gate"])

    def failing(*args):
        raise RuntimeError("operation not permitted when stream is capturing")
    emulate_cuda_graphs(monkeypatch, failing)
    model.decoder.step_engine = StepGraphs(model.decoder)
    gen = SequenceGenerator([model], task.target_dictionary, beam_size=1, max_len_b=10, min_len=10)
    with torch.no_grad(), pytest.raises(RuntimeError, match="decode without --cuda-graphs"):
        gen.forward(_source(task, 2))



@pytest.mark.parametrize("extra", [pytest.param(["--rfa-gate"], id="rfa-gate"),
                                   pytest.param(["--rfa-gate", "--cross-attention", "softmax"], id="gate-softmax-cross")])
def test_forward_step_traces_whole_as_beam_search_shrinks(translation_model, extra, monkeypatch):
    """torch.compile traces the step as one graph (fullgraph: a graph break fails), at most twice over beam search's
    shrinking batches (the first trace's shapes, then dynamic ones), and the traced step decodes as eager. Reorders
    happen at once, as on CUDA (the CPU's deferred ones are the compiled step's, which a trace does not take)."""
    monkeypatch.setattr(causal_rfa_attention, "deferrable", lambda state: False)
    task, model = _translation(translation_model, extra)
    sample, graphs = _source(task, 3), []

    def backend(gm, example_inputs):  # dynamo's trace, run as traced
        graphs.append(gm)
        return gm.forward
    gen = SequenceGenerator([model], task.target_dictionary, beam_size=4, max_len_b=30, min_len=1)
    with torch.no_grad():
        eager = gen.forward(sample)
        torch._dynamo.reset()
        model.decoder.forward_step = torch.compile(model.decoder.forward_step, backend=backend, fullgraph=True)
        traced = gen.forward(sample)
    _same_hypotheses(eager, traced)
    assert 1 <= len(graphs) <= 2
