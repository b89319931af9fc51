#!/usr/bin/env python
"""Multi-query associative recall (MQAR, after Zoology), docs/quality.md: L tokens, P key-value pairs then the P keys in
a random order among fillers ``_``, each followed by its value; language models trained on the answers alone (the value
after a query; criterion ``recall_answers`` of results/recall_lm); recall: the % of the test queries whose value is the
most likely next token (the checkpoint best on valid loss).

    python results/recall.py --setting L256_P16 --variants softmax rfa rfa_gate --seeds 1
"""
import random
import sys

from runner import main, run, tool, train, valid_scores

NAME, OUT, WORK = "recall", "results/recall_study.jsonl", "work/recall_study"
KEYS = VALUES = 512  # keys k0..k511, values v0..v511
SPLITS = {"train": 20000, "valid": 200, "test": 500}  # sequences; each split its own seed
SETTINGS = {f"L{length}_P{pairs}": dict(length=length, pairs=pairs, updates=updates, warmup=200, lr="2e-3",
                                        rows=max(4, 8192 // length))  # 8,192 tokens an update
            for length, pairs, updates in ((64, 16, 1500), (256, 16, 3000), (256, 64, 3000), (1024, 16, 3000),
                                           (1024, 64, 3000), (1024, 256, 3000), (4096, 64, 3000), (4096, 256, 3000))}
# the L64_P16 model (the same variant and seed) continued at 1,024 tokens and 64 or 256 pairs: what its state holds
SETTINGS.update({f"L1024_P{p}_from_L64": dict(SETTINGS[f"L1024_P{p}"], updates=1500, init="L64_P16") for p in (64, 256)})
METRICS = [("test recall %", "test_recall", 1), ("best valid loss", "valid_loss", 3)]  # a setting chosen on valid loss
RFA, PLUGIN = ["--arch", "rfa_transformer_lm"], ["--user-dir", "results/recall_lm"]
VARIANTS = {"softmax": ["--arch", "transformer_lm"], "rfa": RFA, "rfa_gate": RFA + ["--rfa-gate"],
            "rfa_gate_last8": RFA + ["--rfa-gate", "--rfa-gate-bias-last", 8],  # the heads' gate biases 2 to 8
            "rfa_conv4": RFA + ["--rfa-short-conv", 4], "rfa_gate_conv4": RFA + ["--rfa-gate", "--rfa-short-conv", 4]}


def sequence(length: int, pairs: int, rng: random.Random) -> list:  # an example's tokens
    keys, values = rng.sample(range(KEYS), pairs), [rng.randrange(VALUES) for _ in range(pairs)]
    tokens = [w for k, v in zip(keys, values) for w in (f"k{k}", f"v{v}")]
    section = ["_"] * (length - 2 * pairs)  # in slots of two tokens
    for i, slot in enumerate(rng.sample(range((length - 2 * pairs) // 2), pairs)):  # pair i's query at this slot
        section[2 * slot:2 * slot + 2] = [f"k{keys[i]}", f"v{values[i]}"]
    return tokens + section


def examples(s, split: str):
    rng = random.Random(f"{split}-{s['length']}-{s['pairs']}")
    return [sequence(s["length"], s["pairs"], rng) for _ in range(SPLITS[split])]


def prepare(a):
    s = SETTINGS[a.setting]
    data = a.work / f"L{s['length']}_P{s['pairs']}" / "bin"  # a setting's data: its length and pairs
    if not (data / "test.bin").exists():
        text = data.parent / "text"
        text.mkdir(parents=True, exist_ok=True)
        words = [f"k{i}" for i in range(KEYS)] + [f"v{i}" for i in range(VALUES)] + ["_"]  # all, whatever a split draws
        (text / "dict.txt").write_text("".join(f"{w} 1\n" for w in words))
        for split in SPLITS:
            (text / f"{split}.txt").write_text("".join(" ".join(t) + "\n" for t in examples(s, split)))
        run([tool("fairseq-preprocess"), "--only-source", "--srcdict", text / "dict.txt", "--destdir", data,
             "--workers", "1", *[x for split in SPLITS for x in (f"--{split}pref", text / f"{split}.txt")]],
            data.parent / "preprocess.log")
    return data


def run_one(variant, s, seed, data, out, a) -> dict:
    every = s["updates"] // 10  # validate, and keep the best checkpoint on valid loss
    init = [] if "init" not in s else ["--finetune-from-model", a.work / s["init"] / f"{variant}-seed{seed}/checkpoint_best.pt"]
    record = train([data, *PLUGIN, *init, "--task", "language_modeling",  # blocks of L + 1: a line and its </s>
                    "--tokens-per-sample", s["length"] + 1, "--max-target-positions", s["length"] + 1, *VARIANTS[variant],
                    "--decoder-layers", 2, "--decoder-embed-dim", 128, "--decoder-ffn-embed-dim", 256,
                    "--decoder-attention-heads", 2, "--dropout", 0.0, "--criterion", "recall_answers",
                    "--optimizer", "adam", "--adam-betas", "(0.9, 0.98)", "--weight-decay", 0.1, "--clip-norm", 1.0,
                    "--lr", s["lr"], "--lr-scheduler", "inverse_sqrt", "--warmup-updates", s["warmup"],
                    "--batch-size", s["rows"], "--required-batch-size-multiple", 1, "--seed", seed, "--log-interval", 100,
                    "--save-interval-updates", every, "--validate-interval-updates", every, "--keep-interval-updates", 1],
                   out, s["updates"], a)
    valid = [(v["loss"], int(v["num_updates"])) for v in valid_scores((out / "train.log").read_text())]
    record["valid_loss"], record["best_update"] = min(valid)
    test = run([tool("fairseq-validate"), data, *PLUGIN, "--task", "language_modeling", "--path", out / "checkpoint_best.pt",
                "--valid-subset", "test", "--batch-size", s["rows"], "--required-batch-size-multiple", 1, *a.cpu_flag],
               out / "test.log")
    record["test_recall"] = valid_scores(test, "test")[0]["recall"]
    return record


if __name__ == "__main__":
    main(sys.modules[__name__])
