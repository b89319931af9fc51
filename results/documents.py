#!/usr/bin/env python
"""Document translation on Multi30k de-en pseudo-documents (scripts/make_documents.py): quality.py's sentence-level
recipe, then finetuned on the documents (``screen_docs``: the documents alone); sacreBLEU over whole documents, by length.

    python results/documents.py --variants softmax gate_softcross --seeds 1 2 3
    python results/documents.py --reverse ...   # en -> de, in --work and --out with "_en_de" added
"""
import json
import sys
from pathlib import Path

import sacrebleu

import quality
from runner import ROOT, bleu, main, run, tool, train

sys.path.insert(0, str(ROOT / "scripts"))
from make_documents import make_documents, read_lines, split_document  # noqa: E402
from score_translation import hypotheses  # noqa: E402

NAME, OUT, WORK = "documents", "results/documents_study.jsonl", "work/documents_study"
FINETUNE = dict(updates=300, warmup=50, lr="1e-3")
SETTINGS = {"final": dict(quality.SETTINGS["final"], finetune=dict(FINETUNE, updates=600)),
            "screen": dict(quality.SETTINGS["screen"], finetune=FINETUNE),
            "screen_long": dict(quality.SETTINGS["screen"], finetune=dict(FINETUNE, updates=1200)),
            "screen_docs": dict(quality.SETTINGS["screen"])}  # the documents alone, from scratch
LANGS = ("de", "en")  # source, target (--reverse: en -> de)
QUANTILES = (0.0, 0.002, 0.01, 0.05)  # --sentence-min candidates: these quantiles of the training sentences' ratios
CUT = 0.8  # a document cut short: fewer than this share of its reference's sentences written
BUCKETS = [(0, 128), (128, 256), (256, 512), (512, None)]
POSITIONS = ["--max-source-positions", "1280", "--max-target-positions", "1280"]  # the longest: 1,243 subwords
GENERATE = []  # fairseq-generate flags after the runner's (tests shorten the outputs of untrained models)
RETIRED = {"gate_cross_rescale": "--rfa-cross-norm-rescale (flag removed: no gain)",
           "gate_cross_later": "rfa-doc-mt's cross attention: 256 features, --rfa-cross-norm-rescale, D = 32"}
VARIANTS = {  # name: (results/quality.py's variant, extra flags)
    **{name: (name, []) for name in ("softmax", "gate_softcross", "gate_softcross_f32", "rfa_softcross", "rfa_gate")},
    "gate_cross": ("gate_bias2", []),  # RFA cross attention, the current gate (rfa_gate: the paper's, bias 0)
    "gate_cross256": ("gate_bias2", ["--rfa-cross-feature-dim", "256"]), "enc_rfa": ("enc_rfa", []),
    "gate_sentidx": ("gate_softcross", ["--sentence-index"]),  # each token's sentence number, from the separators
    "gate_sentidx0": ("gate_softcross", []),  # gate_softcross trained again with the sentence index's code: its paired seed 1
    "softmax0": ("softmax", []),  # softmax trained again at this code: seed 1's repeats, a checkpoint to convert
    "softmax_sentidx": ("softdec", ["--sentence-index"]),  # fairseq's softmax decoder with the index: like for like
    # cross attention on the source sentences within K of the one being written: a step reads 2K + 1 sentences
    **{f"gate_sentidx_window{k}": ("gate_softcross", ["--sentence-index", "--cross-sentence-window", str(k)]) for k in (0, 1)},
}
DEFAULT_VARIANTS = ["softmax", "gate_softcross"]
METRICS = [("valid BLEU", "valid_bleu", 2), ("test BLEU", "test_bleu", 2)] + [
    (f"test {lo}-{hi or ''}", f"test_bleu_{lo}", 2) for lo, hi in BUCKETS] + [
    ("test sentences / ref, 512-", "test_sentences_512", 2), ("test repeats, 512-", "test_repeats_512", 3),
    ("test cut short", "test_cut", 0), ("test cut short, 512-", "test_cut_512", 0),
    ("test attention on its sentence, 512-", "test_align_last_512", 3),  # a retired diagnostic: recorded runs
    ("test sentence counts equal", "test_equal", 0)] + [
    (f"valid BLEU, {how}", f"{how}_valid_bleu", 2) for how in ("free", *(f"q{q}" for q in QUANTILES))] + [
    (f"test {name}, free", f"free_test_{key}", digits) for name, key, digits in (
        ("BLEU", "bleu", 2), ("512-", "bleu_512", 2), ("cut short", "cut", 0), ("sentence counts equal", "equal", 0))]
