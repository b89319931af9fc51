"""The study specs of results/: every variant's flags parse with fairseq-train's parser, the committed
JSONL still reports, and (slow) tiny runs of the translation, conversion and LM studies go through
the real CLIs: fairseq-train, fairseq-generate + sacreBLEU, fairseq-eval-lm."""
import gzip
import os
import re
import shutil
import sys

import pytest
import torch

from rfa_test_utils import REPO

sys.path.insert(0, os.path.join(REPO, "results"))
import convert  # noqa: E402
import documents  # noqa: E402
import lra  # noqa: E402
import quality  # noqa: E402
import recall  # noqa: E402
import runner  # noqa: E402
import stateful_lm  # noqa: E402

SPECS = (quality, convert, stateful_lm, lra, recall)


def test_every_translation_variant_parses_with_fairseq_train():
    """No queued run fails on a misspelt option hours after the queue was started."""
    from fairseq import options
    s = quality.SETTINGS["screen"]
    for variant in quality.VARIANTS:
        flags = quality.train_flags(variant, s, 1, runner.ROOT / "data-bin")
        args = options.parse_args_and_arch(options.get_training_parser(), [str(f) for f in flags])
        assert args.arch in ("transformer_iwslt_de_en", "rfa_transformer_iwslt_de_en"), variant
        assert args.encoder_layers == args.decoder_layers == 2 and args.encoder_ffn_embed_dim == 512
    f32 = options.parse_args_and_arch(options.get_training_parser(), ["data-bin", *quality.VARIANTS["gate_softcross_f32"]])
    assert f32.rfa_causal_feature_dim == 32 and f32.rfa_gate


def test_every_lm_and_classifier_variant_parses_with_fairseq_train():
    from fairseq import options
    for task, flags, *_ in stateful_lm.VARIANTS.values():
        options.parse_args_and_arch(options.get_training_parser(), ["data-bin", "--task", task, *flags])
    for variant, flags in recall.VARIANTS.items():
        args = options.parse_args_and_arch(options.get_training_parser(), ["data-bin", "--task", "language_modeling",
                                                                           *map(str, flags)])
        assert getattr(args, "rfa_gate_bias_last", None) == (float(variant[-1]) if "last" in variant else None)
    for variant, flags in lra.VARIANTS.items():
        args = options.parse_args_and_arch(options.get_training_parser(), [
            "data-bin", "--user-dir", "rfa_fairseq", "--task", "sentence_prediction", "--num-classes", "10",
            *map(str, lra.SETTINGS["tiny"]["model"]), *flags])
        assert args.encoder_attention == variant


def test_diagnostics_run_where_the_model_has_rfa_modules():
    """scripts/rfa_diagnostics.py reads RFA modules: an RFA decoder or an rfa / favor encoder."""
    assert [v for v in quality.VARIANTS if not quality.has_rfa_modules(v)] == ["softmax", "softdec", "softdec_enc_lara"]


def test_conversion_rows_are_the_recorded_ones():
    assert list(convert.VARIANTS) == [
        "softmax", "converted", "finetuned-0.1", "finetuned-0.2", "converted_softcross", "finetuned_softcross-0.1",
        "finetuned_softcross-0.2", "scratch-0.1", "scratch-0.2", "scratch_softcross-0.1", "scratch_softcross-0.2"]


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.NAME)
def test_the_committed_records_report_under_known_names(spec):
    """Every committed record names a setting and a variant of its spec (or one it has retired), and
    has the spec's metrics."""
    recorded = runner.load(runner.ROOT / spec.OUT)
    assert recorded
    for r in recorded:
        assert r["setting"] in spec.SETTINGS and r["variant"] in {**spec.VARIANTS, **getattr(spec, "RETIRED", {})}, r
    table = runner.report(spec, recorded).splitlines()
    assert len(table) == 2 + len({(runner.label(spec, r), r["variant"]) for r in recorded})


def tiny(spec, monkeypatch, **sizes):
    monkeypatch.setitem(spec.SETTINGS, "tiny", {**spec.SETTINGS[next(iter(spec.SETTINGS))], **sizes})


@pytest.fixture(scope="module")
def multi30k(tmp_path_factory):
    """The Multi30k data prepared once (sentencepiece, fairseq-preprocess) for the translation tests."""
    work = tmp_path_factory.mktemp("multi30k")
    quality.prepare(type("A", (), {"work": work}))
    return work


