#!/bin/bash
# One run of the tokenizer race: ARM (gpt2 | tok-16384 | tok-50257), its --eval-tokens, SEED (1337, 1338, 1339).
set -u
cd /tmp/tokrace
ARM=$1; TOKENS=$2; SEED=$3
out=runs/$ARM-seed$((SEED-1337))
nice -n 10 gptspeed train --preset nano --data data-$ARM --seed $SEED --threads 1 \
  --eval-every 50 --eval-tokens $TOKENS --eval-bpb --device cpu --out $out > logs/$ARM-seed$((SEED-1337)).log 2>&1 \
  && touch $out/DONE
