"""``--onnx-runtime``: the decoding step exported from the model and run by ONNX Runtime, the beam reorder folded into
it, gives the eager step's scores and states, fairseq's beam search the same hypotheses (each scored as the full pass
scores it), from a graph cached on disk; without onnxruntime, a warning and eager steps."""
import logging

import pytest
import torch
from fairseq.sequence_generator import SequenceGenerator

from rfa_fairseq import onnx_step
from rfa_fairseq.inference import to_decoding_form_
from rfa_fairseq.modules import CausalRFAttention

from rfa_test_utils import causal_state, random_tokens

pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")

GATE_SOFTMAX_CROSS = ["--cross-attention", "softmax", "--rfa-gate"]
# (the sentence alignment, with the engine in test_sentence_alignment.py, would end some at the length limit at -80)
DOCUMENTS = GATE_SOFTMAX_CROSS + ["--sentence-index", "--cross-sentence-window", "1", "--no-sentence-alignment"]
MODELS = [pytest.param(["--cross-attention", "rfa", "--rfa-gate"], 5.0, id="rfa-cross"),  # with </s>'s scale
          pytest.param(GATE_SOFTMAX_CROSS, 2.0, id="softmax-cross"),
          pytest.param(DOCUMENTS, 2.0, id="documents-window")]


@pytest.fixture(autouse=True)
def onnx_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("RFA_ONNX_CACHE", str(tmp_path / "onnx"))
    return tmp_path / "onnx"


@pytest.fixture
def model_pair(translation_model, tmp_path):
    """factory(*extra) -> (task, eager model, the same weights with the ONNX step, separator)."""
    for lang in ("de", "en"):
        with open(tmp_path / f"dict.{lang}.txt", "a") as f:
            f.write("<sep> 10\n")

    def make(*extra, int8=False, eos=2.0):
        task, eager = translation_model(*extra, rfa_flags=False)
        _, engine = translation_model(*extra, rfa_flags=False)
        engine.load_state_dict(eager.state_dict())
        sep = task.target_dictionary.index("<sep>")
        for model in (eager, engine):  # sentences end at different steps; separators written often
            with torch.no_grad():
                model.decoder.output_projection.weight[task.target_dictionary.eos()] *= eos
                model.decoder.output_projection.weight[sep] *= 2.0
        to_decoding_form_(engine.eval(), onnx_runtime=True, int8=int8, int8_min_weights=0)
        return task, eager.eval(), engine, sep
    return make


def _sample(task, sep, batch=4, length=16):
    d = task.source_dictionary
    src = random_tokens(d, batch, length, torch.Generator().manual_seed(3))
    src[:, 3::5] = sep
    src[:, -1] = d.eos()
    lengths = torch.tensor([length, length - 4, length, length - 7][:batch])
    for i, n in enumerate(lengths.tolist()):  # left padding, as fairseq batches sources
        src[i, :length - n] = d.pad()
    return {"id": torch.arange(batch), "net_input": {"src_tokens": src, "src_lengths": lengths}}


def _beam_search(task, models, sample):
    """Each model's beam-4 hypotheses for ``sample``."""
    hypos = []
    for model in models:
        gen = SequenceGenerator([model], task.target_dictionary, beam_size=4, max_len_b=30, min_len=2)
        with torch.no_grad():
            hypos.append(gen.forward(sample))
    return hypos


@pytest.mark.parametrize("extra,eos", MODELS)
def test_beam_search_gives_the_eager_hypotheses_and_the_full_pass_scores(model_pair, extra, eos):
    task, eager, engine, sep = model_pair(*extra, eos=eos)
    sample = _sample(task, sep)
    hypos = _beam_search(task, (eager, engine), sample)
    assert len({len(h["tokens"]) for nbest in hypos[0] for h in nbest}) > 1  # finished sentences leave the batch
    assert engine.decoder.step_engine.graphs
    eos, src = task.target_dictionary.eos(), sample["net_input"]["src_tokens"]
    for row, (nbest_eager, nbest_engine) in enumerate(zip(*hypos, strict=True)):
        for a, b in zip(nbest_eager, nbest_engine, strict=True):
            assert torch.equal(a["tokens"], b["tokens"])
            torch.testing.assert_close(b["positional_scores"], a["positional_scores"], rtol=0, atol=1e-5)
            prev = torch.cat([b["tokens"].new_tensor([eos]), b["tokens"][:-1]])[None]
            with torch.no_grad():
                lprobs = engine.get_normalized_probs(engine(src[row:row + 1], sample["net_input"]["src_lengths"][
                    row:row + 1], prev), log_probs=True)
            rescored = lprobs[0].gather(-1, b["tokens"][:, None])[:, 0]
            torch.testing.assert_close(rescored, b["positional_scores"], rtol=0, atol=1e-4)


