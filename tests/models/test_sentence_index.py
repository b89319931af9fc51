"""``--sentence-index``: sentence numbers from the <sep> tokens, added to the inputs; decoding equals the full pass."""
import random

import pytest
import torch
from fairseq import checkpoint_utils
from fairseq.sequence_generator import SequenceGenerator

from rfa_fairseq.models import rfa_transformer
from rfa_fairseq.models.sentence_index import sentence_embedding, sentence_length_ratios, sentence_numbers
from rfa_fairseq.engines.step_graphs import StepGraphs

from rfa_test_utils import (TINY_DECODER, TINY_ENCODER, build_from_cli, emulate_cuda_graphs, fx_capture,
                            random_tokens, run_cli)

SOFTMAX_CROSS = ["--cross-attention", "softmax", "--rfa-gate", "--rfa-causal-feature-dim", "64"]
WINDOW = ["--cross-sentence-window", "1"]
DECODERS = [pytest.param(SOFTMAX_CROSS, id="rfa-gate"), pytest.param(["--decoder-attention", "softmax"], id="softmax"),
            pytest.param(SOFTMAX_CROSS + ["--decoder-learned-pos", "--encoder-learned-pos"], id="learned-positions"),
            pytest.param(SOFTMAX_CROSS + WINDOW, id="rfa-gate-window"),
            pytest.param(["--decoder-attention", "softmax", "--cross-sentence-window", "0"], id="softmax-window")]


def _with_separators(dictionary, separator, batch, length, seed):
    tokens = random_tokens(dictionary, batch, length, torch.Generator().manual_seed(seed))
    tokens[:, 3::5] = separator
    return tokens


def test_sentence_numbers_count_separators():
    tokens = torch.tensor([[5, 9, 6, 9, 9, 7]])  # 9: the separator
    assert sentence_numbers(tokens, 9, written=False).tolist() == [[0, 0, 1, 1, 2, 3]]
    assert sentence_numbers(tokens, 9, written=True).tolist() == [[0, 1, 1, 2, 3, 3]]
    table = sentence_embedding(torch.arange(40), 33)
    assert table.shape == (40, 33) and table[0].abs().max() == 0 and table[:, -1].abs().max() == 0
    distances = torch.cdist(table, table) + torch.eye(40)
    assert distances.min() > 0.1  # every number its own vector


@pytest.mark.parametrize("extra", DECODERS)
def test_incremental_decoding_equals_the_full_pass(documents_model, extra):
    task, model, sep = documents_model("--sentence-index", *extra)
    src = _with_separators(task.source_dictionary, sep, 3, 17, 1)
    src[0, :4] = task.source_dictionary.pad()
    lengths = src.ne(task.source_dictionary.pad()).sum(1)
    prev = _with_separators(task.target_dictionary, sep, 3, 19, 2)
    prev[:, 0] = task.target_dictionary.eos()
    with torch.no_grad():
        full, _ = model(src, lengths, prev)
        enc, state, steps = model.encoder(src, src_lengths=lengths), {}, []
        for t in range(prev.size(1)):
            steps.append(model.decoder(prev[:, :t + 1], encoder_out=enc, incremental_state=state)[0][:, -1])
    torch.testing.assert_close(torch.stack(steps, 1), full, rtol=1e-5, atol=1e-5)


def test_changes_nothing_without_separators_and_something_with_them(documents_model):
    (task, plain, sep), (_, indexed, _) = documents_model(*SOFTMAX_CROSS), documents_model("--sentence-index", *SOFTMAX_CROSS)
    assert torch.equal(torch.cat([p.flatten() for p in plain.parameters()]),
                       torch.cat([p.flatten() for p in indexed.parameters()]))  # no weights of its own
    src = random_tokens(task.source_dictionary, 2, 12, torch.Generator().manual_seed(3))
    prev = random_tokens(task.target_dictionary, 2, 10, torch.Generator().manual_seed(4))
    lengths = torch.full((2,), 12)
    with torch.no_grad():
        assert torch.equal(plain(src, lengths, prev)[0], indexed(src, lengths, prev)[0])
        src[:, 5], prev[:, 4] = sep, sep
        assert not torch.allclose(plain(src, lengths, prev)[0], indexed(src, lengths, prev)[0])


def test_refused_without_a_separator(translation_model):
    with pytest.raises(ValueError, match="--sentence-index counts <sep>"):
        translation_model("--sentence-index", *SOFTMAX_CROSS, rfa_flags=False)


