#!/usr/bin/env bash
# WMT14 English->German: download, extract, joint sentencepiece model (32k), clean, binarise.
#
#   bash recipes/wmt14_en_de/prepare.sh                      # downloads from statmt.org (about 1.6 GB)
#   RAW_DIR=/data/wmt14 bash recipes/wmt14_en_de/prepare.sh  # a folder holding the archives below or their contents
#   SMOKE=1 bash recipes/wmt14_en_de/prepare.sh              # offline stand-in made from data/multi30k
#
# Data (4.5M sentence pairs, as Vaswani et al. 2017): Europarl v7, Common Crawl and News
# Commentary v9; newstest2013 for validation, newstest2014 (full, 3,003 sentences) for test.
# The steps and how they differ from fairseq's prepare-wmt14en2de.sh: recipes/wmt14.sh.
# Output: $WORK/data-bin, $WORK/spm.model, references $WORK/text/test.de (as in the .sgm).
# shellcheck source=recipes/common.sh
. "$(dirname "${BASH_SOURCE[0]}")/../common.sh"
# shellcheck source=recipes/wmt14.sh
. "$RECIPES/wmt14.sh"
recipe_init wmt14_en_de
SRC=en TGT=de
RAW_DIR=${1:-${RAW_DIR:-$WORK/orig}}
VOCAB=${VOCAB:-32000}
CORPORA=(training/europarl-v7.de-en commoncrawl.de-en training/news-commentary-v9.de-en)
DEV=dev/newstest2013
TEST_SRC_SGM=test-full/newstest2014-deen-src.en.sgm
TEST_REF_SGM=test-full/newstest2014-deen-ref.de.sgm
# archive, a file it contains (its presence skips the download), URLs (statmt.org; http fallback)
ARCHIVES=(
  "training-parallel-europarl-v7.tgz training/europarl-v7.de-en.en https://www.statmt.org/wmt13/training-parallel-europarl-v7.tgz http://statmt.org/wmt13/training-parallel-europarl-v7.tgz"
  "training-parallel-commoncrawl.tgz commoncrawl.de-en.en https://www.statmt.org/wmt13/training-parallel-commoncrawl.tgz http://statmt.org/wmt13/training-parallel-commoncrawl.tgz"
  "training-parallel-nc-v9.tgz training/news-commentary-v9.de-en.en https://www.statmt.org/wmt14/training-parallel-nc-v9.tgz http://statmt.org/wmt14/training-parallel-nc-v9.tgz"
  "dev.tgz dev/newstest2013.en https://www.statmt.org/wmt14/dev.tgz http://statmt.org/wmt14/dev.tgz"
  "test-full.tgz test-full/newstest2014-deen-src.en.sgm https://www.statmt.org/wmt14/test-full.tgz http://statmt.org/wmt14/test-full.tgz"
)
wmt14_prepare
