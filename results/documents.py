#!/usr/bin/env python
"""Document translation on Multi30k de-en pseudo-documents: consecutive captions joined into
documents of 4-64 sentences (rfa-make-documents, seed 1; about 50-900 subwords a side, ``<sep>``
between sentences), trained and decoded like results/quality.py's sentences but a document at a
time. Multi30k's captions are unrelated to each other, so this tests long inputs and outputs
(alignment over hundreds of tokens, output length), not discourse.

    python results/documents.py --variants softmax gate_softcross --seeds 1 2 3
    python results/documents.py --report

Training data: the documents, and with ``sentences`` (every setting but ``screen_docs``) the sentence-level
training set besides (fairseq's ``train1`` split, read with ``train``): a model trained on the documents alone
at these budgets learns no alignment and writes the same few captions whatever the source (``screen_docs``).

Scores: sacreBLEU over whole documents (separators removed, a document one segment), and by the
reference document's length in target subwords (up to 128, 128-256, 256-512, over 512).
Settings are chosen on valid; test is reported.
"""
import json
import sys
from pathlib import Path

import sacrebleu

import quality
from runner import BIN, ROOT, bleu, main, run, train

sys.path.insert(0, str(ROOT / "scripts"))
from score_translation import hypotheses  # noqa: E402

from rfa_fairseq.cli.make_documents import make_documents, read_lines, split_document  # noqa: E402

NAME, OUT, WORK = "documents", "results/documents_study.jsonl", "work/documents_study"
SETTINGS = {"final": dict(quality.SETTINGS["final"], sentences=True), "screen": dict(quality.SETTINGS["screen"], sentences=True),
            "screen_docs": dict(quality.SETTINGS["screen"], sentences=False)}
BUCKETS = [(0, 128), (128, 256), (256, 512), (512, None)]
POSITIONS = ["--max-source-positions", "1280", "--max-target-positions", "1280"]  # the longest: 1,243 subwords
GENERATE = []  # fairseq-generate flags after the runner's (tests shorten the outputs of untrained models)
LATER_CROSS = ["--rfa-cross-feature-dim", "256", "--rfa-cross-norm-rescale"]  # rfa-doc-mt's cross attention
VARIANTS = {  # name: (results/quality.py's variant, extra flags)
    "softmax": ("softmax", []),
    "gate_softcross": ("gate_softcross", []),  # RFA-Gate behind softmax cross attention: the default
    "gate_softcross_f32": ("gate_softcross_f32", []),
    "rfa_gate": ("rfa_gate", []),  # the paper's: RFA cross attention, gate bias 0
    "gate_cross": ("gate_bias2", []),  # RFA cross attention, the current gate
    "gate_cross256": ("gate_bias2", LATER_CROSS[:2]),
    "gate_cross_rescale": ("gate_bias2", LATER_CROSS[2:]),
    "gate_cross_later": ("gate_bias2", LATER_CROSS + ["--rfa-causal-feature-dim", "32"]),
    "enc_rfa": ("enc_rfa", []),  # an RFA encoder too: sources of hundreds of tokens
}
DEFAULT_VARIANTS = ["softmax", "gate_softcross"]
METRICS = [("valid BLEU", "valid_bleu", 2), ("test BLEU", "test_bleu", 2)] + [
    (f"test {lo}-{hi or ''}", f"test_bleu_{lo}", 2) for lo, hi in BUCKETS]
TIME = "s_per_update_with_validation"


def prepare(a):
    """Sentence-level Multi30k (scripts/prepare_multi30k.sh: sentencepiece, references), joined into
    documents: --work/docs/{bin, SPLIT.ref.en (a document's sentences as shipped, joined by spaces),
    SPLIT.tgt_tokens (its length in subwords, separators included)}; docs/mixed/bin: the same with the
    sentence-level training set as ``train1``, in the documents' dictionary."""
    sent, docs = quality.prepare(a), a.work / "docs"
    if (docs / "mixed" / "bin" / "train1.de-en.en.idx").exists():
        return docs
    if not (docs / "bin" / "dict.en.txt").exists():
        make_document_data(sent, docs)
    mixed, tmp = docs / "mixed" / "bin", docs / "mixed" / "sentences"
    mixed.mkdir(parents=True, exist_ok=True)
    run([BIN / "fairseq-preprocess", "--source-lang", "de", "--target-lang", "en", "--workers", "1",
         "--srcdict", docs / "bin" / "dict.de.txt", "--tgtdict", docs / "bin" / "dict.en.txt",
         "--trainpref", sent / "train.spm", "--destdir", tmp], docs / "mixed" / "preprocess.log")
    for f in (docs / "bin").iterdir():
        (mixed / f.name).unlink(missing_ok=True)
        (mixed / f.name).symlink_to(f.resolve())
    for f in tmp.glob("train.*"):
        f.replace(mixed / f.name.replace("train.", "train1.", 1))
    return docs


