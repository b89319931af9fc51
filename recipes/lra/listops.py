#!/usr/bin/env python
"""Generate the ListOps task of the Long Range Arena: nested MIN / MAX / MED / SM expressions over
the digits 0-9, whose value (0-9) is the class.

    python recipes/lra/listops.py --out-dir DIR                 # the LRA settings, 96,000/2,000/2,000
    python recipes/lra/listops.py --out-dir DIR --train 64 --valid 16 --test 16 --min-length 10 --max-length 80

Writes DIR/basic_{train,val,test}.tsv in the layout of the official release
(lra_release/listops-1000/): a header ``Source<TAB>Target``, then one expression per line in
LRA's bracketing, every operator application wrapped in parentheses as its generator prints it::

    ( ( ( ( [MAX 2 ) 9 ) ( ( [SM 3 ) 4 ] ) ) ] )      ->  9 (the max of 2, 9 and (3 + 4) mod 10 = 7)

so that the official files and these go through the same conversion (recipes/lra/prepare.py
drops the parentheses, as LRA's input pipeline does, and keeps the operators, digits and ``]``).

The settings are those of LRA's generator (google-research/long-range-arena,
lra_benchmarks/data/listops.py, commit cd31e5c), which this file follows in behaviour, not in
code: a node below --max-depth (the root is depth 1) is an operator with probability 0.25, else
a digit; an operator takes 2..--max-args arguments; the length counts operators, digits and
``]`` (not parentheses) and must lie strictly between --min-length and --max-length; expressions
are unique across the three splits. The operators:

- MIN, MAX: the smallest, largest argument;
- SM: the sum of the arguments modulo 10;
- MED: the median as ``int(numpy.median(args))``: for an even number of arguments the mean of
  the two middle ones, rounded down (MED 1 4 is 2). This is what LRA's labels use; it is neither
  the lower nor the upper median.

Labels are checked in the tests against recipes/lra/listops_eval.py, a separate stack evaluator
of the printed string.
"""
import argparse
import csv
import os
import random
import sys
from typing import List, Tuple, Union

OPERATORS = ("[MIN", "[MAX", "[MED", "[SM")
END = "]"
OPERATOR_P = 0.25  # LRA's VALUE_P: the chance that a node below the maximum depth is an operator

Tree = Union[int, Tuple[str, list]]


def median_lra(values: List[int]) -> int:
    """int(numpy.median(values)) for non-negative integers, without numpy."""
    s = sorted(values)
    n = len(s)
    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) // 2


def apply(op: str, values: List[int]) -> int:
    if op == "[MIN":
        return min(values)
    if op == "[MAX":
        return max(values)
    if op == "[MED":
        return median_lra(values)
    if op == "[SM":
        return sum(values) % 10
    raise ValueError(f"unknown ListOps operator {op!r}")


def generate(rng: random.Random, max_depth: int, max_args: int, depth: int = 1) -> Tuple[Tree, int]:
    """A random expression tree and its length (operators, digits and closing brackets)."""
    if depth >= max_depth or rng.random() >= OPERATOR_P:
        return rng.randrange(10), 1
    op = rng.choice(OPERATORS)
    children, length = [], 2  # the operator and its ]
    for _ in range(rng.randint(2, max_args)):
        child, n = generate(rng, max_depth, max_args, depth + 1)
        children.append(child)
        length += n
    return (op, children), length


def longest(max_depth: int, max_args: int) -> int:
    """The longest expression the settings can make (every node an operator with the most arguments)."""
    length = 1
    for _ in range(max_depth - 1):
        length = 2 + max_args * length
    return length


def value(tree: Tree) -> int:
    if isinstance(tree, int):
        return tree
    op, children = tree
    return apply(op, [value(c) for c in children])


def to_string(tree: Tree) -> str:
    """LRA's printed form: the operator and its arguments are folded left, each step in parentheses."""
    if isinstance(tree, int):
        return str(tree)
    op, children = tree
    s = f"( {op} {to_string(children[0])} )"
    for child in children[1:]:
        s = f"( {s} {to_string(child)} )"
    return f"( {s} {END} )"


def make_examples(n: int, rng: random.Random, min_length: int, max_length: int, max_depth: int,
                  max_args: int) -> List[Tuple[str, int]]:
    """``n`` unique (expression, value) pairs whose length is strictly between the bounds."""
    seen, out = set(), []
    while len(out) < n:
        tree, length = generate(rng, max_depth, max_args)
        if min_length < length < max_length:
            s = to_string(tree)
            if s not in seen:
                seen.add(s)
                out.append((s, value(tree)))
    return out


def write_tsv(path: str, rows):
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f, delimiter="\t", lineterminator="\n")
        w.writerow(["Source", "Target"])
        w.writerows(rows)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out-dir", required=True, help="folder for basic_{train,val,test}.tsv")
    p.add_argument("--train", type=int, default=96000, help="training examples (LRA: 96,000)")
    p.add_argument("--valid", type=int, default=2000, help="validation examples (LRA: 2,000)")
    p.add_argument("--test", type=int, default=2000, help="test examples (LRA: 2,000)")
    p.add_argument("--min-length", type=int, default=500, help="lengths must exceed this (LRA: 500)")
    p.add_argument("--max-length", type=int, default=2000, help="lengths must stay below this (LRA: 2,000)")
    p.add_argument("--max-depth", type=int, default=10, help="maximum tree depth, the root being 1 (LRA: 10)")
    p.add_argument("--max-args", type=int, default=10, help="maximum arguments of an operator (LRA: 10)")
    p.add_argument("--seed", type=int, default=1)
    a = p.parse_args(argv)
    for name in ("train", "valid", "test", "max_depth"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(a, name)}")
    if a.max_args < 2:
        p.error(f"--max-args must be at least 2, got {a.max_args}")
    if a.min_length < 0 or a.max_length <= a.min_length + 1:
        p.error(f"lengths must satisfy 0 <= --min-length < length < --max-length; got {a.min_length} and {a.max_length}")
    if longest(a.max_depth, a.max_args) <= a.min_length:
        p.error(f"--max-depth {a.max_depth} and --max-args {a.max_args} make expressions of at most "
                f"{longest(a.max_depth, a.max_args)} tokens, not more than --min-length {a.min_length}")
    rng = random.Random(a.seed)
    rows = make_examples(a.train + a.valid + a.test, rng, a.min_length, a.max_length, a.max_depth, a.max_args)
    os.makedirs(a.out_dir, exist_ok=True)
    splits = (("train", rows[:a.train]), ("val", rows[a.train:a.train + a.valid]), ("test", rows[a.train + a.valid:]))
    for split, part in splits:
        write_tsv(os.path.join(a.out_dir, f"basic_{split}.tsv"), part)
        print(f"wrote {len(part)} examples to {os.path.join(a.out_dir, f'basic_{split}.tsv')}", file=sys.stderr)


if __name__ == "__main__":
    main()
