#!/usr/bin/env python
"""Join consecutive sentences of a parallel corpus into documents, one document per line.

    python scripts/make_documents.py train.de.gz train.en.gz docs/train                 # pseudo-documents
    python scripts/make_documents.py train.de train.en docs/train --doc-ids train.ids   # real documents (talks)

writes ``docs/train.de``, ``docs/train.en`` (one document per line, its sentences joined by the
separator) and ``docs/train.docs.tsv`` (one row per document). Inputs have one sentence per line
(``.gz`` is read compressed), the same number of lines, and are stripped of surrounding spaces.

Sizes. A document has between ``--min-sentences`` (4) and ``--max-sentences`` (64) sentences.
The sizes are drawn log-uniformly from a generator seeded with ``--seed`` (1): each doubling of
the size is about as common as the next (with the defaults, 4-7, 8-15, 16-31 and 32-64 sentences
each make a quarter of the documents), so short and long documents are both common. The draws
depend only on the number of lines, the ids and the seed, never on the text: the same seed on a
sentencepiece-encoded copy of the corpus groups it exactly as the text. Every sentence lands in
exactly one document, in order.

Real documents. With ``--doc-ids`` (a file parallel to the sentences, one id a line), a run of
consecutive equal ids is one real document (a talk, an article). A document never crosses a run's
boundary: a run of at most ``--max-sentences`` sentences is one document as it is, even when it
is shorter than the minimum; a longer run is cut into consecutive windows of drawn sizes. Without
ids the whole input is one run. When the rest of a run after a window would be shorter than the
minimum, that window shrinks so that the rest has the minimum; so the only documents shorter than
``--min-sentences`` are runs (or a whole input) shorter than it, and the last window of a run that
cannot be cut into sizes within the bounds at all (possible only when max < 2 min - 1).

Separator. Sentences are joined by `` <sep> `` (``--separator``): a token of its own, as
concatenation models of document translation usually mark boundaries, which fairseq's dictionary
learns like any word and which the decoder emits between the translated sentences. fairseq's own
symbols (``<s> <pad> </s> <unk>``) are refused: the dictionary encodes a literal ``</s>`` in a
line as the end-of-sentence index, so a model trained on such lines learns to end the output
after the first sentence, and fairseq-generate stops a hypothesis at its first end of sentence.
The separator must not occur in any sentence (refused, naming the line), so that
:func:`split_document` gives the sentences back.

Subwords. Encode the sentence files first and join the encoded files (same seed): the separator
then stays one token, and each sentence is segmented exactly as at sentence level. (A
sentencepiece model given the separator as a user-defined symbol also keeps it one piece, but
writes a lone word-boundary piece before it.) fairseq's ``--post-process sentencepiece`` glues
the separator to the preceding word (``word<sep> next``); :func:`split_document` strips the
spaces around each sentence, so it reads both forms.

The table ``OUT_PREFIX.docs.tsv`` has a header and one row per document: ``doc`` (0-based, as
fairseq numbers the lines of a split: document ``doc`` is line ``doc + 1`` of the output files),
``sentences``, ``first_line`` and ``last_line`` (1-based, inclusive: lines of the input files),
``src_tokens`` and ``tgt_tokens`` (whitespace-separated tokens of the document line, separators
included) and ``doc_id`` (the run's id; empty without ``--doc-ids``).
"""
import argparse
import gzip
import math
import os
import random
from typing import NamedTuple, Optional, Sequence

from rfa_fairseq.validation import positive_int

FAIRSEQ_SPECIALS = ("<s>", "<pad>", "</s>", "<unk>")


class Document(NamedTuple):
    src: str            # the source sentences joined by " SEPARATOR "
    tgt: str
    start: int          # 0-based index of its first sentence in the input
    size: int           # number of sentences
    doc_id: str = ""    # the id of its run ("" without ids)