def make_document_data(sent: Path, docs: Path):
    """--work/docs from the sentence-level data in ``sent`` (see prepare)."""
    docs.mkdir(parents=True, exist_ok=True)
    data = ROOT / "data" / "multi30k"
    for split in ("train", "valid", "test"):
        pieces = {lang: (sent / f"{split}.spm.{lang}").read_text(encoding="utf-8").splitlines() for lang in ("de", "en")}
        encoded = make_documents(pieces["de"], pieces["en"])
        for lang, side in (("de", "src"), ("en", "tgt")):
            (docs / f"{split}.spm.{lang}").write_text("".join(getattr(d, side) + "\n" for d in encoded), encoding="utf-8")
        if split != "train":  # the references as shipped, grouped the same way (same line count, same seed)
            text = make_documents(read_lines(str(data / f"{split}.de.gz")), read_lines(str(data / f"{split}.en.gz")))
            assert [d.size for d in text] == [d.size for d in encoded]
            (docs / f"{split}.ref.en").write_text("".join(" ".join(split_document(d.tgt)) + "\n" for d in text),
                                                  encoding="utf-8")
            (docs / f"{split}.tgt_tokens").write_text("".join(f"{len(d.tgt.split())}\n" for d in encoded))
    run([BIN / "fairseq-preprocess", "--source-lang", "de", "--target-lang", "en", "--joined-dictionary",
         "--workers", "1", *[f for s in ("train", "valid", "test") for f in (f"--{s}pref", docs / f"{s}.spm")],
         "--destdir", docs / "bin"], docs / "preprocess.log")


def score(generated: Path, refs: Path, lengths: Path) -> dict:
    """Document BLEU (separators removed) overall and by the reference's length in subwords."""
    hyps = [" ".join(split_document(h)) for h in hypotheses(generated)]
    ref = refs.read_text(encoding="utf-8").splitlines()
    sizes = [int(n) for n in lengths.read_text().split()]
    metric = sacrebleu.BLEU(force=True)
    found = {"bleu": round(metric.corpus_score(hyps, [ref]).score, 2)}
    for lo, hi in BUCKETS:
        pick = [i for i, n in enumerate(sizes) if n > lo and (hi is None or n <= hi)]
        if pick:
            found[f"bleu_{lo}"] = round(metric.corpus_score([hyps[i] for i in pick], [[ref[i] for i in pick]]).score, 2)
            found[f"docs_{lo}"] = len(pick)
    return found


def run_one(variant, s, seed, data, out, a) -> dict:
    base, extra = VARIANTS[variant]
    mixed = s.get("sentences", True)  # fairseq's --upsample-primary default (-1) fails on a second training split
    flags = quality.train_flags(base, s, seed, data / "mixed" if mixed else data) + extra + POSITIONS + (
        ["--upsample-primary", "1"] if mixed else [])
    record = {"flags": " ".join(quality.VARIANTS[base] + extra), **train(flags, out, s["updates"], a)}
    for split in ("valid", "test"):
        # fairseq-generate (beam 4) with runner.bleu; its sentence-level score is replaced by the documents'
        r = bleu(data / "bin", out / "checkpoint_last.pt", split, data / f"{split}.ref.en", out, a,
                 post=("--post-process", "sentencepiece", *POSITIONS, *GENERATE))
        found = score(out / f"generate.{split}.out", data / f"{split}.ref.en", data / f"{split}.tgt_tokens")
        record.update({f"{split}_{k}": v for k, v in found.items()}, **{f"{split}_tokens_per_s": r.get("tokens_per_s")})
    (out / "record.json").write_text(json.dumps(record))
    return record


if __name__ == "__main__":
    main(sys.modules[__name__])