@pytest.mark.slow
def test_a_tiny_translation_run_trains_decodes_scores_and_resumes(multi30k, tmp_path, monkeypatch):
    tiny(quality, monkeypatch, layers=1, dim=16, ffn=32, heads=2, updates=4, warmup=1, splits=("test",))
    out, work = tmp_path / "out.jsonl", tmp_path / "work"
    shutil.copytree(multi30k / "data", work / "data")
    common = ["--setting", "tiny", "--variants", "gate_softcross", "--work", str(work), "--out", str(out), "--cpu"]
    quality.main(quality, [*common, "--updates", "2"])  # a probe: two updates
    (probe,) = runner.load(out)
    assert probe["updates"] == 2 and 0 <= probe["test_bleu"] < 100 and probe["test_tokens_per_s"] > 0
    # fairseq logs train_wall in whole seconds: two tiny updates on a fast machine can log 0 (no s_per_update)
    assert probe["s_per_update_with_validation"] > 0
    assert probe["s_per_update"] is None or probe["s_per_update"] > 0
    assert probe["peak_mb"] > 100 and probe["device"] == "cpu"
    # the full run, interrupted after the probe's two updates: it resumes from that checkpoint
    full = work / "tiny" / "gate_softcross-seed1"
    full.mkdir()
    shutil.copy(work / "tiny" / "gate_softcross-seed1-u2" / "checkpoint_last.pt", full)
    quality.main(quality, common)
    assert "Loaded checkpoint" in (full / "train.log").read_text()
    assert "num_updates 4" in (full / "train.log").read_text()
    probe, resumed = runner.load(out)
    assert resumed["updates"] == 4 and resumed["s_per_update"] is None  # no time per update for a resumed run
    quality.main(quality, common)  # recorded: nothing runs
    assert len(runner.load(out)) == 2


@pytest.mark.slow
def test_a_tiny_conversion_reuses_the_quality_runs(multi30k, tmp_path, monkeypatch):
    tiny(quality, monkeypatch, layers=1, dim=16, ffn=32, heads=2, updates=10, warmup=2)
    out, work = tmp_path / "out.jsonl", tmp_path / "work"
    shutil.copytree(multi30k / "data", work / "data")
    rows = ["softmax", "converted_softcross", "finetuned_softcross-0.1", "scratch_softcross-0.1"]
    convert.main(convert, ["--setting", "tiny", "--variants", *rows, "--work", str(work), "--out", str(out), "--cpu"])
    got = {r["variant"]: r for r in runner.load(out)}
    assert [got[r]["total_updates"] for r in rows] == [10, 10, 11, 11]
    # the scratch row trained quality.py's gate_softcross run to 10 updates, then went on from it
    assert (work / "tiny" / "gate_softcross-seed1" / "timing.json").exists()
    assert "Loaded checkpoint" in (work / "tiny" / "scratch_softcross-0.1-seed1" / "train.log").read_text()
    assert all(0 <= r["test_bleu"] < 100 for r in got.values())


@pytest.mark.slow
def test_a_tiny_document_run_scores_whole_documents_and_buckets(multi30k, tmp_path, monkeypatch):
    """Documents built from the prepared sentences, a two-update model decoded a document a line,
    its BLEU over whole documents (separators removed) and by reference length."""
    tiny(documents, monkeypatch, layers=1, dim=16, ffn=32, heads=2, updates=2, warmup=1,
         finetune=dict(updates=1, warmup=1, lr="1e-3"))
    monkeypatch.setattr(documents, "GENERATE", ["--max-len-a", "0", "--max-len-b", "12"])  # untrained: no </s>
    monkeypatch.setattr(documents, "QUANTILES", (0.0, 0.5))
    out, work = tmp_path / "out.jsonl", tmp_path / "work"
    shutil.copytree(multi30k / "data", work / "data")
    documents.main(documents, ["--setting", "tiny", "--variants", "gate_sentidx", "--work", str(work), "--out",
                               str(out), "--cpu"])
    (record,) = runner.load(out)
    docs = work / "docs"
    # trained on the sentences in the documents' dictionary, then finetuned on the documents
    run = work / "tiny" / "gate_sentidx-seed1"
    assert "sentences/bin train de-en 29000 examples" in (run / "sentences" / "train.log").read_text()
    log = (run / "train.log").read_text()
    assert "loading pretrained model from" in log and "docs/bin train de-en 1333 examples" in log
    assert (docs / "sentences" / "bin" / "dict.en.txt").read_text() == (docs / "bin" / "dict.en.txt").read_text()
    assert record["sentences_train_s"] > 0 and record["train_s"] > 0
    lengths = [int(n) for n in (docs / "test.tgt_tokens").read_text().split()]
    assert len(lengths) == len((docs / "test.ref").read_text().splitlines()) > 20
    assert max(lengths) > 512 and min(lengths) <= 128, "the buckets are all filled"
    assert sum(record[f"test_docs_{lo}"] for lo, _ in documents.BUCKETS) == len(lengths)
    assert 0 <= record["test_bleu"] < 100 and all(0 <= record[f"test_bleu_{lo}"] < 100 for lo, _ in documents.BUCKETS)
    # decoded again free and with each candidate floor: the training sentences' shortest ratio and their median
    assert 0 < record["q0.0_floor"] < record["q0.5_floor"] and record["free_floor"] is None
    assert all(0 <= record[f"{how}_{split}_bleu"] < 100 for how in ("free", "q0.0", "q0.5") for split in ("valid", "test"))
    generated = (work / "tiny" / "gate_sentidx-seed1" / "generate.test.out").read_text()
    assert generated.count("\nH-") + generated.startswith("H-") == len(lengths)
    # the references are the shipped sentences, in order, a document a line
    with gzip.open(os.path.join(REPO, "data/multi30k/test.en.gz"), "rt", encoding="utf-8") as f:
        sentences = " ".join(line.strip() for line in f)
    assert " ".join((docs / "test.ref").read_text().split("\n")).split() == sentences.split()


