"""``--compiled-step``: the decoding step as compiled layers (rfa_fairseq/engines/compiled_step.cpp) gives the eager
step's scores and states (each block is the fused form of its module's step, the module its reference), fairseq's beam
search the same hypotheses, each scored as the full pass scores it; int8 products equal their float64 reference."""
import pytest
import torch
from fairseq.sequence_generator import SequenceGenerator

from rfa_fairseq.engines import compiled
from rfa_fairseq.inference import to_decoding_form_
from rfa_fairseq.modules import CausalRFAttention

from rfa_test_utils import causal_state, random_tokens

pytestmark = pytest.mark.skipif(compiled.load() is None, reason="the compiled step could not be built here")

GATE_SOFTMAX_CROSS = ["--cross-attention", "softmax", "--rfa-gate"]
# (the sentence alignment would end some hypotheses at the length limit at -80: tested with the engine elsewhere)
DOCUMENTS = GATE_SOFTMAX_CROSS + ["--sentence-index", "--cross-sentence-window", "1", "--no-sentence-alignment"]
MODELS = [pytest.param(["--cross-attention", "rfa", "--rfa-gate"], 5.0, id="rfa-cross"),  # with </s>'s scale
          pytest.param(GATE_SOFTMAX_CROSS, 2.0, id="softmax-cross"),
          pytest.param(DOCUMENTS, 2.0, id="documents-window")]
# the layer's other forms, each against the eager step: no gate, the decay gate, pre-norm with gelu, learned positions
# with a norm of the embeddings, odd sizes
FORMS = [pytest.param(DOCUMENTS, id="documents-window"),
         pytest.param(["--cross-attention", "rfa"], id="ungated-rfa-cross"),
         pytest.param(GATE_SOFTMAX_CROSS + ["--rfa-gate-form", "decay"], id="decay-gate"),
         pytest.param(GATE_SOFTMAX_CROSS + ["--decoder-normalize-before", "--activation-fn", "gelu"], id="prenorm-gelu"),
         pytest.param(GATE_SOFTMAX_CROSS + ["--decoder-learned-pos", "--layernorm-embedding"], id="learned-pos-embed-norm"),
         pytest.param(["--cross-attention", "rfa", "--rfa-gate", "--decoder-embed-dim", "30",
                       "--decoder-attention-heads", "3", "--rfa-causal-feature-dim", "7",
                       "--rfa-cross-feature-dim", "5"], id="odd-sizes")]


@pytest.fixture
def model_pair(translation_model, tmp_path):
    """factory(*extra) -> (task, eager model, the same weights with the compiled step, separator)."""
    for lang in ("de", "en"):
        with open(tmp_path / f"dict.{lang}.txt", "a") as f:
            f.write("<sep> 10\n")

    def make(*extra, int8=False, eos=2.0, int8_min_weights=0):
        task, eager = translation_model(*extra, rfa_flags=False)
        _, engine = translation_model(*extra, rfa_flags=False)
        engine.load_state_dict(eager.state_dict())
        sep = task.target_dictionary.index("<sep>")
        for model in (eager, engine):  # sentences end at different steps; separators written often
            with torch.no_grad():
                model.decoder.output_projection.weight[task.target_dictionary.eos()] *= eos
                model.decoder.output_projection.weight[sep] *= 2.0
        to_decoding_form_(engine.eval(), compiled_step=True, int8=int8, int8_min_weights=int8_min_weights)
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


def _counted(engine):
    """The engine's steps counted in ``engine.decoder.step_engine.calls`` (those it ran)."""
    step_engine, run = engine.decoder.step_engine, engine.decoder.step_engine.__call__
    step_engine.calls = 0

    def counted(*args, **kwargs):
        out = run(*args, **kwargs)
        step_engine.calls += out is not None
        return out
    engine.decoder.step_engine = counted
    return step_engine


