"""rfa-translate-documents: plain-text documents in, one translated line per source line out (blank lines where the
input has them, every document whole), whatever the batching; each bad input stops with a message that names it."""
import random
import re

import pytest
import sentencepiece
import torch

from rfa_fairseq.cli.translate_documents import main, read_documents

from rfa_test_utils import TINY_DECODER, TINY_ENCODER, build_from_cli

WORDS = [f"word{i}" for i in range(30)]


@pytest.fixture(scope="module")
def document_model(tmp_path_factory):
    """A sentencepiece model, joined dictionaries with <sep>, and a tiny document model's checkpoint (random
    weights, the documents' setting)."""
    d = tmp_path_factory.mktemp("docmodel")
    rng = random.Random(0)
    text = [" ".join(rng.choices(WORDS, k=rng.randint(3, 8))) for _ in range(300)]
    (d / "text.txt").write_text("\n".join(text) + "\n")
    sentencepiece.SentencePieceTrainer.train(input=str(d / "text.txt"), model_prefix=str(d / "spm"), vocab_size=60,
                                             hard_vocab_limit=False, minloglevel=2)
    spm = sentencepiece.SentencePieceProcessor(model_file=str(d / "spm.model"))
    pieces = [spm.id_to_piece(i) for i in range(3, spm.get_piece_size())]
    for lang in ("de", "en"):
        (d / f"dict.{lang}.txt").write_text("".join(f"{p} 10\n" for p in pieces + ["<sep>"]))
    torch.manual_seed(0)
    _, model, args = build_from_cli(d, ["--task", "translation", "--source-lang", "de", "--target-lang", "en",
                                        "--arch", "rfa_transformer", *TINY_ENCODER, *TINY_DECODER, "--rfa-gate",
                                        "--cross-attention", "softmax", "--sentence-index", "--cross-sentence-window",
                                        "1", "--max-source-positions", "128", "--max-target-positions", "256"])
    torch.save({"args": args, "model": model.state_dict(), "optimizer_history": [{"criterion_name": "x", "optimizer_name": "x", "lr_scheduler_state": {}, "num_updates": 0}], "extra_state": {}}, d / "ckpt.pt")
    return d


def translate(model_dir, inputs, output, *extra):
    main([str(model_dir), "--path", str(model_dir / "ckpt.pt"), "--sentencepiece-model", str(model_dir / "spm.model"),
          "--source-lang", "de", "--target-lang", "en", "--beam", "2", "--cpu", "--documents", *map(str, inputs),
          "--output", str(output), *extra])


def _documents(path, sizes, seed=1):
    rng = random.Random(seed)
    docs = [[" ".join(rng.choices(WORDS, k=rng.randint(2, 6))) for _ in range(n)] for n in sizes]
    path.write_text("\n\n".join("\n".join(d) for d in docs) + "\n")
    return docs


def test_the_output_is_aligned_line_for_line_and_does_not_depend_on_the_batching(document_model, tmp_path):
    _documents(tmp_path / "in.de", [3, 1, 5, 2, 4])
    fixed = ["--max-len-a", "0", "--max-len-b", "40"]  # (fairseq's limit is otherwise the batch's widest source's)
    translate(document_model, [tmp_path / "in.de"], tmp_path / "a.en", "--batch-size", "8", *fixed)
    translate(document_model, [tmp_path / "in.de"], tmp_path / "b.en", "--batch-size", "1", *fixed)
    out, source = (tmp_path / "a.en").read_text().splitlines(), (tmp_path / "in.de").read_text().splitlines()
    assert len(out) == len(source) and all(out[i] == "" for i, line in enumerate(source) if not line)
    assert (tmp_path / "a.en").read_text() == (tmp_path / "b.en").read_text()


def test_several_inputs_are_one_document_each_into_a_folder(document_model, tmp_path):
    for name, n in (("one.de", 3), ("two.de", 2)):
        (tmp_path / name).write_text("\n".join(" ".join(WORDS[i:i + 3]) for i in range(n)) + "\n")
    translate(document_model, [tmp_path / "one.de", tmp_path / "two.de"], tmp_path / "out")
    assert [len((tmp_path / "out" / name).read_text().splitlines()) for name in ("one.de", "two.de")] == [3, 2]