@pytest.mark.slow
def test_reversed_documents_go_from_english_to_german_in_their_own_folders(multi30k, tmp_path, monkeypatch):
    monkeypatch.setattr(documents, "LANGS", documents.LANGS)  # --reverse sets it for the process
    shutil.copytree(multi30k / "data", tmp_path / "work_en_de" / "data")
    a = type("A", (), {"work": tmp_path / "work", "out": tmp_path / "out.jsonl", "reverse": True})
    docs = documents.prepare(a)
    assert (a.work, a.out, docs) == (tmp_path / "work_en_de", tmp_path / "out_en_de.jsonl", a.work / "docs")
    assert (docs / "bin" / "train.en-de.de.idx").exists() and (docs / "sentences" / "bin" / "train.en-de.en.idx").exists()
    with gzip.open(os.path.join(REPO, "data/multi30k/test.de.gz"), "rt", encoding="utf-8") as f:
        german = " ".join(line.strip() for line in f)
    assert " ".join((docs / "test.ref").read_text().split("\n")).split() == german.split()
    assert all("<sep>" in line for line in (docs / "test.spm.de").read_text().splitlines()[:5])


def test_document_bleu_removes_the_separators(tmp_path):
    (tmp_path / "gen").write_text("H-1\t-0.1\ta man walks<sep> a big dog\nH-0\t-0.2\tthe cat sits <sep> on the mat\n")
    (tmp_path / "ref").write_text("the cat sits on the mat\na man walks a big dog\n")
    (tmp_path / "len").write_text("100\n300\n")
    (tmp_path / "pieces").write_text("▁the ▁cat ▁sits <sep> ▁on ▁the ▁mat\n▁a ▁man ▁walks <sep> ▁a ▁big ▁dog\n")
    found = documents.score(tmp_path / "gen", tmp_path / "ref", tmp_path / "len", tmp_path / "pieces")
    assert found["bleu"] == 100.0 and found["bleu_0"] == found["bleu_256"] == 100.0
    assert found["docs_0"] == found["docs_256"] == 1 and "docs_128" not in found
    assert found["sentences"] == 1.0 and found["repeats"] == 0.0


def test_documents_count_the_sentences_written_again(tmp_path):
    """A decoder that loses its place writes a sentence again: more sentences than the reference, repeats."""
    (tmp_path / "gen").write_text("H-0\t-0.1\ta dog runs <sep> a dog runs <sep> a dog runs <sep> a cat sits\n"
                                  "H-1\t-0.1\ta man walks\n")
    (tmp_path / "ref").write_text("a dog runs a cat sits\na man walks\n")
    (tmp_path / "len").write_text("600\n50\n")
    (tmp_path / "pieces").write_text("▁a ▁dog ▁runs <sep> ▁a ▁cat ▁sits\n▁a ▁man ▁walks\n")
    found = documents.score(tmp_path / "gen", tmp_path / "ref", tmp_path / "len", tmp_path / "pieces")
    assert found["sentences"] == round(5 / 3, 3) and found["repeats"] == round(2 / 5, 3)
    assert found["sentences_512"] == 2.0 and found["repeats_512"] == 0.5 and found["repeats_0"] == 0.0


