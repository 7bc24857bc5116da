#!/usr/bin/env bash
# The optimization ladder, run the way benchmarks/README.md ("bench ladder") records it.
#
#   benchmarks/ladder.sh cpu            # this CPU: preset nano on Shakespeare, every stage
#   benchmarks/ladder.sh gpu            # a CUDA GPU: GPT-2 124M, T=1024, B=16 then B=64
#   benchmarks/ladder.sh cpu --steps 50 # extra flags go to every `gptspeed bench` call
#
# Results land in benchmarks/runs/<cpu|gpu-B..>-<date>/ (ladder.md, ladder.json, ladder.png, logs/).
# Run on a quiet machine: anything else using the CPU or GPU shows up in the figures.
set -euo pipefail
cd "$(dirname "$0")/.."
which=${1:-cpu}
shift || true
stamp=$(date +%Y%m%d-%H%M%S)
data=data/shakespeare-gutenberg
[ -f "$data/manifest.json" ] || gptspeed prepare shakespeare-gutenberg --out "$data"
case "$which" in
  cpu)
    gptspeed bench --ladder --device cpu --preset nano --steps 20 --warmup 5 --data "$data" \
      --out "benchmarks/runs/cpu-$stamp" "$@"
    ;;
  gpu)
    for B in 16 64; do
      gptspeed bench --ladder --device cuda --preset gpt2 --seq-len 1024 --batch-size "$B" --steps 50 --warmup 10 \
        --data "$data" --out "benchmarks/runs/gpu-B$B-$stamp" "$@"
    done
    ;;
  *)
    echo "usage: benchmarks/ladder.sh cpu|gpu [gptspeed bench flags]" >&2
    exit 2
    ;;
esac
