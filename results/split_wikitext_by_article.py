#!/usr/bin/env python
"""Split WikiText-103 text files into train/valid/test by article (deterministically).

    python results/split_wikitext_by_article.py OUT_DIR wiki.valid.tokens wiki.test.tokens

Articles start at lines of the form " = Title = " (one '=' on each side). Article i (in file
order) goes to valid if i % 10 == 3, to test if i % 10 == 7, else to train.
"""
import os
import re
import sys

HEADING = re.compile(r"^ = [^=].* = $")


def articles(paths):
    current = []
    for path in paths:
        with open(path, encoding="utf-8") as f:
            for line in f:
                if HEADING.match(line.rstrip("\n")) and current:
                    yield current
                    current = []
                current.append(line)
    if current:
        yield current


def main():
    out, inputs = sys.argv[1], sys.argv[2:]
    os.makedirs(out, exist_ok=True)
    files = {name: open(os.path.join(out, f"{name}.tokens"), "w", encoding="utf-8")
             for name in ("train", "valid", "test")}
    counts = dict.fromkeys(files, 0)
    for i, art in enumerate(articles(inputs)):
        name = "valid" if i % 10 == 3 else "test" if i % 10 == 7 else "train"
        files[name].writelines(art)
        counts[name] += 1
    for f in files.values():
        f.close()
    print("articles:", counts)


if __name__ == "__main__":
    main()