def test_documents_cut_short_are_counted_per_document(tmp_path):
    """One document ending after 1 of 5 sentences is cut short even where another's extra sentences even the mean."""
    (tmp_path / "gen").write_text("H-0\t-0.1\ta b\nH-1\t-0.1\tc <sep> d <sep> e <sep> f <sep> g <sep> h <sep> i <sep> j\n"
                                  "H-2\t-0.1\tk <sep> l <sep> m <sep> n\n")
    (tmp_path / "ref").write_text("a b c d e\nc d e f g\nk l m n o\n")
    (tmp_path / "len").write_text("600\n700\n100\n")
    (tmp_path / "pieces").write_text("a <sep> b <sep> c <sep> d <sep> e\nc <sep> d <sep> e <sep> f <sep> g\n"
                                     "k <sep> l <sep> m <sep> n <sep> o\n")
    found = documents.score(tmp_path / "gen", tmp_path / "ref", tmp_path / "len", tmp_path / "pieces")
    assert found["sentences_512"] == 0.9 and found["cut_512"] == 1 and found["fewest_512"] == 0.2
    assert found["cut"] == 1 and found["cut_0"] == 0 and found["fewest_0"] == 0.8  # 4 of 5 is not cut short


@pytest.mark.slow
def test_rescoring_leaves_a_run_whose_folder_now_holds_another_runs_outputs(monkeypatch, tmp_path):
    monkeypatch.setattr(documents, "scores", lambda out, data, split: {f"{split}_bleu": 20.0})
    rescore = lambda record: documents.rescore("softmax", {}, 1, tmp_path, tmp_path, None, record)  # noqa: E731
    assert rescore({"valid_bleu": 20.0, "test_bleu": 21.0}) == {}
    assert rescore({"valid_bleu": 20.0, "test_bleu": 20.0}) == {"valid_bleu": 20.0, "test_bleu": 20.0}


@pytest.mark.slow  # trains and scores through the command lines (about 45 s)
def test_a_tiny_stateful_lm_run(tmp_path, monkeypatch):
    src = tmp_path / "src"
    src.mkdir()
    with gzip.open(os.path.join(REPO, "data/multi30k/train.en.gz"), "rt", encoding="utf-8") as f:
        lines = [next(f) for _ in range(1200)]
    for name, off in (("wiki.valid.tokens", 0), ("wiki.test.tokens", 600)):
        text = "".join(f" = Article {a} = \n" + "".join(f" {s}" for s in lines[off + 30 * a:off + 30 * a + 30])
                       for a in range(20))
        (src / name).write_text(text, encoding="utf-8")
    tiny(stateful_lm, monkeypatch, layers=1, dim=32, cutoffs="200,400", block=32, updates=3, warmup=1)
    out = tmp_path / "out.jsonl"
    stateful_lm.main(stateful_lm, ["--setting", "tiny", "--variants", "rfa_gate_burnin", "softmax", "softmax_plain",
                                   "--source", str(src), "--work", str(tmp_path / "work"), "--out", str(out), "--cpu"])
    stateful, softmax, plain = runner.load(out)
    assert 1 < plain["test_ppl_blocks"] < 1e4  # a full softmax output layer: the cross_entropy criterion
    assert "adaptive_softmax" not in str(torch.load(tmp_path / "work/tiny/softmax_plain-seed1/checkpoint_best.pt",
                                                    weights_only=False)["model"].keys())
    assert stateful["train_task"] == "rfa_stateful_lm" and 1 < stateful["test_ppl_stateful"] < 1e4
    assert 1 < stateful["test_ppl_blocks"] < 1e4 and 1 <= stateful["best_update"] <= 3
    assert 1 < softmax["test_ppl_sliding"] < 1e4 and "test_ppl_stateful" not in softmax
    articles = [(tmp_path / "work" / "text" / f"{n}.tokens").read_text().count(" = Article") for n in ("train", "valid", "test")]
    assert articles == [32, 4, 4]  # article i: valid if i % 10 == 3, test if i % 10 == 7


def test_recall_examples_ask_for_every_pair_once():
    """An MQAR example: P distinct keys with their values, then each key once among the fillers, its value after it."""
    import random
    tokens = recall.sequence(64, 8, random.Random(0))
    queries = [i for i in range(16, 64) if tokens[i].startswith("k")]
    assert len(tokens) == 64 and len(set(tokens[:16:2])) == 8 and len(queries) == 8
    written = dict(zip(tokens[:16:2], tokens[1:16:2]))
    assert sorted(tokens[q] for q in queries) == sorted(written) and all(tokens[q + 1] == written[tokens[q]] for q in queries)
    assert tokens[16:].count("_") == 64 - 16 - 16 and recall.examples(recall.SETTINGS["L256_P16"], "valid")[0][:2] == \
        recall.examples(recall.SETTINGS["L256_P16"], "valid")[0][:2]  # drawn from the split's own seed