@pytest.mark.parametrize("extra,eos", MODELS)
def test_beam_search_gives_the_eager_hypotheses_and_the_full_pass_scores(model_pair, extra, eos):
    task, eager, engine, sep = model_pair(*extra, eos=eos)
    step_engine, sample = _counted(engine), _sample(task, sep)
    hypos = []
    for model in (eager, engine):
        gen = SequenceGenerator([model], task.target_dictionary, beam_size=4, max_len_b=30, min_len=2)
        with torch.no_grad():
            hypos.append(gen.forward(sample))
    assert len({len(h["tokens"]) for nbest in hypos[0] for h in nbest}) > 1  # finished sentences leave the batch
    assert step_engine.calls >= 6  # every step, the first too: each sentence here takes several
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


def _causal_states(model, state):
    return [causal_state(m._get_input_buffer(state)) for m in model.decoder.modules() if isinstance(m, CausalRFAttention)]


def _steps(model, task, sample, sep, float16_state=False):
    """Teacher-forced steps of 3 sources, beam 2, reorders within the beams, then one that drops a sentence, a pad
    among the inputs: each step's scores, then the causal states (their deferred reorders applied); float16_state:
    the states rounded to float16 after each step."""
    beam, g, d = 2, torch.Generator().manual_seed(5), task.target_dictionary
    tokens = random_tokens(d, 6, 8, g)
    tokens[:, 0], tokens[:, 3], tokens[1, 5] = d.eos(), sep, d.pad()
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
            for m in model.decoder.modules() if float16_state else ():
                if isinstance(m, CausalRFAttention):
                    buffer = m._get_input_buffer(state)
                    buffer["state"] = buffer["state"].half().float()
                    m._set_input_buffer(state, buffer)
            model.decoder.reorder_incremental_state_scripting(state, order)
            enc = model.encoder.reorder_encoder_out(enc, order)
            prev = torch.cat([prev.index_select(0, order), tokens[:len(order), t + 1:t + 2]], 1)
    return got, _causal_states(model, state)