TIME = "s_per_update_with_validation"


def add_args(p):
    p.add_argument("--reverse", action="store_true", help='en -> de, in --work and --out with "_en_de" added')


def prepare(a):  # quality.py's data as documents in --work/docs (SPLIT.ref, SPLIT.tgt_tokens); the sentences in docs/sentences
    global LANGS
    if a.reverse:
        LANGS = ("en", "de")
        a.work, a.out = a.work.with_name(a.work.name + "_en_de"), a.out.with_name(f"{a.out.stem}_en_de{a.out.suffix}")
        a.work.mkdir(parents=True, exist_ok=True)
    (src, tgt), sent, docs = LANGS, quality.prepare(a), a.work / "docs"
    if not (docs / "bin" / f"dict.{tgt}.txt").exists():
        docs.mkdir(parents=True, exist_ok=True)
        for split in ("train", "valid", "test"):
            pieces = {lang: (sent / f"{split}.spm.{lang}").read_text(encoding="utf-8").splitlines() for lang in ("de", "en")}
            encoded = make_documents(pieces[src], pieces[tgt])
            for lang, side in ((src, "src"), (tgt, "tgt")):
                (docs / f"{split}.spm.{lang}").write_text("".join(getattr(d, side) + "\n" for d in encoded), encoding="utf-8")
            if split != "train":  # the references as shipped, grouped the same way (same line count, same seed)
                text = make_documents(*(read_lines(str(ROOT / f"data/multi30k/{split}.{lang}.gz")) for lang in LANGS))
                assert [d.size for d in text] == [d.size for d in encoded]
                (docs / f"{split}.ref").write_text("".join(" ".join(split_document(d.tgt)) + "\n" for d in text), encoding="utf-8")
                (docs / f"{split}.tgt_tokens").write_text("".join(f"{len(d.tgt.split())}\n" for d in encoded))
        run([tool("fairseq-preprocess"), "--source-lang", src, "--target-lang", tgt, "--joined-dictionary",
             "--workers", "1", *[f for s in ("train", "valid", "test") for f in (f"--{s}pref", docs / f"{s}.spm")],
             "--destdir", docs / "bin"], docs / "preprocess.log")
    if not (docs / "sentences" / "bin" / f"valid.{src}-{tgt}.{tgt}.idx").exists():
        (docs / "sentences").mkdir(exist_ok=True)
        run([tool("fairseq-preprocess"), "--source-lang", src, "--target-lang", tgt, "--workers", "1",
             "--srcdict", docs / "bin" / f"dict.{src}.txt", "--tgtdict", docs / "bin" / f"dict.{tgt}.txt",
             "--trainpref", sent / "train.spm", "--validpref", sent / "valid.spm", "--destdir", docs / "sentences" / "bin"],
            docs / "sentences" / "preprocess.log")
    return docs


def score(generated: Path, refs: Path, lengths: Path, pieces: Path) -> dict:
    """Document BLEU (separators removed), overall and by the reference's subwords; sentences per reference sentence
    (``pieces``: the references in subwords), the share of sentences that repeat the one before (a lost place), the
    documents cut short (fewer than CUT of the reference's sentences) and the fewest sentences per reference's."""
    outputs, ref = [split_document(h) for h in hypotheses(generated)], refs.read_text(encoding="utf-8").splitlines()
    ref_sentences = [len(split_document(line)) for line in pieces.read_text(encoding="utf-8").splitlines()]
    sizes, metric, found = [int(n) for n in lengths.read_text().split()], sacrebleu.BLEU(force=True), {}
    for lo, hi in [(None, None)] + BUCKETS:
        pick = [i for i, n in enumerate(sizes) if lo is None or n > lo and (hi is None or n <= hi)]
        if not pick:
            continue
        tail = "" if lo is None else f"_{lo}"
        found[f"bleu{tail}"] = round(metric.corpus_score([" ".join(outputs[i]) for i in pick], [[ref[i] for i in pick]]).score, 2)
        written = sum(len(outputs[i]) for i in pick)
        found[f"sentences{tail}"] = round(written / sum(ref_sentences[i] for i in pick), 3)
        found[f"repeats{tail}"] = round(sum(a == b for i in pick for a, b in zip(outputs[i], outputs[i][1:])) / written, 3)
        share = [len(outputs[i]) / ref_sentences[i] for i in pick]
        found[f"cut{tail}"], found[f"fewest{tail}"] = sum(x < CUT for x in share), round(min(share), 3)
        found[f"equal{tail}"] = sum(len(outputs[i]) == ref_sentences[i] for i in pick)  # the source's sentence count
        if lo is not None:
            found[f"docs_{lo}"] = len(pick)
    return found