def test_length_ratios_pair_each_target_sentence_with_its_source_sentence():
    source, target = torch.tensor([5, 6, 9, 7, 2]), torch.tensor([5, 9, 6, 7, 8, 2])  # 9: <sep>, 2: </s>
    assert sentence_length_ratios(source, target, 9).tolist() == [1 / 3, 3 / 2]  # 1 of 2 + <sep>, 3 of 1 + </s>
    assert sentence_length_ratios(source, torch.tensor([5, 6, 2]), 9).numel() == 0  # the counts differ: no pairs


def test_the_floor_is_a_quantile_of_the_training_data_and_the_checkpoint_keeps_it(tmp_path):
    """fairseq-train's model takes --sentence-min from its train split's sentence pairs (the naive count's quantile);
    the checkpoint keeps it, so a decoder loads it without the training data, and --model-overrides replaces it."""
    rng, pairs = random.Random(0), []
    for split, documents in (("train", 40), ("valid", 4)):
        lines = {"de": [], "en": []}
        for _ in range(documents):
            sizes = [(rng.randint(1, 12), rng.randint(1, 12)) for _ in range(rng.randint(1, 5))]
            pairs += sizes if split == "train" else []
            for lang, side in (("de", 0), ("en", 1)):
                lines[lang].append(" <sep> ".join(" ".join(f"w{rng.randint(0, 9)}" for _ in range(n[side])) for n in sizes))
        for lang in ("de", "en"):
            (tmp_path / f"{split}.{lang}").write_text("".join(line + "\n" for line in lines[lang]))
    run_cli("fairseq-preprocess", "--source-lang", "de", "--target-lang", "en", "--joined-dictionary", "--workers", "1",
            "--trainpref", tmp_path / "train", "--validpref", tmp_path / "valid", "--destdir", tmp_path / "bin")
    naive = torch.quantile(torch.tensor([t / (s + 1) for s, t in pairs], dtype=torch.float64),
                           rfa_transformer.SENTENCE_MIN_QUANTILE).item()
    flags = ["--arch", "rfa_transformer", *TINY_ENCODER, *TINY_DECODER, "--rfa-gate", "--sentence-index"]
    _, model, args = build_from_cli(tmp_path / "bin", flags)
    assert model.decoder.sentence_min == args.sentence_min == pytest.approx(naive) and 0 < naive < 1
    history = [{"criterion_name": "x", "optimizer_name": "x", "lr_scheduler_state": {}, "num_updates": 0}]
    torch.save({"args": args, "model": model.state_dict(), "optimizer_history": history, "extra_state": {}},
               tmp_path / "ckpt.pt")
    for f in (tmp_path / "bin").glob("train.*"):  # decoding without the training data
        f.unlink()
    for overrides, floor in (({}, naive), ({"sentence_min": 0.25}, 0.25)):
        (loaded,), _ = checkpoint_utils.load_model_ensemble([str(tmp_path / "ckpt.pt")],
                                                            arg_overrides=dict(data=str(tmp_path / "bin"), **overrides))
        assert loaded.decoder.sentence_min == pytest.approx(floor)
    _, model, _ = build_from_cli(tmp_path / "bin", flags)  # no floor kept, no training data: the former default
    assert model.decoder.sentence_min == rfa_transformer.SENTENCE_MIN


@pytest.mark.parametrize("flags,error", [
    (["--sentence-min", "0.3", *SOFTMAX_CROSS], "--sentence-min is the floor of --sentence-index's"),
    (["--sentence-min", "-0.1", "--sentence-index", *SOFTMAX_CROSS], "--sentence-min must be 0 or a positive"),
    (["--cross-sentence-window", "1", *SOFTMAX_CROSS], "needs --sentence-index and --cross-attention softmax"),
    (["--cross-sentence-window", "1", "--sentence-index", "--cross-attention", "rfa"], "needs --sentence-index and"),
    (["--cross-sentence-window", "-2", "--sentence-index", *SOFTMAX_CROSS], "--cross-sentence-window")])
def test_a_window_without_what_it_needs_is_refused(documents_model, flags, error):
    with pytest.raises(ValueError, match=error):
        documents_model(*flags)


def test_the_windowed_decoding_state_does_not_grow_with_the_document(documents_model):
    """RFA-Gate with the window: every tensor a step keeps (the causal state, the source's cached windows) has
    the same size after 8, 64 and 512 target tokens of 1 and of 60 sentences."""
    task, model, sep = documents_model("--sentence-index", *SOFTMAX_CROSS, *WINDOW, "--max-target-positions", "1024")
    src = _with_separators(task.source_dictionary, sep, 2, 40, 6)
    for separators in (False, True):
        prev = random_tokens(task.target_dictionary, 2, 512, torch.Generator().manual_seed(7))
        if separators:
            prev[:, 3::8] = sep
        enc, state, sizes = model.encoder(src, src_lengths=torch.full((2,), 40)), {}, []
        with torch.no_grad():
            for t in range(512):
                model.decoder(prev[:, :t + 1], encoder_out=enc, incremental_state=state)
                if t + 1 in (8, 64, 512):
                    sizes.append({(k, f): v.shape for k, fields in state.items() for f, v in fields.items()
                                  if isinstance(v, torch.Tensor)})
        assert sizes[0] == sizes[1] == sizes[2] and any(f == "window_kv" for _, f in sizes[0])


