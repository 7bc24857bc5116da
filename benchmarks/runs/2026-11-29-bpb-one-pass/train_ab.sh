#!/bin/bash
cd /tmp/bpb_meas
export GPTSPEED_CACHE=cache
for i in 1 2 3; do
  for arm in A B; do
    if [ $arm = A ]; then pp=/tmp/bpb_old/src; else pp=/work/w-bpbonepass/src; fi
    rm -rf tr_$arm$i
    echo "$arm $i $(env PYTHONPATH=$pp /work/w-bpbonepass/.venv/bin/python train_eval.py tr_$arm$i 2>err_tr_$arm$i.txt)"
    uptime
  done
done
