"""scripts/make_documents.py: sentences of a parallel corpus joined into documents (seconds)."""
import gzip
import os

import pytest

from rfa_test_utils import REPO, load_script

make_documents_script = load_script("scripts", "make_documents.py")
main, make_documents, split_document = (make_documents_script.main, make_documents_script.make_documents,
                                        make_documents_script.split_document)

MULTI30K = os.path.join(REPO, "data", "multi30k")


def corpus(n):
    return [f"quelle {i} ." for i in range(n)], [f"target {i} ." for i in range(n)]


def sizes(docs):
    return [d.size for d in docs]


def test_same_seed_same_documents_other_seed_other_sizes():
    src, tgt = corpus(2000)
    assert make_documents(src, tgt, seed=1) == make_documents(src, tgt, seed=1)
    assert sizes(make_documents(src, tgt, seed=1)) != sizes(make_documents(src, tgt, seed=2))


def test_sizes_within_bounds_and_spread_over_the_range():
    src, tgt = corpus(5000)
    got = sizes(make_documents(src, tgt, min_sentences=4, max_sentences=64))
    assert sum(got) == 5000 and min(got) >= 4 and max(got) <= 64
    # log-uniform: each doubling about a quarter of the documents
    for lo, hi in ((4, 7), (8, 15), (16, 31), (32, 64)):
        share = sum(lo <= s <= hi for s in got) / len(got)
        assert 0.15 < share < 0.35, (lo, hi, share)
    got = sizes(make_documents(*corpus(100), min_sentences=5, max_sentences=5))
    assert got == [5] * 20


def test_every_sentence_once_and_in_order():
    src, tgt = corpus(1234)
    docs = make_documents(src, tgt, min_sentences=3, max_sentences=40, seed=7)
    assert [s for d in docs for s in split_document(d.src)] == src
    assert [t for d in docs for t in split_document(d.tgt)] == tgt
    starts = [d.start for d in docs]
    assert starts == [sum(sizes(docs)[:i]) for i in range(len(docs))]
    for d in docs:
        assert split_document(d.src) == src[d.start:d.start + d.size]


def test_short_input_and_the_last_document():
    src, tgt = corpus(3)  # fewer sentences than the minimum: one short document
    assert sizes(make_documents(src, tgt)) == [3]
    assert make_documents([], []) == []
    for lo, hi in ((4, 8), (4, 64), (3, 5)):  # the rest of a run is never left shorter than the minimum
        for n in range(lo, 200):
            got = sizes(make_documents(*corpus(n), min_sentences=lo, max_sentences=hi, seed=n))
            assert sum(got) == n and min(got) >= lo and max(got) <= hi, (lo, hi, n, got)


def test_ids_no_document_crosses_a_boundary_and_long_ones_are_windowed():
    lengths = {"talk-a": 2, "talk-b": 30, "talk-c": 150, "talk-d": 64, "talk-e": 65}
    ids = [name for name, n in lengths.items() for _ in range(n)]
    src, tgt = corpus(len(ids))
    docs = make_documents(src, tgt, doc_ids=ids, min_sentences=4, max_sentences=64)
    for d in docs:
        assert set(ids[d.start:d.start + d.size]) == {d.doc_id}
    per_talk = {name: [d.size for d in docs if d.doc_id == name] for name in lengths}
    assert per_talk["talk-a"] == [2]     # shorter than the minimum: kept whole
    assert per_talk["talk-b"] == [30]    # fits: one document
    assert per_talk["talk-d"] == [64]
    assert len(per_talk["talk-c"]) >= 3 and sum(per_talk["talk-c"]) == 150
    assert all(4 <= s <= 64 for s in per_talk["talk-c"] + per_talk["talk-e"])
    assert [s for d in docs for s in split_document(d.src)] == src
    # an id that comes back later is another document
    docs = make_documents(*corpus(6), doc_ids=["x", "x", "y", "y", "x", "x"], min_sentences=1)
    assert [(d.start, d.size, d.doc_id) for d in docs] == [(0, 2, "x"), (2, 2, "y"), (4, 2, "x")]


def test_grouping_ignores_the_text():
    """The same seed groups an encoded copy of a corpus exactly as its text."""
    src, tgt = corpus(500)
    encoded = [" ".join("\u2581" + w for w in s.split()) for s in src]
    one = make_documents(src, tgt, seed=3)
    two = make_documents(encoded, encoded, seed=3)
    assert [(d.start, d.size) for d in one] == [(d.start, d.size) for d in two]


def test_separator_round_trip():
    sentences = ["ein hund läuft .", "", "zwei  männer ."]
    docs = make_documents(sentences, sentences, min_sentences=3, max_sentences=3, separator="<brk>")
    assert docs[0].src == "ein hund läuft . <brk>  <brk> zwei  männer ."
    assert split_document(docs[0].src, "<brk>") == sentences
    # as fairseq's --post-process sentencepiece writes it: the separator glued to the word before
    assert split_document("ein hund läuft .<sep> zwei männer .") == ["ein hund läuft .", "zwei männer ."]
    assert split_document("one sentence") == ["one sentence"]


@pytest.mark.parametrize("separator", ["</s>", "<s>", "<pad>", "<unk>", "", "a b"])
def test_bad_separators_refused(separator):
    with pytest.raises(ValueError, match="--separator"):
        make_documents(*corpus(8), separator=separator)


