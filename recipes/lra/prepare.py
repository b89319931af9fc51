#!/usr/bin/env python
"""Turn the Long Range Arena text tasks into the text files fairseq-preprocess binarises for
fairseq's ``sentence_prediction`` task (recipes/lra/prepare.sh runs it, then fairseq-preprocess).

    python recipes/lra/prepare.py listops   --raw DIR --out OUT   # DIR/basic_{train,val,test}.tsv
    python recipes/lra/prepare.py text      --raw DIR --out OUT   # DIR/aclImdb/{train,test}/{pos,neg}/*.txt
    python recipes/lra/prepare.py retrieval --raw DIR --out OUT   # DIR/new_aan_pairs.{train,eval,test}.tsv
    python recipes/lra/prepare.py smoke-raw TASK --raw DIR        # tiny synthetic files in the official layout

Writes OUT/{train,valid,test}.input0 (and .input1 for retrieval: the second document), one
example per line as space-separated symbols, OUT/{train,valid,test}.label, and the fixed
dictionaries OUT/dict.input0.txt and OUT/dict.label.txt, so that every run and every machine
numbers the symbols and the classes the same way (fairseq-preprocess would order a dictionary
it builds by frequency). prepare.sh passes them with --srcdict.

- listops: the official release's (or listops.py's) TSV; the parentheses are dropped and the
  operators, digits and ``]`` kept, as LRA's input pipeline does (15 symbols); labels checked
  against the independent evaluator listops_eval.py (--no-check-labels to skip).
- text: byte-level IMDb reviews (the aclImdb_v1 release, which tensorflow-datasets'
  imdb_reviews that LRA reads is made from): the UTF-8 bytes of each review, cut to
  --max-length (4,000: the LRA paper's length; its released config says 1,000); label 1 for
  pos, 0 for neg; as LRA, the test set is also the validation set (IMDb has no other).
- retrieval: byte-level AAN pairs (``label id1 id2 text1 text2``, tab-separated, no header, as
  in lra_release/tsv_data); each document's bytes cut to --max-length (4,000 each, as LRA); the
  eval file is the validation set.

Byte-level inputs use a fixed 256-symbol dictionary: byte b is the symbol ``%02x`` (two lower-case
hex digits), so any byte, newlines and tabs included, is one whitespace-free token.
"""
import argparse
import csv
import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import listops  # noqa: E402
from listops_eval import evaluate  # noqa: E402

LISTOPS_SYMBOLS = list(listops.OPERATORS) + [listops.END] + [str(d) for d in range(10)]
BYTE_SYMBOLS = [f"{b:02x}" for b in range(256)]
SPLITS = ("train", "valid", "test")
# AAN fields can be long; csv's default limit (128 KiB) is not enough for every document
csv.field_size_limit(2 ** 31 - 1)


def byte_tokens(data: bytes, max_length: int) -> str:
    return " ".join(BYTE_SYMBOLS[b] for b in data[:max_length])


def write_dict(path: str, symbols):
    with open(path, "w", encoding="utf-8") as f:
        for s in symbols:
            f.write(f"{s} 1\n")


def write_split(out: str, split: str, examples):
    """examples: (label, [input0, input1...]) with inputs already as symbol strings."""
    files = {}
    try:
        for label, inputs in examples:
            if not files:
                files["label"] = open(os.path.join(out, f"{split}.label"), "w", encoding="utf-8")
                for i in range(len(inputs)):
                    files[i] = open(os.path.join(out, f"{split}.input{i}"), "w", encoding="utf-8")
            files["label"].write(f"{label}\n")
            for i, text in enumerate(inputs):
                files[i].write(text + "\n")
    finally:
        for f in files.values():
            f.close()
    if not files:
        raise SystemExit(f"no {split} examples")


def need(path: str, what: str):
    if not os.path.exists(path):
        raise SystemExit(f"missing {path} ({what})")
    return path


# ------------------------------------------------------------------ the three tasks

def listops_examples(path: str, check_labels: bool):
    with open(path, encoding="utf-8", newline="") as f:
        reader = csv.reader(f, delimiter="\t")
        header = next(reader, None)
        if header != ["Source", "Target"]:
            raise SystemExit(f"{path}: expected the header 'Source<TAB>Target' of LRA's ListOps files, got {header!r}")
        for line, row in enumerate(reader, start=2):
            if len(row) != 2:
                raise SystemExit(f"{path}:{line}: expected 2 tab-separated fields, got {len(row)}")
            source, target = row
            tokens = [t for t in source.split() if t not in ("(", ")")]
            if any(t not in LISTOPS_SYMBOLS for t in tokens):
                bad = next(t for t in tokens if t not in LISTOPS_SYMBOLS)
                raise SystemExit(f"{path}:{line}: not a ListOps symbol: {bad!r}")
            if target not in [str(d) for d in range(10)]:
                raise SystemExit(f"{path}:{line}: the label must be a digit 0-9, got {target!r}")
            if check_labels and evaluate(source) != int(target):
                raise SystemExit(f"{path}:{line}: label {target} but the expression evaluates to {evaluate(source)} "
                                 "(recipes/lra/listops_eval.py; --no-check-labels to keep it)")
            yield target, [" ".join(tokens)]


def prepare_listops(raw: str, out: str, check_labels: bool, **_):
    files = {"train": "basic_train.tsv", "valid": "basic_val.tsv", "test": "basic_test.tsv"}
    for split in SPLITS:
        path = need(os.path.join(raw, files[split]), "LRA's listops-1000 folder, or recipes/lra/listops.py --out-dir")
        write_split(out, split, listops_examples(path, check_labels))
    write_dict(os.path.join(out, "dict.input0.txt"), LISTOPS_SYMBOLS)
    write_dict(os.path.join(out, "dict.label.txt"), [str(d) for d in range(10)])


