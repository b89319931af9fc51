#!/usr/bin/env python
"""Language models on the WikiText-103 text in ../shared/data (its valid and test files split by
article into train / valid / test): softmax, RFA, RFA-Gate, and RFA-Gate trained with its state
carried across blocks (--task rfa_stateful_lm: shuffled blocks, each after a burn-in over the blocks
before it in the text).

    python results/stateful_lm.py --seeds 1 --variants softmax rfa_gate rfa rfa_gate_burnin2
    python results/stateful_lm.py --rescore --variants softmax rfa_gate rfa_gate_burnin --seeds 1 2 3
    python results/stateful_lm.py --report

The text is small and every model overfits within the budget: the checkpoint scored is the best on
valid (checkpoint_best.pt; the record says its update). Test perplexity of blocks alone; of the RFA
models also with the state carried through the test split; of softmax also with fairseq's sliding
window (half a block of context). ``--rescore`` adds, for runs whose folders are still there, the
test perplexity with 128, 512 and 2,048 tokens of context (fairseq's sliding window, every model).
"""
import re
import sys
from pathlib import Path

from runner import ROOT, eval_lm, main, run, tool, train, valid_scores

NAME, OUT, WORK = "stateful_lm", "results/stateful_lm.jsonl", "work/stateful_lm_study"
# 16 rows of `block` tokens per update; cutoffs: the adaptive softmax's (None: a full softmax output)
SETTINGS = {"small": dict(layers=4, dim=256, heads=4, cutoffs="3000,10000", block=256, rows=16, updates=500,
                          warmup=100, lr="2e-3")}
CONTEXTS = (128, 512, 2048)  # --rescore: test perplexity with this many tokens of context
METRICS = [("best valid ppl", "valid_ppl_best", 2), ("at update", "best_update", 0),
           ("test ppl, blocks alone", "test_ppl_blocks", 2), ("with state", "test_ppl_stateful", 2),
           ("sliding window", "test_ppl_sliding", 2)] + [
    (f"context {c}", f"test_ppl_ctx{c}", 2) for c in CONTEXTS] + [("train s", "train_s", 1)]
RFA = ["--user-dir", "rfa_fairseq", "--arch", "rfa_transformer_lm"]
GATE, STATEFUL = RFA + ["--rfa-gate"], "rfa_stateful_lm"
VARIANTS = {  # (training task, flags[, what changes in the setting])
    "softmax": ("language_modeling", ["--user-dir", "rfa_fairseq", "--arch", "transformer_lm"]),
    "rfa_gate": ("language_modeling", RFA + ["--rfa-gate"]),
    "rfa": ("language_modeling", RFA),
    # Probes of RFA-Gate without state, one change at a time (their stateful pairs trained along
    # streams, RETIRED below): no positions, one draw of random features for the whole run, elu features.
    "rfa_gate_nopos": ("language_modeling", GATE + ["--no-token-positional-embeddings"]),
    "rfa_gate_fixed": ("language_modeling", GATE + ["--rfa-fixed-features"]),
    "rfa_gate_elu": ("language_modeling", GATE + ["--rfa-kernel", "elu"]),
    # the burn-in: shuffled blocks as without state, each starting from the state of the block before it
    # in the text (built without gradient, with the update's draw)
    "rfa_gate_burnin": (STATEFUL, GATE + ["--burn-in-blocks", "1"]),
    # a gate that starts with a longer memory (sigmoid(4) = 0.98: about 55 tokens, against 8 with the default
    # bias 2), so that a carried state has something from beyond the block to give; with its stateless pair
    "rfa_gate_bias4": ("language_modeling", GATE + ["--rfa-gate-bias", "4"]),
    "rfa_gate_burnin_bias4": (STATEFUL, GATE + ["--burn-in-blocks", "1", "--rfa-gate-bias", "4"]),
    # the fix, the task's default: a burn-in over the two blocks before
    "rfa_gate_burnin2": (STATEFUL, GATE + ["--burn-in-blocks", "2"]),
    # a local exact window of W keys (--rfa-local-window), without and with the carried state
    **{name: (task, flags + ["--rfa-local-window", str(w)]) for w in (16, 64) for name, task, flags in (
        (f"rfa_gate_window{w}", "language_modeling", GATE), (f"rfa_gate_burnin2_window{w}", STATEFUL,
                                                              GATE + ["--burn-in-blocks", "2"]))},
    # block length, the same tokens per update
    "rfa_gate_b128": ("language_modeling", GATE, dict(block=128, rows=32)),
    "rfa_gate_b512": ("language_modeling", GATE, dict(block=512, rows=8)),
    # a full softmax output layer instead of the adaptive one: models CTranslate2's converter takes
    # (the softmax one), for the generation benchmark
    "softmax_plain": ("language_modeling", ["--user-dir", "rfa_fairseq", "--arch", "transformer_lm"],
                      dict(cutoffs=None)),
    "rfa_gate_burnin_plain": (STATEFUL, GATE + ["--burn-in-blocks", "2"], dict(cutoffs=None)),
}
# Variants recorded in OUT that can no longer run: --task rfa_stateful_lm trained them along contiguous
# streams (--burn-in-blocks 0, --stream-groups, --no-carry-state and --carry-positions, which the task
# no longer offers). Their records stay and report; docs/quality.md tells what they showed.
RETIRED = {
    "rfa_gate_stateful": "the state carried along 16 contiguous streams (--burn-in-blocks 0)",
    "rfa_gate_stateful_g8": "8 groups of 16 streams taking turns (--stream-groups 8)",
    "rfa_gate_stateful_nocarry": "the streams' order without the carried state (--no-carry-state)",
    "rfa_gate_stateful_nopos": "along streams, no positional embeddings",
}