def test_steps_past_max_rows_run_eagerly_with_the_same_hypotheses(model_pair, monkeypatch):
    """Beam search from 16 rows with MAX_ROWS 8: the first steps run eagerly, the graph takes over as sentences
    finish; the hypotheses are the eager ones."""
    monkeypatch.setattr(onnx_step, "MAX_ROWS", 8)
    rows, run = [], onnx_step.Graph.run

    def counted(self, step, held, states):
        rows.append(step[0].size(0))
        return run(self, step, held, states)
    monkeypatch.setattr(onnx_step.Graph, "run", counted)
    task, eager, engine, sep = model_pair(*DOCUMENTS)
    hypos = _beam_search(task, (eager, engine), _sample(task, sep))
    assert rows and max(rows) <= 8
    for nbest_eager, nbest_engine in zip(*hypos, strict=True):
        for a, b in zip(nbest_eager, nbest_engine, strict=True):
            assert torch.equal(a["tokens"], b["tokens"])
            torch.testing.assert_close(b["positional_scores"], a["positional_scores"], rtol=0, atol=1e-5)


def _causal_states(model, state):
    return [causal_state(m._get_input_buffer(state)) for m in model.decoder.modules() if isinstance(m, CausalRFAttention)]


def _steps(model, task, sample, sep):
    """Teacher-forced steps of 3 sources, beam 2, reorders within the beams, then one that drops a sentence: each
    step's scores, then the causal states (their deferred reorders applied)."""
    beam, g = 2, torch.Generator().manual_seed(5)
    tokens = random_tokens(task.target_dictionary, 6, 8, g)
    tokens[:, 0], tokens[:, 3] = task.target_dictionary.eos(), sep
    orders = [torch.tensor([1, 1, 2, 3, 5, 4]), torch.tensor([0, 1, 4, 5]), torch.tensor([1, 0, 2, 2]),
              torch.tensor([3, 2, 1, 1]), torch.tensor([0, 0, 1, 1]), torch.tensor([1, 0, 3, 2]),
              torch.tensor([0, 0, 3, 3])]
    model.decoder.set_beam_size(beam)
    got = []
    with torch.no_grad():
        enc = model.encoder(sample["net_input"]["src_tokens"][:3], sample["net_input"]["src_lengths"][:3])
        enc = model.encoder.reorder_encoder_out(enc, torch.arange(3).repeat_interleave(beam))
        state, prev = {}, tokens[:, :1]
        for t, order in enumerate(orders):
            got.append(model.get_normalized_probs(model.decoder(prev, encoder_out=enc, incremental_state=state),
                                                  log_probs=True))
            model.decoder.reorder_incremental_state_scripting(state, order)
            enc = model.encoder.reorder_encoder_out(enc, order)
            prev = torch.cat([prev.index_select(0, order), tokens[:len(order), t + 1:t + 2]], 1)
    return got, _causal_states(model, state)