@pytest.mark.parametrize("extra", [pytest.param([], id="index"), pytest.param(WINDOW, id="window")])
def test_graphed_beam_search_equals_eager_and_the_full_pass(documents_model, monkeypatch, extra):
    """The sentence numbers reach a replayed step through its buffer; every hypothesis, its sentences' windows
    included, scores as the full pass scores it, as finished sentences leave the batch."""
    emulate_cuda_graphs(monkeypatch, fx_capture)
    # without the sentence alignment, whose </s> forced at the length limit scores -1e9 (test_sentence_alignment.py)
    task, model, sep = documents_model("--sentence-index", "--no-sentence-alignment", *SOFTMAX_CROSS, *extra)
    with torch.no_grad():
        model.decoder.output_projection.weight[sep] *= 3.0  # separators written often
    src = _with_separators(task.source_dictionary, sep, 4, 16, 5)
    src[:, -1] = task.source_dictionary.eos()
    sample = {"id": torch.arange(4), "net_input": {"src_tokens": src, "src_lengths": torch.full((4,), 16)}}
    with torch.no_grad():
        model.decoder.output_projection.weight[task.target_dictionary.eos()] *= 2.0
    gen = SequenceGenerator([model], task.target_dictionary, beam_size=4, max_len_b=30, min_len=10)
    with torch.no_grad():
        eager = gen.forward(sample)
        model.decoder.step_engine = StepGraphs(model.decoder)
        graphed = gen.forward(sample)
    assert any((h["tokens"] == sep).sum() > 1 for nbest in eager for h in nbest)
    assert len({len(h["tokens"]) for nbest in eager for h in nbest}) > 1  # sentences finish at different steps
    assert model.decoder.step_engine.graphs
    eos = task.target_dictionary.eos()
    with torch.no_grad():
        for row, nbest in enumerate(eager):
            for h in nbest:
                prev = torch.cat([h["tokens"].new_tensor([eos]), h["tokens"][:-1]])[None]
                lprobs = model.get_normalized_probs(model(src[row:row + 1], torch.tensor([16]), prev), log_probs=True)
                rescored = lprobs[0].gather(-1, h["tokens"][:, None])[:, 0]
                torch.testing.assert_close(rescored, h["positional_scores"], rtol=0, atol=1e-4)
    for nbest_a, nbest_b in zip(eager, graphed, strict=True):
        for a, b in zip(nbest_a, nbest_b, strict=True):
            assert torch.equal(a["tokens"], b["tokens"])
            torch.testing.assert_close(a["positional_scores"], b["positional_scores"], rtol=0, atol=1e-6)


@pytest.mark.parametrize("left", [True, False], ids=["left-pad-src", "right-pad-src"])
def test_a_documents_output_does_not_depend_on_its_batch(documents_model, left):
    """With the window, each document of a padded batch scores as alone: the full pass and the decoding steps."""
    task, model, sep = documents_model("--sentence-index", *SOFTMAX_CROSS, *WINDOW)
    pad, docs = task.source_dictionary.pad(), [_with_separators(task.source_dictionary, sep, 1, n, 8 + n)[0] for n in (21, 9, 14)]
    src = torch.full((3, 21), pad)
    for i, d in enumerate(docs):
        if left:
            src[i, 21 - d.numel():] = d
        else:
            src[i, :d.numel()] = d
    prev = _with_separators(task.target_dictionary, sep, 3, 12, 9)
    prev[:, 0] = task.target_dictionary.eos()
    lengths = src.ne(pad).sum(1)
    with torch.no_grad():
        batched = model(src, lengths, prev)[0]
        enc, state, steps = model.encoder(src, src_lengths=lengths), {}, []
        for t in range(prev.size(1)):
            steps.append(model.decoder(prev[:, :t + 1], encoder_out=enc, incremental_state=state)[0][:, -1])
        for i, d in enumerate(docs):
            alone = model(d[None], torch.tensor([d.numel()]), prev[i:i + 1])[0]
            torch.testing.assert_close(batched[i:i + 1], alone, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.stack(steps, 1), batched, rtol=1e-5, atol=1e-5)
