#!/usr/bin/env python
"""Language models on the WikiText-103 text in ../shared/data: softmax, RFA, RFA-Gate, and RFA-Gate trained with its
state carried across blocks (--task rfa_stateful_lm); test perplexity of the checkpoint best on valid (docs/quality.md).

    python results/stateful_lm.py --rescore --variants softmax rfa_gate rfa_gate_burnin --seeds 1 2 3
"""
import re
import sys
from pathlib import Path

from runner import ROOT, eval_lm, main, run, tool, train, valid_scores

NAME, OUT, WORK = "stateful_lm", "results/stateful_lm.jsonl", "work/stateful_lm_study"
SETTINGS = {"small": dict(layers=4, dim=256, heads=4, cutoffs="3000,10000", block=256, rows=16, updates=500,
                          warmup=100, lr="2e-3")}
CONTEXTS = (128, 512, 2048)  # --rescore: test perplexity with this many tokens of context
METRICS = [("best valid ppl", "valid_ppl_best", 2), ("at update", "best_update", 0), ("test ppl, blocks alone", "test_ppl_blocks", 2),
           ("with state", "test_ppl_stateful", 2), ("sliding window", "test_ppl_sliding", 2)] + [
    (f"context {c}", f"test_ppl_ctx{c}", 2) for c in CONTEXTS] + [("train s", "train_s", 1)]
LM, STATEFUL = "language_modeling", "rfa_stateful_lm"
SOFTMAX, RFA = (["--user-dir", "rfa_fairseq", "--arch", arch] for arch in ("transformer_lm", "rfa_transformer_lm"))
GATE = RFA + ["--rfa-gate"]
VARIANTS = {  # (training task, flags[, what changes in the setting])
    "softmax": (LM, SOFTMAX), "rfa_gate": (LM, GATE), "rfa": (LM, RFA),
    # shuffled blocks, each after a burn-in over the block before it in the text (no gradient, the update's draw)
    "rfa_gate_burnin": (STATEFUL, GATE + ["--burn-in-blocks", "1"]),
    "rfa_gate_burnin2": (STATEFUL, GATE + ["--burn-in-blocks", "2"]),  # the fix, the task's default: two blocks before
    # memories at several scales (heads' gate biases 2 to 8) and no positions: a context longer than the block
    "rfa_gate_burnin2_last8_nopos": (STATEFUL, GATE + ["--burn-in-blocks", "2", "--rfa-gate-bias-last", "8",
                                                       "--no-token-positional-embeddings"]),
    "rfa_gate_burnin2_last8": (STATEFUL, GATE + ["--burn-in-blocks", "2", "--rfa-gate-bias-last", "8"]),  # positions kept
    "rfa_gate_burnin2_last8_nopos_conv4": (STATEFUL, GATE + ["--burn-in-blocks", "2", "--rfa-gate-bias-last", "8",  # and
                                                             "--no-token-positional-embeddings", "--rfa-short-conv", "4"]),  # recall's
    # a full softmax output layer: models CTranslate2 converts (the softmax one), for bench/decode.py
    "softmax_plain": (LM, SOFTMAX, dict(cutoffs=None)),
    "rfa_gate_burnin_plain": (STATEFUL, GATE + ["--burn-in-blocks", "2"], dict(cutoffs=None)),
}


def add_args(p):
    p.add_argument("--source", type=Path, default=ROOT.parent / "shared/data/wikitext103-eval",
                   help="a folder with wiki.valid.tokens and wiki.test.tokens (default %(default)s)")


def prepare(a):  # article i of wiki.{valid,test}.tokens to valid if i % 10 == 3, to test if i % 10 == 7, else to train: --work/bin
    data, text = a.work / "bin", a.work / "text"
    if not (data / "dict.txt").exists():
        text.mkdir(parents=True, exist_ok=True)
        split, article, size = {"train": [], "valid": [], "test": []}, 0, 0  # the article's index, its lines so far
        for line in (line for name in ("valid", "test") for line in (a.source / f"wiki.{name}.tokens").open(encoding="utf-8")):
            if re.match(r"^ = [^=].* = $", line.rstrip("\n")) and size:
                article, size = article + 1, 0
            size += 1
            split["valid" if article % 10 == 3 else "test" if article % 10 == 7 else "train"].append(line)
        for name, part in split.items():
            (text / f"{name}.tokens").write_text("".join(part), encoding="utf-8")
        run([tool("fairseq-preprocess"), "--only-source", "--destdir", data, "--workers", "1",
             *[x for name in split for x in (f"--{name}pref", text / f"{name}.tokens")]], a.work / "preprocess.log")
    return data


def rows(task, s) -> list:
    return ["--batch-size", s["rows"]] if task == STATEFUL else ["--max-tokens", s["rows"] * s["block"]]


def run_one(variant, s, seed, data, out, a) -> dict:
    task, arch, *changes = VARIANTS[variant]
    s = {**s, **(changes[0] if changes else {})}
    record = train([data, "--task", task, *arch, "--decoder-layers", s["layers"], "--decoder-embed-dim", s["dim"],
                    "--decoder-ffn-embed-dim", 4 * s["dim"], "--decoder-attention-heads", s["heads"], *(
                        ["--criterion", "cross_entropy"] if s["cutoffs"] is None else
                        ["--adaptive-softmax-cutoff", s["cutoffs"], "--criterion", "adaptive_loss"]), "--dropout", "0.2",
                    "--tokens-per-sample", s["block"], "--ddp-backend", "legacy_ddp", "--optimizer", "adam", "--adam-betas",
                    "(0.9, 0.98)", "--clip-norm", "1.0", "--lr", s["lr"], "--lr-scheduler", "inverse_sqrt", "--warmup-updates",
                    s["warmup"], *rows(task, s), "--seed", seed, "--log-interval", "50"], out, s["updates"], a)
    valid = [(v["ppl"], int(v["num_updates"])) for v in valid_scores((out / "train.log").read_text())]
    if valid:
        record["valid_ppl_best"], record["best_update"] = min(valid)
    record["train_task"], record["block"] = task, s["block"]
    ckpt, block = out / "checkpoint_best.pt", ["--tokens-per-sample", s["block"]]
    record["test_ppl_blocks"] = eval_lm(data, ckpt, out / "eval_blocks.log", a, *block, *rows(LM, s))
    if "transformer_lm" in arch:  # fairseq's softmax LM: no state to carry
        record["test_ppl_sliding"] = eval_lm(data, ckpt, out / "eval_sliding.log", a, *block, *rows(LM, s), "--context-window",
                                             s["block"] // 2)
    else:
        record["test_ppl_stateful"] = eval_lm(data, ckpt, out / "eval_stateful.log", a, *block, "--batch-size", "1",
                                              "--task", STATEFUL)
    return record


def rescore(variant, s, seed, data, out, a, record) -> dict:
    """Test perplexity with C tokens of context (``--context-window C``, 128 new tokens at a time; positions widened)."""
    return {f"test_ppl_ctx{c}": eval_lm(data, out / "checkpoint_best.pt", out / f"eval_ctx{c}.log", a, "--tokens-per-sample",
                                        c + 128, "--context-window", c, "--batch-size", "1", "--model-overrides",
                                        f"{{'max_target_positions': {c + 256}}}") for c in CONTEXTS}


if __name__ == "__main__":
    main(sys.modules[__name__])
