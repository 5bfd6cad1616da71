#!/usr/bin/env bash
# Evidence for issue 18 item 3 (docs/AGENTIC.md, "Credit across segments"): stitched BPTT windows
# against single-segment training on the memory task (2 cues, GRU 64, segments of T = 32 steps),
# 5 seeds per configuration, the same env-step budget and batch size for both arms of a delay
# (runs go to their budget: --target-return 1e9).
#   single:      --bptt-segments 1 (truncated BPTT over one segment, today's behaviour)
#   stitched-kK: --bptt-segments K (windows of K consecutive segments, K·T steps of BPTT)
# Each run writes metrics.jsonl (success rate of the last 100 episodes per update, env steps,
# wall time) and summary.json (windows by outcome); plots and tables:
#   python3 bench/plot_bptt.py OUT_DIR docs/img
# Usage: bench/stitched-bptt.sh [OUT_DIR] [SEEDS]   (default runs/stitched-bptt, "1 2 3 4 5")
# CONFIGS: "delay:K:batch_segments:env_steps ..." (default "64:8:8:3000000 128:16:16:8000000").
# Heavy runs on a shared machine: run it under `flock /work/bench.lock`.
set -euo pipefail
cd "$(dirname "$0")/.."
. bench/lib.sh
out="${1:-runs/stitched-bptt}"
seeds="${2:-1 2 3 4 5}"
configs="${CONFIGS:-64:8:8:3000000 128:16:16:8000000}"
mkdir -p "$out"
volley=$(volley_bin)
run() { # delay name seed batch steps flags...
  local delay=$1 name=$2 seed=$3 batch=$4 steps=$5; shift 5
  local dir="$out/delay-$delay/$name/seed$seed"
  if [ -f "$dir/summary.json" ]; then
    echo "delay $delay $name seed $seed: done before, kept"
    return
  fi
  "$volley" train --env memory --memory-cues 2 --memory-delay "$delay" --core gru --backend cpu \
    --seed "$seed" --batch-segments "$batch" --max-env-steps "$steps" --target-return 1e9 --max-secs 3600 \
    --progress quiet --run-dir "$dir" "$@" > "$dir.log" 2>&1 || { echo "delay $delay $name seed $seed FAILED (see $dir.log)"; return; }
  echo "delay $delay $name seed $seed done"
}
for seed in $seeds; do
  for config in $configs; do
    IFS=: read -r delay k batch steps <<< "$config"
    mkdir -p "$out/delay-$delay/single" "$out/delay-$delay/stitched-k$k"
    run "$delay" single "$seed" "$batch" "$steps" --bptt-segments 1
    run "$delay" "stitched-k$k" "$seed" "$batch" "$steps" --bptt-segments "$k"
  done
done
python3 bench/plot_bptt.py "$out" "${PLOT_DIR:-$out/img}"