def imdb_root(raw: str) -> str:
    for root in (os.path.join(raw, "aclImdb"), raw):
        if os.path.isdir(os.path.join(root, "train", "pos")):
            return root
    raise SystemExit(f"{raw}: expected aclImdb/train/pos (the aclImdb_v1 release unpacked), or train/pos directly")


def imdb_examples(root: str, part: str, max_length: int):
    for label, polarity in ((1, "pos"), (0, "neg")):
        folder = need(os.path.join(root, part, polarity), "the aclImdb_v1 layout")
        for name in sorted(os.listdir(folder)):
            if name.endswith(".txt"):
                with open(os.path.join(folder, name), "rb") as f:
                    yield label, [byte_tokens(f.read(), max_length)]


def prepare_text(raw: str, out: str, max_length: int, **_):
    root = imdb_root(raw)
    for split, part in (("train", "train"), ("valid", "test"), ("test", "test")):
        write_split(out, split, imdb_examples(root, part, max_length))
    write_dict(os.path.join(out, "dict.input0.txt"), BYTE_SYMBOLS)
    write_dict(os.path.join(out, "dict.label.txt"), ["0", "1"])


def aan_examples(path: str, max_length: int):
    with open(path, "rb") as f:
        for line_no, line in enumerate(f, start=1):
            fields = line.rstrip(b"\r\n").split(b"\t")
            if len(fields) != 5:
                raise SystemExit(f"{path}:{line_no}: expected 5 tab-separated fields (label id1 id2 text1 text2), "
                                 f"got {len(fields)}")
            try:
                label = int(float(fields[0]))
            except ValueError:
                raise SystemExit(f"{path}:{line_no}: the label must be a number (0 or 1), got {fields[0][:20]!r}")
            if label not in (0, 1):
                raise SystemExit(f"{path}:{line_no}: the label must be 0 or 1, got {label}")
            yield label, [byte_tokens(fields[3], max_length), byte_tokens(fields[4], max_length)]


def prepare_retrieval(raw: str, out: str, max_length: int, **_):
    for split, name in (("train", "train"), ("valid", "eval"), ("test", "test")):
        path = need(os.path.join(raw, f"new_aan_pairs.{name}.tsv"), "lra_release/tsv_data of the LRA release")
        write_split(out, split, aan_examples(path, max_length))
    write_dict(os.path.join(out, "dict.input0.txt"), BYTE_SYMBOLS)
    write_dict(os.path.join(out, "dict.label.txt"), ["0", "1"])


# ------------------------------------------------------------------ smoke mode

WORDS = "the a film movie plot actor scene story great awful boring fine good bad long short".split()


def smoke_raw(task: str, raw: str, seed: int = 1):
    """Tiny stand-ins in each official layout (synthetic content) for the recipes' smoke mode."""
    rng = random.Random(seed)
    os.makedirs(raw, exist_ok=True)
    if task == "listops":
        listops.main(["--out-dir", raw, "--train", "96", "--valid", "24", "--test", "24",
                      "--min-length", "5", "--max-length", "60", "--max-depth", "4", "--max-args", "4",
                      "--seed", str(seed)])
    elif task == "text":
        for part, n in (("train", 16), ("test", 8)):
            for polarity in ("pos", "neg"):
                folder = os.path.join(raw, "aclImdb", part, polarity)
                os.makedirs(folder, exist_ok=True)
                for i in range(n):
                    words = [rng.choice(WORDS) for _ in range(rng.randint(5, 40))]
                    words.append("great" if polarity == "pos" else "awful")
                    with open(os.path.join(folder, f"{i}_{rng.randint(1, 10)}.txt"), "w", encoding="utf-8") as f:
                        f.write(" ".join(words) + " <br />caf\u00e9.")
    elif task == "retrieval":
        for name, n in (("train", 32), ("eval", 12), ("test", 12)):
            with open(os.path.join(raw, f"new_aan_pairs.{name}.tsv"), "w", encoding="utf-8") as f:
                for i in range(n):
                    docs = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 30))) for _ in range(2)]
                    f.write(f"{float(i % 2)}\tpaper{i}a\tpaper{i}b\t{docs[0]}\t{docs[1]}\n")
    else:
        raise SystemExit(f"unknown task {task!r}: listops, text or retrieval")


PREPARE = {"listops": prepare_listops, "text": prepare_text, "retrieval": prepare_retrieval}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    for task in PREPARE:
        s = sub.add_parser(task)
        s.add_argument("--raw", required=True, help="folder of the official (or generated) files")
        s.add_argument("--out", required=True, help="folder for the fairseq-preprocess inputs")
        if task == "listops":
            s.add_argument("--no-check-labels", dest="check_labels", action="store_false",
                           help="do not check the labels with recipes/lra/listops_eval.py")
        else:
            s.add_argument("--max-length", type=int, default=4000, help="bytes kept per document (default 4000)")
    s = sub.add_parser("smoke-raw")
    s.add_argument("task", choices=sorted(PREPARE))
    s.add_argument("--raw", required=True)
    a = p.parse_args(argv)
    if a.command == "smoke-raw":
        smoke_raw(a.task, a.raw)
        return
    if getattr(a, "max_length", 1) < 1:
        p.error(f"--max-length must be a positive integer, got {a.max_length}")
    os.makedirs(a.out, exist_ok=True)
    PREPARE[a.command](raw=a.raw, out=a.out, check_labels=getattr(a, "check_labels", True),
                       max_length=getattr(a, "max_length", None))


if __name__ == "__main__":
    main()