def check_separator(separator: str) -> str:
    """``separator`` if it can mark sentence boundaries in fairseq text, else ValueError."""
    if not separator or any(c.isspace() for c in separator):
        raise ValueError(f"--separator must be one token without spaces, got {separator!r}")
    if separator in FAIRSEQ_SPECIALS:
        raise ValueError(f"--separator {separator} is one of fairseq's special symbols "
                         f"({', '.join(FAIRSEQ_SPECIALS)}): fairseq's dictionary maps it to its own index "
                         f"(</s>: end of sentence, where decoding stops); use another token such as <sep>")
    return separator


def draw_size(rng: random.Random, lo: int, hi: int) -> int:
    """A document size in [lo, hi], log-uniform: floor(exp(U(log lo, log(hi + 1))))."""
    return min(hi, int(math.exp(rng.uniform(math.log(lo), math.log(hi + 1)))))


def window_sizes(n: int, lo: int, hi: int, rng: random.Random) -> list:
    """Sizes of the consecutive documents a run of ``n`` sentences is cut into (they sum to n)."""
    sizes = []
    while n > hi:
        size = draw_size(rng, lo, hi)
        if n - size < lo:  # the rest would be too short: leave it exactly lo sentences
            size = max(lo, n - lo)
        sizes.append(size)
        n -= size
    return sizes + [n] if n else sizes


def runs(doc_ids: Optional[Sequence[str]], n: int) -> list:
    """(start, length, id) of the runs of consecutive equal ids; one run of n without ids."""
    if doc_ids is None:
        return [(0, n, "")] if n else []
    out = []
    for i, doc_id in enumerate(doc_ids):
        if out and out[-1][2] == doc_id:
            out[-1][1] += 1
        else:
            out.append([i, 1, doc_id])
    return [tuple(r) for r in out]


def make_documents(src_lines, tgt_lines, doc_ids=None, min_sentences=4, max_sentences=64, seed=1,
                   separator="<sep>", names=("source", "target", "doc ids")) -> list:
    """The documents (:class:`Document`) of a parallel corpus given as lists of sentences.
    ``names`` name the three inputs in error messages (the command line passes its file names)."""
    positive_int("min_sentences", min_sentences)
    positive_int("max_sentences", max_sentences)
    if min_sentences > max_sentences:
        raise ValueError(f"min_sentences ({min_sentences}) must be at most max_sentences ({max_sentences})")
    check_separator(separator)
    src = [s.strip() for s in src_lines]
    tgt = [t.strip() for t in tgt_lines]
    if len(src) != len(tgt):
        raise ValueError(f"{names[0]} has {len(src)} lines but {names[1]} has {len(tgt)}: not a parallel corpus")
    if doc_ids is not None:
        doc_ids = [d.strip() for d in doc_ids]
        if len(doc_ids) != len(src):
            raise ValueError(f"{names[2]} has {len(doc_ids)} lines but {names[0]} has {len(src)}: "
                             "one id per sentence is needed")
    for name, lines in zip(names, (src, tgt)):
        for i, line in enumerate(lines):
            if separator in line:
                raise ValueError(f"{name} line {i + 1} contains the separator {separator!r}: "
                                 "choose another --separator")
    rng = random.Random(seed)
    joiner = f" {separator} "
    docs = []
    for start, length, doc_id in runs(doc_ids, len(src)):
        for size in window_sizes(length, min_sentences, max_sentences, rng):
            end = start + size
            docs.append(Document(joiner.join(src[start:end]), joiner.join(tgt[start:end]), start, size, doc_id))
            start = end
    return docs


def split_document(line: str, separator: str = "<sep>") -> list:
    """The sentences of a document line (the inverse of the joining, spaces around each stripped)."""
    return [s.strip() for s in line.split(separator)]