def test_steps_with_reorders_give_the_eager_scores_and_states(model_pair):
    task, eager, engine, sep = model_pair(*DOCUMENTS)
    sample = _sample(task, sep)
    (scores, states), (engine_scores, engine_states) = _steps(eager, task, sample, sep), _steps(engine, task, sample, sep)
    assert engine.decoder.step_engine.graphs
    torch.testing.assert_close(engine_scores, scores, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(engine_states, states, rtol=1e-5, atol=1e-5)


def test_a_language_models_steps_equal_eager(lm_model, onnx_cache):
    task, eager = lm_model("--rfa-gate")
    _, engine = lm_model("--rfa-gate")
    engine.load_state_dict(eager.state_dict())
    to_decoding_form_(engine.eval(), onnx_runtime=True)
    prompt = random_tokens(task.dictionary, 2, 4, torch.Generator().manual_seed(1))
    outs = []
    for model in (eager.eval(), engine):
        gen = SequenceGenerator([model], task.target_dictionary, beam_size=2, max_len_b=20, min_len=20)
        with torch.no_grad():
            outs.append(gen.generate([model], {"net_input": {"src_tokens": prompt[:, :0], "src_lengths": torch.zeros(2)}},
                                     prefix_tokens=prompt))
    for a, b in zip(*outs, strict=True):
        assert torch.equal(a[0]["tokens"], b[0]["tokens"])
        torch.testing.assert_close(b[0]["positional_scores"], a[0]["positional_scores"], rtol=0, atol=1e-5)
    assert list(onnx_cache.glob("step-*.onnx"))


def test_a_second_model_loads_the_cached_graph_without_exporting(model_pair, monkeypatch, onnx_cache):
    task, _, engine, sep = model_pair(*DOCUMENTS)
    gen = SequenceGenerator([engine], task.target_dictionary, beam_size=2, max_len_b=10)
    sample = _sample(task, sep)
    with torch.no_grad():
        first = gen.forward(sample)
    assert len(list(onnx_cache.glob("step-*.onnx"))) == 1
    exported = engine.decoder.step_engine.setup_seconds  # the export and the load, timed
    def export(*args, **kwargs):
        raise RuntimeError("exported again")
    monkeypatch.setattr(torch.onnx, "export", export)
    to_decoding_form_(engine, onnx_runtime=True)  # a fresh engine: no graph in memory
    with torch.no_grad():
        again = gen.forward(sample)
    assert [h[0]["tokens"].tolist() for h in first] == [h[0]["tokens"].tolist() for h in again]
    assert 0 < engine.decoder.step_engine.setup_seconds < exported  # the load alone
    with torch.no_grad():  # other weights: another graph
        engine.decoder.layers[0].fc1.weight.mul_(2.0)
    to_decoding_form_(engine, onnx_runtime=True)
    with pytest.raises(RuntimeError, match="exported again"):
        with torch.no_grad():
            gen.forward(sample)


def test_int8_quantizes_the_graphs_products_and_stays_near_float(model_pair):
    import onnx
    task, eager, engine, sep = model_pair(*DOCUMENTS, int8=True)
    sample = _sample(task, sep)
    (scores, _), (int8_scores, _) = _steps(eager, task, sample, sep), _steps(engine, task, sample, sep)
    (path,) = onnx_step.cache_dir().glob("step-*-int8-0.onnx")
    assert any(n.op_type in ("MatMulInteger", "DynamicQuantizeMatMul") for n in onnx.load(str(path)).graph.node)
    error = torch.cat([(a - b).abs().flatten() for a, b in zip(scores[1:], int8_scores[1:])])
    assert 0 < error.mean() < 0.02 and error.max() < 0.2, (error.mean(), error.max())


def test_without_onnxruntime_a_warning_and_eager_steps(translation_model, monkeypatch, caplog):
    _, model = translation_model("--rfa-gate")
    monkeypatch.setattr(onnx_step, "available", lambda: False)
    with caplog.at_level(logging.WARNING):
        to_decoding_form_(model.eval(), onnx_runtime=True)
    assert model.decoder.step_engine is None
    assert "onnxruntime" in caplog.text and "eagerly" in caplog.text


def test_bad_combinations_are_refused(translation_model):
    _, model = translation_model("--rfa-gate")
    with pytest.raises(ValueError, match="choose one"):
        to_decoding_form_(model.eval(), onnx_runtime=True, cuda_graphs=True)
    _, softmax = translation_model("--decoder-attention", "softmax", rfa_flags=False)
    with pytest.raises(ValueError, match="RFA decoder"):
        to_decoding_form_(softmax.eval(), onnx_runtime=True)
