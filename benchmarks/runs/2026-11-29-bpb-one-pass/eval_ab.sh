#!/bin/bash
# A = before (910bb68: val loss pass + a row-at-a-time bpb pass), B = after (one pass); interleaved
cd /tmp/bpb_meas
export GPTSPEED_CACHE=cache
for i in 1 2 3; do
  for arm in A B; do
    if [ $arm = A ]; then pp=/tmp/bpb_old/src; else pp=/work/w-bpbonepass/src; fi
    /usr/bin/time -f "$arm $i wall %e user %U sys %S" -o time_$arm$i.txt env PYTHONPATH=$pp /work/w-bpbonepass/.venv/bin/python -m gptspeed eval --run run --data cache/prepared/tinyshakespeare --max-tokens 8192 --device cpu > out_$arm$i.json 2> err_$arm$i.txt
    cat time_$arm$i.txt; uptime
  done
done