def read_lines(path: str) -> list:
    """The lines of a text file (``.gz``: read compressed), without their newlines. Only "\\n"
    ends a line: a stray carriage return does not split one (and misalign a parallel corpus)."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8", newline="\n") as f:
        return [line.rstrip("\n") for line in f]


def write_documents(out_prefix: str, src_lang: str, tgt_lang: str, docs) -> list:
    """Write OUT_PREFIX.SRC_LANG, OUT_PREFIX.TGT_LANG and OUT_PREFIX.docs.tsv; return their paths."""
    paths = [f"{out_prefix}.{src_lang}", f"{out_prefix}.{tgt_lang}", f"{out_prefix}.docs.tsv"]
    if os.path.dirname(out_prefix):
        os.makedirs(os.path.dirname(out_prefix), exist_ok=True)
    with open(paths[0], "w", encoding="utf-8") as fs, open(paths[1], "w", encoding="utf-8") as ft, \
            open(paths[2], "w", encoding="utf-8") as tsv:
        tsv.write("doc\tsentences\tfirst_line\tlast_line\tsrc_tokens\ttgt_tokens\tdoc_id\n")
        for i, d in enumerate(docs):
            fs.write(d.src + "\n")
            ft.write(d.tgt + "\n")
            tsv.write(f"{i}\t{d.size}\t{d.start + 1}\t{d.start + d.size}\t{len(d.src.split())}\t"
                      f"{len(d.tgt.split())}\t{d.doc_id}\n")
    return paths


def language(path: str) -> str:
    """The language suffix of a corpus file: ``train.de.gz`` -> ``de``."""
    name = os.path.basename(path)
    name = name[:-3] if name.endswith(".gz") else name
    return os.path.splitext(name)[1].lstrip(".")


def main(argv=None):
    p = argparse.ArgumentParser(prog="scripts/make_documents.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("source", help="source sentences, one per line (.gz read compressed)")
    p.add_argument("target", help="target sentences, parallel to the source")
    p.add_argument("out_prefix", help="writes OUT_PREFIX.SRC_LANG, OUT_PREFIX.TGT_LANG and OUT_PREFIX.docs.tsv")
    p.add_argument("--doc-ids", help="one id per sentence: consecutive equal ids are one real document")
    p.add_argument("--source-lang", help="suffix of the source output (default: the source file's, e.g. de)")
    p.add_argument("--target-lang", help="suffix of the target output (default: the target file's)")
    p.add_argument("--min-sentences", type=int, default=4, help="fewest sentences of a document (default 4)")
    p.add_argument("--max-sentences", type=int, default=64, help="most sentences of a document (default 64)")
    p.add_argument("--seed", type=int, default=1, help="seed of the size draws (default 1)")
    p.add_argument("--separator", default="<sep>", help="token between the sentences of a document (default <sep>)")
    args = p.parse_args(argv)
    try:
        positive_int("--min-sentences", args.min_sentences)
        positive_int("--max-sentences", args.max_sentences)
        check_separator(args.separator)
    except ValueError as e:
        p.error(str(e))
    if args.min_sentences > args.max_sentences:
        p.error(f"--min-sentences ({args.min_sentences}) must be at most --max-sentences ({args.max_sentences})")
    src_lang = args.source_lang or language(args.source)
    tgt_lang = args.target_lang or language(args.target)
    if not src_lang or not tgt_lang or src_lang == tgt_lang:
        p.error(f"cannot tell the languages from {args.source} and {args.target} "
                f"(got {src_lang!r} and {tgt_lang!r}): give --source-lang and --target-lang")

    def read(path):
        try:
            return None if path is None else read_lines(path)
        except (OSError, UnicodeDecodeError) as e:
            p.error(f"cannot read {path}: {e}")

    try:
        docs = make_documents(read(args.source), read(args.target), read(args.doc_ids), args.min_sentences,
                              args.max_sentences, args.seed, args.separator,
                              names=(args.source, args.target, args.doc_ids))
    except ValueError as e:
        p.error(str(e))
    paths = write_documents(args.out_prefix, src_lang, tgt_lang, docs)
    sizes = [d.size for d in docs]
    summary = f"{min(sizes)}-{max(sizes)} sentences, mean {sum(sizes) / len(sizes):.1f}" if docs else "none"
    print(f"{len(docs)} document{'s' * (len(docs) != 1)} ({summary}) from {sum(sizes)} sentences: "
          f"{', '.join(paths)}")


if __name__ == "__main__":
    main()
