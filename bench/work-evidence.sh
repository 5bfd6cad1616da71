#!/usr/bin/env bash
# Evidence for issue 6: save-load restarts and budget assignment, 3 seeds each.
#   milestones-restarts: one long, sparse task (3 rooms of 6 cells); restart share 0, 0.25, 0.5.
#   milestones-tasks: chains of 2, 3 and 4 rooms of 6 cells; uniform vs learnability.
#   memory-tasks (GRU): 4 cues, recall delays 4, 16, 64, 256; uniform vs learnability vs ucb.
# Each run writes work.jsonl (per-task fresh-start success per update); bench/plot_work.py
# turns them into docs/img/*.svg and a table.
#   bench/work-evidence.sh [OUT_DIR]   (default runs/work-evidence)
set -euo pipefail
cd "$(dirname "$0")/.."
. bench/lib.sh
out="${1:-runs/work-evidence}"
mkdir -p "$out"
volley=$(volley_bin)
# shellcheck disable=SC2054  # the commas are inside each task spec
ms_tasks=(--task milestones:n_rooms=2,room_len=6,max_steps=48 --task milestones:n_rooms=3,room_len=6,max_steps=72
          --task milestones:n_rooms=4,room_len=6,max_steps=96)
# shellcheck disable=SC2054
mem_tasks=(--task memory:n_cues=4,delay=4 --task memory:n_cues=4,delay=16 --task memory:n_cues=4,delay=64
           --task memory:n_cues=4,delay=256)
run() { # study config seed flags...
  local study=$1 name=$2 seed=$3; shift 3
  "$volley" train --seed "$seed" --target-return 1e9 --max-secs 600 --progress lines \
    --run-dir "$out/$study/$name/seed$seed" "$@" > /dev/null 2>&1
  echo "$study $name seed $seed done"
}
for seed in 1 2 3; do
  # Save-load as exploration on one long, sparse task (3 rooms of 6 cells, 72 steps).
  for share in 0 0.25 0.5; do
    run milestones-restarts "restart-share-$share" "$seed" --env milestones --rooms 3 --room-len 6 --work \
      --restart-share "$share" --ent-coef 0.01 --max-env-steps 1000000
  done
  # Budget assignment across chain lengths.
  for budget in uniform learnability; do
    run milestones-tasks "$budget" "$seed" --env milestones --rooms 4 --room-len 6 --work "${ms_tasks[@]}" \
      --budget "$budget" --ent-coef 0.01 --max-env-steps 1000000
  done
  # Budget assignment across recall delays (GRU; 4 cues, chance 0.25).
  for budget in uniform learnability ucb; do
    run memory-tasks "$budget" "$seed" --env memory --memory-cues 4 --memory-delay 4 --core gru --gru-hidden 32 \
      --work "${mem_tasks[@]}" --budget "$budget" --max-env-steps 600000
  done
done
