#!/usr/bin/env bash
# WMT14 English->French: download, extract, joint sentencepiece model (40k), clean, binarise.
#
#   bash recipes/wmt14_en_fr/prepare.sh                      # downloads from statmt.org (about 4 GB)
#   RAW_DIR=/data/wmt14 bash recipes/wmt14_en_fr/prepare.sh  # a folder holding the archives below or their contents
#   SMOKE=1 bash recipes/wmt14_en_fr/prepare.sh              # offline stand-in made from data/multi30k
#
# Data (36M sentence pairs, as Vaswani et al. 2017 and Ott et al. 2018): Europarl v7, Common
# Crawl, UN (undoc.2000), News Commentary v9 and the 10^9 French-English corpus (giga-fren, read
# compressed); newstest2013 for validation, newstest2014 (full, 3,003 sentences) for test.
# The steps and how they differ from fairseq's prepare-wmt14en2fr.sh: recipes/wmt14.sh.
# Smoke mode has no French: the German side of Multi30k stands in for it.
# Output: $WORK/data-bin, $WORK/spm.model, references $WORK/text/test.fr (as in the .sgm).
# shellcheck source=recipes/common.sh
. "$(dirname "${BASH_SOURCE[0]}")/../common.sh"
# shellcheck source=recipes/wmt14.sh
. "$RECIPES/wmt14.sh"
recipe_init wmt14_en_fr
SRC=en TGT=fr
RAW_DIR=${1:-${RAW_DIR:-$WORK/orig}}
VOCAB=${VOCAB:-40000}
CORPORA=(training/europarl-v7.fr-en commoncrawl.fr-en un/undoc.2000.fr-en training/news-commentary-v9.fr-en
         giga-fren.release2.fixed)
DEV=dev/newstest2013
TEST_SRC_SGM=test-full/newstest2014-fren-src.en.sgm
TEST_REF_SGM=test-full/newstest2014-fren-ref.fr.sgm
# archive, a file it contains (its presence skips the download), URLs (statmt.org; http fallback)
ARCHIVES=(
  "training-parallel-europarl-v7.tgz training/europarl-v7.fr-en.en https://www.statmt.org/wmt13/training-parallel-europarl-v7.tgz http://statmt.org/wmt13/training-parallel-europarl-v7.tgz"
  "training-parallel-commoncrawl.tgz commoncrawl.fr-en.en https://www.statmt.org/wmt13/training-parallel-commoncrawl.tgz http://statmt.org/wmt13/training-parallel-commoncrawl.tgz"
  "training-parallel-un.tgz un/undoc.2000.fr-en.en https://www.statmt.org/wmt13/training-parallel-un.tgz http://statmt.org/wmt13/training-parallel-un.tgz"
  "training-parallel-nc-v9.tgz training/news-commentary-v9.fr-en.en https://www.statmt.org/wmt14/training-parallel-nc-v9.tgz http://statmt.org/wmt14/training-parallel-nc-v9.tgz"
  "training-giga-fren.tar giga-fren.release2.fixed.en https://www.statmt.org/wmt10/training-giga-fren.tar http://statmt.org/wmt10/training-giga-fren.tar"
  "dev.tgz dev/newstest2013.en https://www.statmt.org/wmt14/dev.tgz http://statmt.org/wmt14/dev.tgz"
  "test-full.tgz test-full/newstest2014-fren-src.en.sgm https://www.statmt.org/wmt14/test-full.tgz http://statmt.org/wmt14/test-full.tgz"
)
wmt14_prepare
