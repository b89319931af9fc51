#!/usr/bin/env python
"""Multi-query associative recall (MQAR, after Zoology): language models read P key-value pairs, then the P keys again
in a random order, each followed by its value, in a sequence of L tokens (the gaps filled with ``_``); a query is
recalled where the model's most likely next token after the key is its value. Softmax, RFA and RFA-Gate, trained on
every token (fairseq's language modelling); test recall of the checkpoint best on valid (docs/quality.md).

    python results/recall.py --setting L256_P16 --variants softmax rfa rfa_gate --seeds 1
"""
import random
import sys

import torch
from runner import ROOT, run, tool, train, valid_scores, main

NAME, OUT, WORK = "recall", "results/recall_study.jsonl", "work/recall_study"
KEYS = VALUES = 512  # keys k0..k511, values v0..v511
SPLITS = {"train": 20000, "valid": 200, "test": 500}  # sequences; each split its own seed
GRID = [(256, 16), (256, 64), (1024, 16), (1024, 64), (1024, 256), (4096, 64), (4096, 256)]  # (L, P), L >= 4 P
SETTINGS = {f"L{length}_P{pairs}": dict(length=length, pairs=pairs, updates=1500, warmup=200, lr="2e-3",
                                        rows=max(4, 8192 // length)) for length, pairs in GRID}
METRICS = [("test recall %", "test_recall", 1), ("valid recall %", "valid_recall", 1), ("best valid loss", "valid_loss", 3),
           ("at update", "best_update", 0), ("train s", "train_s", 0)]
RFA = ["--arch", "rfa_transformer_lm"]
VARIANTS = {"softmax": ["--arch", "transformer_lm"], "rfa": RFA, "rfa_gate": RFA + ["--rfa-gate"],
            # the heads' memories at several scales: gate biases from 2 (about 8 tokens) to 5 (150) or 8 (3,000)
            **{f"rfa_gate_last{b}": RFA + ["--rfa-gate", "--rfa-gate-bias-last", b] for b in (5, 8)}}


def sequence(length: int, pairs: int, rng: random.Random):
    """The tokens of one example and the positions of its queries' keys (the value follows each)."""
    keys, values = rng.sample(range(KEYS), pairs), [rng.randrange(VALUES) for _ in range(pairs)]
    tokens = [w for k, v in zip(keys, values) for w in (f"k{k}", f"v{v}")]
    slots = (length - 2 * pairs) // 2  # the query section in slots of two tokens, P of them taken by a query
    taken = sorted(rng.sample(range(slots), pairs))
    order, queries = rng.sample(range(pairs), pairs), []
    section = ["_"] * (length - 2 * pairs)
    for slot, i in zip(taken, order):
        section[2 * slot:2 * slot + 2] = [f"k{keys[i]}", f"v{values[i]}"]
        queries.append(2 * pairs + 2 * slot)
    return tokens + section, queries


def examples(s, split: str):
    rng = random.Random(f"{split}-{s['length']}-{s['pairs']}")
    return [sequence(s["length"], s["pairs"], rng) for _ in range(SPLITS[split])]


def prepare(a):
    s, data = SETTINGS[a.setting], a.work / a.setting / "bin"
    if not (data / "test.bin").exists():
        text = a.work / a.setting / "text"
        text.mkdir(parents=True, exist_ok=True)
        words = text / "words.txt"  # every word once: the dictionary holds them all, whatever a split draws
        words.write_text(" ".join([f"k{i}" for i in range(KEYS)] + [f"v{i}" for i in range(VALUES)] + ["_"]) + "\n")
        run([tool("fairseq-preprocess"), "--only-source", "--trainpref", words, "--destdir", data / "dict", "--workers", "1"],
            a.work / a.setting / "dict.log")
        for split in SPLITS:
            (text / f"{split}.txt").write_text("".join(" ".join(t) + "\n" for t, _ in examples(s, split)))
        run([tool("fairseq-preprocess"), "--only-source", "--srcdict", data / "dict" / "dict.txt", "--destdir", data,
             "--workers", "1", *[x for split in SPLITS for x in (f"--{split}pref", text / f"{split}.txt")]],
            a.work / a.setting / "preprocess.log")
    return data


def recall(ckpt, data, s, split: str) -> float:
    """The share (%) of ``split``'s queries whose value is the model's most likely token after the key."""
    from fairseq import checkpoint_utils
    models, _, task = checkpoint_utils.load_model_ensemble_and_task([str(ckpt)], arg_overrides={"data": str(data)})
    model, d = models[0].eval(), task.source_dictionary
    hits = total = 0
    with torch.no_grad():
        for tokens, queries in examples(s, split):
            ids = torch.tensor([[d.eos()] + [d.index(w) for w in tokens]])  # fairseq's sample starts after an </s>
            best = model(ids)[0].argmax(-1)[0]  # best[i]: the token predicted after ids[i]
            hits += sum(int(best[q + 1] == ids[0, q + 2]) for q in queries)
            total += len(queries)
    return 100.0 * hits / total


def run_one(variant, s, seed, data, out, a) -> dict:
    every = max(100, s["updates"] // 10)
    record = train([data, "--user-dir", "rfa_fairseq", "--task", "language_modeling",  # blocks of L + 1: a line and its </s>
                    "--tokens-per-sample", s["length"] + 1, "--max-target-positions", s["length"] + 1, *VARIANTS[variant],
                    "--decoder-layers", 2, "--decoder-embed-dim", 128, "--decoder-ffn-embed-dim", 256,
                    "--decoder-attention-heads", 2, "--dropout", 0.0, "--optimizer", "adam", "--adam-betas", "(0.9, 0.98)",
                    "--weight-decay", 0.1, "--clip-norm", 1.0, "--lr", s["lr"], "--lr-scheduler", "inverse_sqrt",
                    "--warmup-updates", s["warmup"], "--batch-size", s["rows"], "--seed", seed, "--log-interval", 100,
                    "--save-interval-updates", every, "--validate-interval-updates", every, "--keep-interval-updates", 1],
                   out, s["updates"], a)
    valid = [(v["loss"], int(v["num_updates"])) for v in valid_scores((out / "train.log").read_text())]
    record["valid_loss"], record["best_update"] = min(valid)
    sys.path.insert(0, str(ROOT))
    from fairseq import utils
    utils.import_user_module(type("Args", (), {"user_dir": str(ROOT / "rfa_fairseq")})())
    for split in ("valid", "test"):
        record[f"{split}_recall"] = recall(out / "checkpoint_best.pt", data, s, split)
    return record


if __name__ == "__main__":
    main(sys.modules[__name__])