def test_without_the_alignment_no_sentence_is_lost(document_model, tmp_path, caplog):
    """Decoding free to end early or write more sentences: the lines stay aligned, a warning names the documents."""
    _documents(tmp_path / "in.de", [6, 1, 7], seed=2)
    translate(document_model, [tmp_path / "in.de"], tmp_path / "out.en", "--model-overrides",
              "{'no_sentence_alignment': True}", "--max-len-a", "0", "--max-len-b", "6")
    out, source = (tmp_path / "out.en").read_text().splitlines(), (tmp_path / "in.de").read_text().splitlines()
    assert len(out) == len(source) and all(out[i] == "" for i, line in enumerate(source) if not line)
    assert "sentences translated for" in caplog.text


def test_blank_lines_as_people_write_them_come_back_where_they_were(document_model, tmp_path):
    """Runs of blank lines between documents, blank lines at the start and the end (one holding spaces), CRLF and a
    byte-order mark: as many lines out as in, blank where the input's are, each document as it is alone."""
    docs = _documents(tmp_path / "plain.de", [2, 3, 1])
    blank = ["", "  "]
    lines = blank + docs[0] + blank * 2 + docs[1] + [""] + docs[2] + blank
    (tmp_path / "messy.de").write_bytes(("\ufeff" + "\r\n".join(lines) + "\r\n").encode("utf-8"))
    fixed = ["--max-len-a", "0", "--max-len-b", "40"]
    translate(document_model, [tmp_path / "plain.de"], tmp_path / "plain.en", *fixed)
    translate(document_model, [tmp_path / "messy.de"], tmp_path / "messy.en", *fixed)
    out = (tmp_path / "messy.en").read_text(encoding="utf-8").splitlines()
    assert len(out) == len(lines) and all(out[i] == "" for i, line in enumerate(lines) if not line.strip())
    assert [line for line in out if line] == [line for line in (tmp_path / "plain.en").read_text().splitlines() if line]
    assert [d.sentences for d in read_documents([str(tmp_path / "messy.de")])[0].documents] == docs


@pytest.mark.parametrize("text,message", [
    ("", "no document to translate (the file is empty)"), ("\n \n\n", "(the file is blank)"),
    ("a b\nc <sep> d\n", "in.de:2: the sentence holds <sep>")])
def test_bad_documents_are_named(tmp_path, text, message):
    (tmp_path / "in.de").write_text(text)
    with pytest.raises(ValueError, match=re.escape(message)):
        read_documents([str(tmp_path / "in.de")])


def test_bad_inputs_stop_with_a_message(document_model, tmp_path, capsys):
    (tmp_path / "long.de").write_text(" ".join(WORDS * 6) + "\n")
    (tmp_path / "ok.de").write_text("word1 word2\n")
    cases = [([tmp_path / "long.de"], [], "at most 128"),
             ([tmp_path / "ok.de"], ["--sentencepiece-model", str(tmp_path / "missing.model")], "no such file"),
             ([tmp_path / "in.de"], [], "in.de")]
    (tmp_path / "in.de").write_text("\n\n")
    for inputs, extra, message in cases:
        with pytest.raises(SystemExit):
            translate(document_model, inputs, tmp_path / "out.en", *extra)
        assert message in capsys.readouterr().err


@pytest.mark.slow
def test_the_interactive_recipe_writes_what_the_command_writes(document_model, tmp_path):
    """recipes/tools/interactive_documents.sh: the documents through fairseq-interactive, split and decoded by the
    command's own functions; a missing input stops it with the file's name."""
    import os
    import subprocess
    import sys
    _documents(tmp_path / "in.de", [3, 1, 4, 2])
    fixed = ["--max-len-a", "0", "--max-len-b", "40"]
    translate(document_model, [tmp_path / "in.de"], tmp_path / "command.en", *fixed)
    bin_dir, repo = os.path.dirname(sys.executable), os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
    env = dict(os.environ, PATH=bin_dir + os.pathsep + os.environ["PATH"], OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")

    def recipe(source):
        return subprocess.run(["bash", os.path.join(repo, "recipes/tools/interactive_documents.sh"), document_model,
                               document_model / "ckpt.pt", document_model / "spm.model", source, tmp_path / "recipe.en",
                               "--source-lang", "de", "--target-lang", "en", "--beam", "2", "--cpu", *fixed],
                              env=env, capture_output=True, text=True, timeout=300)
    done = recipe(tmp_path / "in.de")
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "recipe.en").read_text() == (tmp_path / "command.en").read_text()
    missing = recipe(tmp_path / "none.de")
    assert missing.returncode == 2 and "none.de: no such file" in missing.stderr