@pytest.mark.parametrize("extra", FORMS)
def test_steps_with_reorders_and_pads_give_the_eager_scores_and_states(model_pair, extra):
    task, eager, engine, sep = model_pair(*extra)
    step_engine, sample = _counted(engine), _sample(task, sep)
    (scores, states), (engine_scores, engine_states) = _steps(eager, task, sample, sep), _steps(engine, task, sample, sep)
    assert step_engine.calls == 7  # every step, the first too
    torch.testing.assert_close(engine_scores, scores, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(engine_states, states, rtol=1e-5, atol=1e-5)


def test_a_language_models_steps_equal_eager(lm_model):
    task, eager = lm_model("--rfa-gate")
    _, engine = lm_model("--rfa-gate")
    engine.load_state_dict(eager.state_dict())
    to_decoding_form_(engine.eval(), compiled_step=True)
    step_engine = _counted(engine)
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
    assert step_engine.calls >= 15


def test_int8_products_equal_their_reference_and_stay_near_float(model_pair):
    """The int8 products (a loop of its own up to OWN_MACS products, FEW_ROWS rows at a time; oneDNN's above) against
    their arithmetic in float64 (the weight per output, the input per call and row quantized: a row's outputs do not
    depend on the other rows); the int8 step's scores near float32's."""
    task, eager, engine, sep = model_pair(*DOCUMENTS, int8=True)
    weight = eager.decoder.output_projection.weight.detach().double()
    onednn_rows = compiled.load().OWN_MACS // weight.numel() + 1
    magnitudes = torch.tensor([1e-3, 1.0, 30.0, 1.0, 0.1]).repeat(onednn_rows)[:onednn_rows, None]
    x = torch.randn(onednn_rows, weight.size(1)) * magnitudes
    scale = weight.abs().amax(1, keepdim=True) / 127
    top = 63 if compiled.load().reduce_range() else 127  # the largest magnitude's level: 7 bits or 8
    rows = x.abs().amax(1, keepdim=True) / top  # the input's quantization in float32, as the step's
    x8, rows = (x * (1 / rows)).round().double(), rows.double()
    reference = rows * (x8 @ ((weight / scale).round() * scale).t())
    product = engine.decoder.step_engine.engine.output
    for rows in (3, 9, onednn_rows):  # the loop: one group of rows, three (the last padded); oneDNN's
        got = product(x[:rows])
        torch.testing.assert_close(got.double(), reference[:rows], rtol=1e-5, atol=1e-5 * reference.abs().max().item())
        assert (got.double() - x[:rows].double() @ weight.t()).abs().max() > 1e-4  # int8: not float32's product
        torch.testing.assert_close(product(x[:rows - 2]), got[:rows - 2], rtol=0, atol=0)  # rows alone as among others
    sample = _sample(task, sep)
    (scores, _), (int8_scores, _) = _steps(eager, task, sample, sep), _steps(engine, task, sample, sep)
    error = torch.cat([(a - b).abs().flatten() for a, b in zip(scores[1:], int8_scores[1:])])
    assert 0 < error.mean() < 0.02 and error.max() < 0.2, (error.mean(), error.max())


@pytest.mark.parametrize("extra", [FORMS[0], FORMS[-1]])
def test_the_int8_forms_float16_state_gives_the_eager_steps_with_their_state_rounded(model_pair, extra):
    """--int8-inference keeps the causal state in float16 (the products here in float32: no matrix has int8_min_weights
    numbers): the scores of the eager steps whose state is rounded to float16 after each step, and those states
    (within float16's rounding: the sums' order may round a number the other way, a step's cancellation grow that;
    the scores within 1e-4, the change of one float16 rounding: 1e-5 held natively, not with ATen's AVX2 kernels)."""
    task, eager, engine, sep = model_pair(*extra, int8=True, int8_min_weights=10**9)
    step_engine, sample = _counted(engine), _sample(task, sep)
    scores, states = _steps(eager, task, sample, sep, float16_state=True)
    engine_scores, engine_states = _steps(engine, task, sample, sep)
    assert step_engine.calls == 7 and all(s.dtype == torch.float16 for s in engine_states)
    torch.testing.assert_close(engine_scores, scores, rtol=1e-4, atol=1e-4)
    scale = max(s.abs().max() for s in states)
    torch.testing.assert_close([s.float() for s in engine_states], states, rtol=2e-3, atol=2e-3 * scale)


def test_steps_under_autograd_run_eagerly_and_bad_models_are_refused(model_pair, translation_model, lm_model):
    task, eager, engine, sep = model_pair(*GATE_SOFTMAX_CROSS)
    step_engine = _counted(engine)
    with torch.enable_grad():
        engine.decoder.set_beam_size(1)
        state, prev = {}, torch.full((1, 1), task.target_dictionary.eos())
        enc = engine.encoder(*_sample(task, sep, batch=1)["net_input"].values())
        for t in range(3):
            engine.decoder(prev, encoder_out=enc, incremental_state=state)
            prev = torch.cat([prev, prev[:, :1]], 1)
    assert step_engine.calls == 0
    _, arccos = translation_model("--rfa-kernel", "arccos")
    with pytest.raises(ValueError, match="gaussian"):
        to_decoding_form_(arccos.eval(), compiled_step=True)
    _, softmax = translation_model("--decoder-attention", "softmax", rfa_flags=False)
    with pytest.raises(ValueError, match="RFA decoder"):
        to_decoding_form_(softmax.eval(), compiled_step=True)
    _, adaptive = lm_model("--rfa-gate", "--adaptive-softmax-cutoff", "20,40")
    with pytest.raises(ValueError, match="adaptive_softmax is not compiled"):
        to_decoding_form_(adaptive.eval(), compiled_step=True)
    _, conv = lm_model("--rfa-gate", "--rfa-short-conv", "4")
    with pytest.raises(ValueError, match="--rfa-short-conv is not compiled"):
        to_decoding_form_(conv.eval(), compiled_step=True)
