"""rfa-translate-documents: plain-text documents through a document model (``--sentence-index``), one translated line
per source line.

    rfa-translate-documents DATA_BIN --path ckpt.pt --sentencepiece-model spm.model --documents docs.de --output docs.en

A sentence a line, blank lines between documents (a file without blank lines is one document); the output has a line
for each input line, the blank ones where they were. With several ``--documents`` files ``--output`` is a folder that
gets a file of each one's name. Documents are encoded as the model was trained (``scripts/make_documents.py``:
sentencepiece pieces, the sentences joined by ``<sep>``), batched by length (``--batch-size``, ``--max-tokens``) and
translated by fairseq's generator with its flags (``--beam``, ``--lenpen``, ``--cpu``, ``--model-overrides``...;
``--max-len-a`` 1.2 and ``--max-len-b`` 10 by default here). Sentence-aligned decoding gives each document one
sentence per source sentence, the model's ``--sentence-min`` x to 2 x its source's subwords + 10; where it does not
(fairseq's length limit, or the alignment turned off) the missing lines are left empty or the extra sentences join the
last line, with a warning naming it."""
import logging
import os
import sys
from pathlib import Path
from typing import List, NamedTuple, Tuple

import torch

logger = logging.getLogger("rfa_fairseq.translate_documents")
SEPARATOR = "<sep>"


class Document(NamedTuple):
    file: int  # which --documents file
    first_line: int  # 1-based
    sentences: List[str]


class Source(NamedTuple):
    documents: List[Document]
    lines: int  # the file's lines, blank ones included: its translation has as many


def read_documents(paths: List[str]) -> List[Source]:
    """Each input's documents: runs of non-blank lines, separated by one blank line or more (blank lines at the start
    or the end are kept as they are). ValueError names a file without a document and a sentence with the separator."""
    found = []
    for i, path in enumerate(paths):
        lines = Path(path).read_text(encoding="utf-8-sig").splitlines()
        docs = []
        for n, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            if SEPARATOR in line.split():
                raise ValueError(f"{path}:{n}: the sentence holds {SEPARATOR}, the documents' separator")
            if n == 1 or not lines[n - 2].strip():  # the first line of a document
                docs.append(Document(i, n, []))
            docs[-1].sentences.append(line.strip())
        if not docs:
            raise ValueError(f"{path}: no document to translate (the file is {'blank' if lines else 'empty'})")
        found.append(Source(docs, len(lines)))
    return found


def layout(source: Source, translations: List[List[str]]) -> str:
    """The translated file: each document's lines (``lines_of``) where its source's are, blank lines where the source
    has them, one line for each of the source's lines."""
    out = [""] * source.lines
    for doc, sentences in zip(source.documents, translations, strict=True):
        assert len(sentences) == len(doc.sentences), "lines_of gives a line for each source sentence"
        out[doc.first_line - 1:doc.first_line - 1 + len(sentences)] = sentences
    return "".join(line + "\n" for line in out)


def encode(spm, sentences: List[str]) -> str:
    """A document as the model was trained on it: its sentences' sentencepiece pieces joined by the separator."""
    return f" {SEPARATOR} ".join(" ".join(spm.encode(s, out_type=str)) for s in sentences)


def lines_of(doc: Document, text: str, spm, name: str) -> Tuple[List[str], bool]:
    """``doc``'s translation ``text`` (pieces, separators) as one line per source sentence, and whether it had as many
    sentences; where not, a warning names the document, and the missing lines are empty or the extra join the last."""
    sentences = [spm.decode(s.split()) for s in f" {text} ".split(f" {SEPARATOR} ")]
    n = len(doc.sentences)
    if len(sentences) == n:
        return sentences, True
    logger.warning("%s, the document at line %d: %d sentences translated for %d (%s)", name, doc.first_line, len(sentences),
                   n, "the missing lines left empty" if len(sentences) < n else "the extra ones join its last line")
    return (sentences + [""] * n)[:n - 1] + [" ".join(sentences[n - 1:])], False


def main(argv=None):
    from fairseq import options
    parser = options.get_generation_parser(default_task="rfa_translation")
    parser.prog = "rfa-translate-documents"
    group = parser.add_argument_group("documents (rfa-translate-documents)")
    group.add_argument("--documents", nargs="+", required=True, metavar="FILE",
                       help="plain text: a sentence a line, a blank line between documents")
    group.add_argument("--output", required=True, help="the translation (a folder with several --documents files)")
    group.add_argument("--sentencepiece-model", required=True, help="the model's sentencepiece model (spm.model)")
    parser.set_defaults(max_len_a=1.2, max_len_b=10)  # a document's translation is about as long as its source
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--user-dir" not in argv:
        argv += ["--user-dir", os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]
    try:
        translate(options.parse_args_and_arch(parser, argv))
    except (ValueError, FileNotFoundError) as e:
        parser.error(str(e))


