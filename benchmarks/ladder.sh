#!/usr/bin/env bash
# The optimization ladder, run the way benchmarks/README.md ("bench ladder", "bench verify", "Recipes") describes
# it; its results are recorded in benchmarks/LOG.md.
#
#   benchmarks/ladder.sh cpu            # this CPU: preset nano on Shakespeare, every stage
#   benchmarks/ladder.sh gpu            # a CUDA GPU: bench verify, then the ladder of GPT-2 124M at T=1024,
#                                       #   B=16 (every stage) and B=64 (from bf16 on: fp32 at B=64 needs ~100 GB)
#   benchmarks/ladder.sh verify         # a CUDA GPU: bench verify only
#   benchmarks/ladder.sh cpu --steps 50 # extra flags go to every `gptspeed bench` call
#
# Results land in benchmarks/runs/<cpu|gpu-verify|gpu-B..>-<date>/ (ladder.md/.json/.png or
# verify.md/.json, logs/). A run that fails (a row out of memory, a crash, a rung that does not
# verify) is recorded in its folder and the next run still starts; the script exits 1 at the end
# naming the failed runs. Run on a quiet machine: anything else using the CPU or GPU shows up.
set -uo pipefail  # not -e: one failed run must not stop the others
cd "$(dirname "$0")/.."
which=${1:-cpu}
shift || true
stamp=$(date +%Y%m%d-%H%M%S)
data=data/shakespeare-gutenberg
failed=()
run() {  # run NAME COMMAND...: run it, and remember NAME if it fails
  local name=$1
  shift
  echo "== $name: $*" >&2
  "$@" || failed+=("$name (exit $?)")
}
case "$which" in
  cpu|gpu|verify) ;;
  *) echo "usage: benchmarks/ladder.sh cpu|gpu|verify [gptspeed bench flags]" >&2; exit 2 ;;
esac
[ -f "$data/manifest.json" ] || gptspeed prepare shakespeare-gutenberg --out "$data" || exit 1
gpu_shape=(--device cuda --preset gpt2 --seq-len 1024 --data "$data")
verify() {
  run gpu-verify gptspeed bench verify "${gpu_shape[@]}" --steps 20 --warmup 5 \
    --out "benchmarks/runs/gpu-verify-$stamp" "$@"
}
case "$which" in
  cpu)
    run cpu gptspeed bench ladder --device cpu --preset nano --steps 20 --warmup 5 --data "$data" \
      --out "benchmarks/runs/cpu-$stamp" "$@"
    ;;
  verify)
    verify "$@"
    ;;
  gpu)
    verify "$@"
    run gpu-B16 gptspeed bench ladder "${gpu_shape[@]}" --batch-size 16 --steps 50 --warmup 10 \
      --out "benchmarks/runs/gpu-B16-$stamp" "$@"
    # fp32 rows at B=64 would need ~100 GB (activations of 124M at T=1024 in fp32): start at bf16
    from_bf16=$(python -c "from gptspeed.bench.stages import STAGE_NAMES as s; print(','.join(s[s.index('bf16'):]))")
    run gpu-B64 gptspeed bench ladder "${gpu_shape[@]}" --batch-size 64 --steps 50 --warmup 10 \
      --stages "$from_bf16" --out "benchmarks/runs/gpu-B64-$stamp" "$@"
    ;;
esac
if [ ${#failed[@]} -gt 0 ]; then
  echo "benchmarks/ladder.sh: ${#failed[@]} run(s) failed: ${failed[*]} (each run's folder says why)" >&2
  exit 1
fi