def scores(out: Path, data: Path, split: str) -> dict:
    found = score(out / f"generate.{split}.out", data / f"{split}.ref", data / f"{split}.tgt_tokens", data / f"{split}.spm.{LANGS[1]}")
    return {f"{split}_{k}": v for k, v in found.items()}


def _model(ckpt: Path, data: Path, split: str):
    import argparse
    from fairseq import checkpoint_utils, utils
    utils.import_user_module(argparse.Namespace(user_dir=str(ROOT / "rfa_fairseq")))
    models, _, task = checkpoint_utils.load_model_ensemble_and_task([str(ckpt)], arg_overrides={"data": str(data / "bin")})
    task.load_dataset(split)
    sep = task.tgt_dict.index("<sep>")
    assert task.src_dict.index("<sep>") == sep != task.tgt_dict.unk(), "documents have a <sep> in a joined dictionary"
    return models[0].eval(), task, task.dataset(split), sep, [int(n) for n in (data / f"{split}.tgt_tokens").read_text().split()]


def bounds(data: Path, out: Path, a) -> dict:
    """valid and test decoded free and aligned with each QUANTILES floor (in out/bounds): {split}_{how}_{score}."""
    from rfa_fairseq.models.rfa_transformer import training_sentence_min
    _, task, _, sep, _ = _model(out / "checkpoint_last.pt", data, "valid")
    found, ways = {}, {"free": {"no_sentence_alignment": True}}
    ways.update({f"q{q}": {"sentence_min": training_sentence_min(task, sep, q)} for q in QUANTILES})
    for how, overrides in ways.items():
        found.update({f"{how}_floor": overrides.get("sentence_min")})
        for split in ("valid", "test"):
            (there := out / "bounds" / how).mkdir(parents=True, exist_ok=True)
            bleu(data / "bin", out / "checkpoint_last.pt", split, data / f"{split}.ref", there, a,
                 post=("--post-process", "sentencepiece", *POSITIONS, *GENERATE, "--model-overrides", repr(overrides)))
            found.update({f"{how}_{k}": v for k, v in scores(there, data, split).items()})
    return found


def rescore(variant, s, seed, data, out, a, record) -> dict:
    """The scores again and (the sentence index) :func:`bounds`; nothing if the folder's outputs are another run's
    (other scores)."""
    found = {k: v for split in ("valid", "test") for k, v in scores(out, data, split).items()}
    if any(found[k] != record[k] for k in ("valid_bleu", "test_bleu") if k in record):
        print(f"[{NAME}]   {out} holds another run's outputs ({found['valid_bleu']} / {found['test_bleu']} BLEU, "
              f"recorded {record.get('valid_bleu')} / {record.get('test_bleu')}): left as recorded", flush=True)
        return {}
    return {**found, **(bounds(data, out, a) if "--sentence-index" in VARIANTS[variant][1] else {})}


def run_one(variant, s, seed, data, out, a) -> dict:
    base, extra = VARIANTS[variant]
    flags = lambda setting, data: quality.train_flags(base, setting, seed, data) + extra + POSITIONS  # noqa: E731
    record = {"flags": " ".join(quality.VARIANTS[base] + extra)}
    if "finetune" in s:  # the sentence-level recipe first, in its own folder
        (out / "sentences").mkdir(parents=True, exist_ok=True)
        first = train(flags(s, data / "sentences"), out / "sentences", s["updates"], a)
        record.update({f"sentences_{k}": v for k, v in first.items() if k in ("train_s", "s_per_update")})
        record.update(train(flags(dict(s, **s["finetune"]), data) + ["--finetune-from-model", out / "sentences" /
                                                                     "checkpoint_last.pt"], out, s["finetune"]["updates"], a))
    else:
        record.update(train(flags(s, data), out, s["updates"], a))
    for split in ("valid", "test"):
        r = bleu(data / "bin", out / "checkpoint_last.pt", split, data / f"{split}.ref", out, a,  # scores replaced below
                 post=("--post-process", "sentencepiece", *POSITIONS, *GENERATE))
        record.update(scores(out, data, split), **{f"{split}_tokens_per_s": r.get("tokens_per_s")})
    if "--sentence-index" in extra:
        record.update(bounds(data, out, a))
    (out / "record.json").write_text(json.dumps(record))
    return record


if __name__ == "__main__":
    main(sys.modules[__name__])
