#!/bin/bash
# The commands of the tokenizer race as run (issue 55 item 5), in /tmp/tokrace, 2026-11-29, gptspeed at the
# commit named in the README. GUT = the 77 Gutenberg books; TOK = the tokenizers of
# runs/2026-11-29-tokenizer-gutenberg (trained on 68 of the books; its run.sh remakes them).
set -e
GUT=/work/shared/data/shakespeare-gutenberg; TOK=/work/tok-gut
# 1. The same text, prepared three times, differing only in the tokenizer (--shuffle-seed 1 as the earlier races)
gptspeed prepare $GUT --out data-gpt2 --shuffle-seed 1 --tokenizer gpt2
gptspeed prepare $GUT --out data-tok-16384 --shuffle-seed 1 --tokenizer $TOK/tok-16384
gptspeed prepare $GUT --out data-tok-50257 --shuffle-seed 1 --tokenizer $TOK/tok-50257
python valdocs.py data-gpt2 data-tok-16384 data-tok-50257 > valdocs.txt   # the same 9 val books in each
python bytes.py > bytes.txt                                                # the text each evaluation covers
# 2. The runs: `bench race` refuses --data in an arm, so each run is the `gptspeed train` a race would start
#    (run1.sh: --preset nano --seed S --device cpu --eval-bpb; --eval-tokens per arm = the same 33.4 kB of text),
#    all nine started together (3 at 09:10, 6 at 09:15 UTC) at nice 10, one thread each, on a shared machine.
for s in 1337 1338 1339; do
  ./run1.sh gpt2 10240 $s & ./run1.sh tok-16384 8704 $s & ./run1.sh tok-50257 8064 $s &
done; wait
# 3. The comparison (metrics.json, table.md) and the one val book no tokenizer saw (heldout.json)
python analyse.py
python heldout_eval.py runs/*-seed*