def test_separator_in_a_sentence_refused_naming_the_line():
    src, tgt = corpus(8)
    tgt[5] = "a <sep> b"
    with pytest.raises(ValueError, match=r"target line 6 contains the separator"):
        make_documents(src, tgt)


@pytest.mark.parametrize("lo,hi,name", [(5, 4, "min_sentences"), (0, 4, "min_sentences"),
                                        (4, 0, "max_sentences"), (4, 2.5, "max_sentences")])
def test_bad_sizes_refused_by_name(lo, hi, name):
    with pytest.raises(ValueError, match=name):
        make_documents(*corpus(8), min_sentences=lo, max_sentences=hi)


def test_mismatched_lengths_refused():
    src, tgt = corpus(8)
    with pytest.raises(ValueError, match="source has 8 lines but target has 7"):
        make_documents(src, tgt[:7])
    with pytest.raises(ValueError, match="doc ids has 7 lines but source has 8"):
        make_documents(src, tgt, doc_ids=["a"] * 7)


def write(path, lines):
    with open(path, "w", encoding="utf-8") as f:
        f.write("".join(line + "\n" for line in lines))
    return str(path)


def test_command_refuses_mismatched_files_naming_both(tmp_path, capsys):
    src = write(tmp_path / "a.de", ["x"] * 5)
    tgt = write(tmp_path / "a.en", ["y"] * 4)
    with pytest.raises(SystemExit) as exit_:
        main([src, tgt, str(tmp_path / "out")])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert f"{src} has 5 lines but {tgt} has 4" in err


@pytest.mark.parametrize("flags,message", [
    (["--min-sentences", "8", "--max-sentences", "4"], "--min-sentences (8) must be at most --max-sentences (4)"),
    (["--min-sentences", "0"], "--min-sentences must be a positive integer"),
    (["--max-sentences", "-3"], "--max-sentences must be a positive integer"),
    (["--separator", "</s>"], "--separator </s> is one of fairseq's special symbols"),
])
def test_command_refuses_bad_flags_by_name(tmp_path, capsys, flags, message):
    src = write(tmp_path / "a.de", ["x"] * 5)
    tgt = write(tmp_path / "a.en", ["y"] * 5)
    with pytest.raises(SystemExit) as exit_:
        main([src, tgt, str(tmp_path / "out")] + flags)
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def multi30k(lang, n):
    with gzip.open(os.path.join(MULTI30K, f"train.{lang}.gz"), "rt", encoding="utf-8") as f:
        return [next(f).rstrip("\n") for _ in range(n)]


def test_command_on_multi30k(tmp_path, capsys):
    de, en = multi30k("de", 300), multi30k("en", 300)
    src = write(tmp_path / "train.de", de)
    tgt = write(tmp_path / "train.en", en)
    out = str(tmp_path / "docs" / "train")
    main([src, tgt, out, "--seed", "5"])
    assert "documents" in capsys.readouterr().out
    src_docs = open(out + ".de", encoding="utf-8").read().splitlines()
    tgt_docs = open(out + ".en", encoding="utf-8").read().splitlines()
    rows = [line.split("\t") for line in open(out + ".docs.tsv", encoding="utf-8").read().splitlines()]
    assert rows[0] == ["doc", "sentences", "first_line", "last_line", "src_tokens", "tgt_tokens", "doc_id"]
    rows = rows[1:]
    assert len(rows) == len(src_docs) == len(tgt_docs) > 1
    assert [s for d in src_docs for s in split_document(d)] == de
    assert [t for d in tgt_docs for t in split_document(d)] == en
    for i, (doc, n, first, last, src_tokens, tgt_tokens, doc_id) in enumerate(rows):
        assert int(doc) == i and int(last) - int(first) + 1 == int(n) and 4 <= int(n) <= 64 and doc_id == ""
        assert split_document(tgt_docs[i]) == en[int(first) - 1:int(last)]
        assert int(src_tokens) == len(src_docs[i].split()) and int(tgt_tokens) == len(tgt_docs[i].split())
    assert rows[-1][3] == "300"
    # the same documents from the shipped .gz files, and from the Python function
    main([os.path.join(MULTI30K, "train.de.gz"), os.path.join(MULTI30K, "train.en.gz"), str(tmp_path / "full"),
          "--seed", "5"])
    full = open(str(tmp_path / "full.en"), encoding="utf-8").read().splitlines()
    first_docs = [d.tgt for d in make_documents(de, en, seed=5)]
    assert full[:len(first_docs) - 2] == tgt_docs[:-2] == first_docs[:-2]


def test_command_with_ids_file(tmp_path):
    ids = ["t1"] * 3 + ["t2"] * 100
    src = write(tmp_path / "x.de", [f"satz {i}" for i in range(103)])
    tgt = write(tmp_path / "x.en", [f"sentence {i}" for i in range(103)])
    main([src, tgt, str(tmp_path / "d"), "--doc-ids", write(tmp_path / "x.ids", ids), "--max-sentences", "32"])
    rows = [line.split("\t") for line in open(str(tmp_path / "d.docs.tsv"), encoding="utf-8").read().splitlines()[1:]]
    assert rows[0][1:4] == ["3", "1", "3"] and rows[0][6] == "t1"
    assert all(r[6] == "t2" and 4 <= int(r[1]) <= 32 for r in rows[1:])
    assert sum(int(r[1]) for r in rows) == 103
