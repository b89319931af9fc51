#!/usr/bin/env bash
# Documents through fairseq-interactive: plain text in (a sentence a line, blank lines between documents), one
# translated line per source line out, as rfa-translate-documents writes it (recipes/README.md, "Translating documents").
#
#   bash recipes/tools/interactive_documents.sh DATA_BIN CKPT SPM_MODEL IN OUT [fairseq-interactive flags]
#
# Each document becomes one line of sentencepiece pieces, its sentences joined by <sep> (the model's training
# format); fairseq-interactive translates the lines; each translation is split at <sep> and decoded. Defaults:
# beam 4, --max-len-a 1.2 --max-len-b 10 (the flags after OUT override them). OUT.docs and OUT.log stay beside OUT.
set -euo pipefail
if [ $# -lt 5 ]; then
  echo "usage: $0 DATA_BIN CKPT SPM_MODEL IN OUT [fairseq-interactive flags]" >&2
  exit 2
fi
DATA=$1 CKPT=$2 SPM=$3 IN=$4 OUT=$5
shift 5
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
for f in "$CKPT" "$SPM" "$IN"; do
  [ -f "$f" ] || { echo "$0: $f: no such file" >&2; exit 2; }
done
python - "$SPM" "$IN" > "$OUT.docs" <<'PY'
import sys, sentencepiece
from rfa_fairseq.cli.translate_documents import encode, read_documents
spm = sentencepiece.SentencePieceProcessor(model_file=sys.argv[1])
print("\n".join(encode(spm, d.sentences) for d in read_documents([sys.argv[2]])[0].documents))
PY
fairseq-interactive "$DATA" --user-dir "$ROOT/rfa_fairseq" --path "$CKPT" --input "$OUT.docs" \
  --task rfa_translation --beam 4 --max-len-a 1.2 --max-len-b 10 "$@" > "$OUT.log"
python - "$SPM" "$IN" "$OUT.log" "$OUT" <<'PY'
import sys, sentencepiece
from rfa_fairseq.cli.translate_documents import layout, lines_of, read_documents
spm_model, source, log, out = sys.argv[1:]
spm, found = sentencepiece.SentencePieceProcessor(model_file=spm_model), read_documents([source])[0]
docs = found.documents
hypotheses = {}
for line in open(log, encoding="utf-8"):
    if line.startswith("H-"):  # H-<document>, score, the best hypothesis
        i, _, text = line.rstrip("\n").split("\t")
        hypotheses.setdefault(int(i[2:]), text)
if sorted(hypotheses) != list(range(len(docs))):
    sys.exit(f"{log}: translations of {len(hypotheses)} of the {len(docs)} documents of {source}")
lines = [lines_of(d, hypotheses[i], spm, source)[0] for i, d in enumerate(docs)]
open(out, "w", encoding="utf-8").write(layout(found, lines))
PY