def translate(args):
    import sentencepiece
    from fairseq import checkpoint_utils, tasks, utils
    from fairseq.data import data_utils
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf
    from tqdm import tqdm

    if not os.path.isfile(args.sentencepiece_model):
        raise FileNotFoundError(f"--sentencepiece-model {args.sentencepiece_model}: no such file")
    if len(args.documents) > 1 and os.path.isfile(args.output):
        raise ValueError(f"--output {args.output}: with several --documents files, --output is a folder")
    sources = read_documents(args.documents)
    cfg = convert_namespace_to_omegaconf(args)
    utils.import_user_module(cfg.common)
    task = tasks.setup_task(cfg.task)
    src_dict, tgt_dict = task.source_dictionary, task.target_dictionary
    if src_dict.index(SEPARATOR) == src_dict.unk() or tgt_dict.index(SEPARATOR) == tgt_dict.unk():
        raise ValueError(f"the dictionaries in {cfg.task.data} have no {SEPARATOR}: translate documents with a model "
                         "trained on documents (scripts/make_documents.py)")
    models, _ = checkpoint_utils.load_model_ensemble(utils.split_paths(cfg.common_eval.path), task=task,
                                                     arg_overrides=eval(cfg.common_eval.model_overrides))
    cuda = torch.cuda.is_available() and not cfg.common.cpu
    for model in models:
        model.prepare_for_inference_(cfg)
        if cuda:
            model.cuda()
    limit = utils.resolve_max_positions(task.max_positions(), *[m.max_positions() for m in models])[0]
    spm = sentencepiece.SentencePieceProcessor(model_file=args.sentencepiece_model)
    docs = [d for source in sources for d in source.documents]
    tokens = []
    for d in docs:
        tokens.append(src_dict.encode_line(encode(spm, d.sentences), add_if_not_exist=False, append_eos=True).long())
        if tokens[-1].numel() > limit:
            raise ValueError(f"{args.documents[d.file]}, the document at line {d.first_line}: {tokens[-1].numel()} source "
                             f"tokens (subwords, separators and </s>), the model takes at most {limit}: split it")
    generator = task.build_generator(models, cfg.generation)
    order = sorted(range(len(docs)), key=lambda i: tokens[i].numel())
    max_docs, max_tokens = cfg.dataset.batch_size or 8, cfg.dataset.max_tokens or 12000
    batches = [[]]
    for i in order:  # by length: the batch's longest document times its size within --max-tokens
        if batches[-1] and (len(batches[-1]) == max_docs or tokens[i].numel() * (len(batches[-1]) + 1) > max_tokens):
            batches.append([])
        batches[-1].append(i)
    translated = [None] * len(docs)
    with tqdm(total=len(docs), unit="doc", disable=cfg.common.no_progress_bar or len(docs) < 2, file=sys.stderr) as bar:
        for batch in batches:
            src = data_utils.collate_tokens([tokens[i] for i in batch], src_dict.pad(), left_pad=True)
            sample = {"id": torch.tensor(batch), "net_input": {
                "src_tokens": src, "src_lengths": torch.tensor([tokens[i].numel() for i in batch])}}
            if cuda:
                sample = utils.move_to_cuda(sample)
            with torch.no_grad():
                hypos = task.inference_step(generator, models, sample)
            for i, nbest in zip(batch, hypos):
                translated[i] = tgt_dict.string(nbest[0]["tokens"].int().cpu())
            bar.update(len(batch))
    misaligned, lines = 0, [[] for _ in args.documents]  # each file's documents' lines
    for d, text in zip(docs, translated):
        sentences, aligned = lines_of(d, text, spm, args.documents[d.file])
        misaligned += not aligned
        lines[d.file].append(sentences)
    paths = [args.output] if len(args.documents) == 1 else [os.path.join(args.output, os.path.basename(p)) for p in args.documents]
    if len(args.documents) > 1:
        os.makedirs(args.output, exist_ok=True)
    for path, source, file_lines in zip(paths, sources, lines):
        Path(path).write_text(layout(source, file_lines), encoding="utf-8")
    logger.info("%d documents, %d sentences translated into %s%s", len(docs), sum(len(d.sentences) for d in docs),
                args.output, f"; {misaligned} not sentence-aligned" if misaligned else "")


if __name__ == "__main__":
    main()