def test_the_recall_loss_scores_the_answers_alone():
    """recall_answers: the loss and the hits of the tokens after a repeated key, none of the others'."""
    from fairseq.data import Dictionary
    from recall_lm import RecallAnswers
    d = Dictionary()
    for w in ("k1", "k2", "v1", "v2", "_"):
        d.add_symbol(w)
    rows = [["k1", "v1", "k2", "v2", "_", "k2", "v2", "k1"], ["k2", "v1", "k1", "v2", "k1", "v2", "_", "_"]]
    ids = torch.tensor([[d.index(w) for w in row] for row in rows])
    target = torch.cat([ids[:, 1:], torch.tensor([[d.index("v1")], [d.pad()]])], 1)  # the next tokens; row 2's last: pad
    logits = torch.randn(2, 8, len(d), generator=torch.Generator().manual_seed(0))

    class Model:
        get_normalized_probs = staticmethod(lambda out, log_probs: out.log_softmax(-1))
        __call__ = staticmethod(lambda src_tokens: logits)
    criterion = RecallAnswers(type("Task", (), {"source_dictionary": d, "target_dictionary": d})())
    loss, answers, log = criterion(Model(), {"net_input": {"src_tokens": ids}, "target": target, "ntokens": 16})
    where = [(0, 5), (0, 7), (1, 4)]  # the repeated keys: k2 and k1 in row 1, k1 in row 2
    lprobs = logits.log_softmax(-1)
    assert answers == 3 and torch.allclose(loss, -sum(lprobs[b, i, target[b, i]] for b, i in where))
    assert log["hits"] == sum(int(lprobs[b, i].argmax() == target[b, i]) for b, i in where)


@pytest.mark.slow  # trains and scores through the command lines
def test_a_tiny_recall_run_scores_the_queries(tmp_path, monkeypatch):
    tiny(recall, monkeypatch, length=32, pairs=4, updates=10, warmup=2, rows=8)
    monkeypatch.setattr(recall, "SPLITS", {"train": 64, "valid": 8, "test": 8})
    out = tmp_path / "out.jsonl"
    recall.main(recall, ["--setting", "tiny", "--variants", "softmax", "rfa_gate_last8", "--work", str(tmp_path),
                         "--out", str(out), "--cpu"])
    for r in runner.load(out):
        assert 0 <= r["test_recall"] <= 100 and r["valid_loss"] > 0 and r["best_update"] in (1, 2, 3, 4, 5, 6, 7, 8, 9, 10)
    assert (tmp_path / "L32_P4" / "bin" / "dict.txt").read_text().count("\n") == 2 * recall.KEYS + 1
    # a setting with ``init`` continues that setting's model of the same variant and seed, on its own data
    monkeypatch.setitem(recall.SETTINGS, "longer", dict(recall.SETTINGS["tiny"], length=48, pairs=6, init="tiny"))
    recall.main(recall, ["--setting", "longer", "--variants", "rfa_gate_last8", "--work", str(tmp_path), "--out", str(out),
                         "--cpu"])
    start = tmp_path / "tiny" / "rfa_gate_last8-seed1" / "checkpoint_best.pt"
    assert f"loading pretrained model from {start}" in (tmp_path / "longer" / "rfa_gate_last8-seed1" / "train.log").read_text()
    assert [r["setting"] for r in runner.load(out)].count("longer") == 1 and (tmp_path / "L48_P6" / "bin").is_dir()


@pytest.mark.slow
def test_a_tiny_listops_run(tmp_path, monkeypatch):
    data = dict(lra.SETTINGS["tiny"]["data"], train=64, valid=16, test=16, max_length=60)
    monkeypatch.setitem(lra.SETTINGS, "tiny", dict(lra.SETTINGS["tiny"], data=data, model=lra.model(1, 16), updates=3,
                                                   warmup=1))
    out = tmp_path / "out.jsonl"
    lra.main(lra, ["--setting", "tiny", "--variants", "softmax", "lara", "--work", str(tmp_path), "--out", str(out),
                   "--cpu"])
    for r in runner.load(out):
        assert 0 <= r["test_accuracy"] <= 100 and 0 <= r["valid_accuracy"] <= 100 and r["peak_mb"] > 100
    table = {row["variant"]: row for row in parse(runner.report(lra, runner.load(out)))}
    # softmax is its own reference, whatever the number of threads the run had
    assert re.search(r"\(1\.00x, \d+ thr\)$", table["softmax"]["peak MB"]) and list(table) == ["softmax", "lara"]


def parse(table):
    head, _, *rows = [[c.strip() for c in line.strip("|").split("|")] for line in table.splitlines()]
    return [dict(zip(head, row)) for row in rows]