def add_args(p):
    p.add_argument("--source", type=Path, default=ROOT.parent / "shared/data/wikitext103-eval",
                   help="a folder with wiki.valid.tokens and wiki.test.tokens (default %(default)s)")


def prepare(a):
    """Article i of wiki.valid.tokens + wiki.test.tokens (a heading " = Title = " starts one) goes to
    valid if i % 10 == 3, to test if i % 10 == 7, else to train; binarised into --work/bin."""
    data, text = a.work / "bin", a.work / "text"
    if not (data / "dict.txt").exists():
        text.mkdir(parents=True, exist_ok=True)
        files = [a.source / "wiki.valid.tokens", a.source / "wiki.test.tokens"]
        lines = [line for path in files for line in path.open(encoding="utf-8")]
        split = {"train": [], "valid": [], "test": []}
        article, size = 0, 0  # the article's index, its lines so far
        for line in lines:
            if re.match(r"^ = [^=].* = $", line.rstrip("\n")) and size:
                article, size = article + 1, 0
            size += 1
            split["valid" if article % 10 == 3 else "test" if article % 10 == 7 else "train"].append(line)
        for name, part in split.items():
            (text / f"{name}.tokens").write_text("".join(part), encoding="utf-8")
        run([tool("fairseq-preprocess"), "--only-source", "--trainpref", text / "train.tokens", "--validpref",
             text / "valid.tokens", "--testpref", text / "test.tokens", "--destdir", data, "--workers", "1"],
            a.work / "preprocess.log")
    return data


def rows(task, s) -> list:
    return ["--batch-size", s["rows"]] if task == "rfa_stateful_lm" else ["--max-tokens", s["rows"] * s["block"]]


def run_one(variant, s, seed, data, out, a) -> dict:
    task, arch, *changes = VARIANTS[variant]
    s = {**s, **(changes[0] if changes else {})}
    record = train([data, "--task", task, *arch, "--decoder-layers", s["layers"], "--decoder-embed-dim", s["dim"],
                    "--decoder-ffn-embed-dim", 4 * s["dim"], "--decoder-attention-heads", s["heads"],
                    *(["--criterion", "cross_entropy"] if s["cutoffs"] is None else
                      ["--adaptive-softmax-cutoff", s["cutoffs"], "--criterion", "adaptive_loss"]), "--dropout", "0.2",
                    "--tokens-per-sample", s["block"], "--ddp-backend", "legacy_ddp", "--optimizer", "adam",
                    "--adam-betas", "(0.9, 0.98)", "--clip-norm", "1.0", "--lr", s["lr"], "--lr-scheduler",
                    "inverse_sqrt", "--warmup-updates", s["warmup"], *rows(task, s), "--seed", seed,
                    "--log-interval", "50"],
                   out, s["updates"], a)
    # the validation perplexities (base 2, fairseq's log) and the update of the best, the one scored
    valid = [(v["ppl"], int(v["num_updates"])) for v in valid_scores((out / "train.log").read_text())]
    if valid:
        record["valid_ppl_best"], record["best_update"] = min(valid)
    record["train_task"], record["block"] = task, s["block"]
    ckpt, block = out / "checkpoint_best.pt", ["--tokens-per-sample", s["block"]]
    record["test_ppl_blocks"] = eval_lm(data, ckpt, out / "eval_blocks.log", a, *block, *rows("language_modeling", s))
    if "transformer_lm" in arch:  # fairseq's softmax LM: no state to carry
        record["test_ppl_sliding"] = eval_lm(data, ckpt, out / "eval_sliding.log", a, *block,
                                             *rows("language_modeling", s), "--context-window", s["block"] // 2)
    else:
        record["test_ppl_stateful"] = eval_lm(data, ckpt, out / "eval_stateful.log", a, *block, "--batch-size", "1",
                                              "--task", "rfa_stateful_lm")
    return record


def rescore(variant, s, seed, data, out, a, record) -> dict:
    """Test perplexity against context: fairseq's sliding window (``--context-window C``) scoring
    128 new tokens at a time, each with C to C + 127 tokens before it, for every model alike; the
    positions are widened for the longer windows (the models trained on blocks of 256)."""
    found, ckpt = {}, out / "checkpoint_best.pt"
    for c in CONTEXTS:
        found[f"test_ppl_ctx{c}"] = eval_lm(data, ckpt, out / f"eval_ctx{c}.log", a, "--tokens-per-sample", c + 128,
                                            "--context-window", c, "--batch-size", "1", "--model-overrides",
                                            f"{{'max_target_positions': {c + 256}}}")
    return found


if __name__ == "__main__":
    main(sys.modules[__name__])
