#!/usr/bin/env bash
# Evidence for issue 18, item 2 (group rollouts; docs/AGENTIC.md), 5 seeds per configuration,
# the same env-step budget per run (STEPS, default 1M), on a sparse task: milestones with 4 rooms
# of 8 cells and a 128-step limit (reward 1 at the last door, 0 otherwise; the task where
# learning hinges on a first success, docs/AGENTIC.md "0."), V-trace, --reward-scale 1
# --ent-coef 0.01, work mode, fresh starts only.
#   group-baseline: critic (single items, the critic's advantages) vs group (groups of K = 8
#     continuations from one fresh start, A = G_k − mean G on complete groups).
#   group-filter: group rollouts with the group baseline, without vs with the zero-variance
#     filter (groups whose 8 returns are all equal are dropped); the "group" runs are shared
#     with group-baseline (symlinked), so each configuration runs once.
# Each run writes work.jsonl and summary.json (which counts segments by group outcome);
# bench/plot_work.py EVIDENCE_DIR docs/img makes the plots and tables.
#   bench/group-evidence.sh [OUT_DIR] [SEEDS]   (default runs/group-evidence, "1 2 3 4 5")
# Heavy runs on a shared machine: wrap in `flock /work/bench.lock` (the script runs one at a time).
set -euo pipefail
cd "$(dirname "$0")/.."
. bench/lib.sh
out="${1:-runs/group-evidence}"
seeds="${2:-1 2 3 4 5}"
steps="${STEPS:-1000000}"
mkdir -p "$out/group-baseline" "$out/group-filter"
volley=$(volley_bin)
run() { # study config seed flags...
  local study=$1 name=$2 seed=$3; shift 3
  local dir="$out/$study/$name/seed$seed"
  local started=$SECONDS
  "$volley" train --seed "$seed" --target-return 1e9 --max-secs 3600 --progress lines \
    --env milestones --rooms 4 --room-len 8 --room-max-steps 128 --reward-scale 1 --ent-coef 0.01 \
    --work --max-env-steps "$steps" --run-dir "$dir" "$@" > /dev/null 2>&1
  echo "$study $name seed $seed done in $((SECONDS - started)) s"
}
for seed in $seeds; do
  run group-baseline critic "$seed"
  run group-baseline group "$seed" --group-size 8 --baseline group
  run group-filter group-zero-variance "$seed" --group-size 8 --baseline group --select-zero-variance-min-group 2
  mkdir -p "$out/group-filter/group"
  ln -sfn "$(cd "$out/group-baseline/group/seed$seed" && pwd)" "$out/group-filter/group/seed$seed"
done
