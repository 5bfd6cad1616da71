#!/usr/bin/env bash
# Evidence for issue 18 (docs/AGENTIC.md), 5 seeds per configuration:
#   chain-restarts: a long sparse chain (5 rooms of 6 cells, 24 steps allowed per room): a random
#     policy clears a room with probability about 0.1, so fresh episodes finish about once in
#     10^5; restart share 0 (fresh only) vs 0.5 (Go-Explore-style restarts from saved room entries), 1M env steps.
#   family-budget: a task family whose observations say the member (task features): a too-easy
#     member (1 room of 4 cells), two learnable ones (3 and 4 rooms of 6 cells, 24 steps per
#     room) and six too-hard ones (5 x 20, 6 x 16, 7 x 14, 8 x 12, 10 x 10 and 12 x 8, one step of
#     slack per room: a random policy clears such a room with probability about 3^-room_len),
#     as in procedurally generated families where most levels are trivial or out of reach;
#     uniform vs learnability, fresh starts only, 400K env steps.
# Each run writes work.jsonl; bench/plot_work.py EVIDENCE_DIR docs/img makes the plots and tables.
#   bench/agentic-evidence.sh [OUT_DIR] [SEEDS]   (default runs/agentic-evidence, "1 2 3 4 5")
set -euo pipefail
cd "$(dirname "$0")/.."
. bench/lib.sh
out="${1:-runs/agentic-evidence}"
seeds="${2:-1 2 3 4 5}"
mkdir -p "$out"
volley=$(volley_bin)
run() { # study config seed env-steps flags...
  local study=$1 name=$2 seed=$3 steps=$4; shift 4
  "$volley" train --seed "$seed" --target-return 1e9 --max-secs 900 --progress lines \
    --env milestones --reward-scale 1 --ent-coef 0.01 --work --max-env-steps "$steps" \
    --run-dir "$out/$study/$name/seed$seed" "$@" > /dev/null 2>&1
  echo "$study $name seed $seed done"
}
family=(--task "milestones:n_rooms=1,room_len=4,max_steps=32,task_features=true"
        --task "milestones:n_rooms=3,room_len=6,room_steps=24,max_steps=72,task_features=true"
        --task "milestones:n_rooms=4,room_len=6,room_steps=24,max_steps=96,task_features=true"
        --task "milestones:n_rooms=6,room_len=16,room_steps=17,max_steps=102,task_features=true"
        --task "milestones:n_rooms=8,room_len=12,room_steps=13,max_steps=104,task_features=true"
        --task "milestones:n_rooms=10,room_len=10,room_steps=11,max_steps=110,task_features=true"
        --task "milestones:n_rooms=5,room_len=20,room_steps=21,max_steps=105,task_features=true"
        --task "milestones:n_rooms=7,room_len=14,room_steps=15,max_steps=105,task_features=true"
        --task "milestones:n_rooms=12,room_len=8,room_steps=9,max_steps=108,task_features=true")
for seed in $seeds; do
  for share in 0 0.5; do
    run chain-restarts "restart-share-$share" "$seed" 1000000 --rooms 5 --room-len 6 --room-steps 24 --room-max-steps 120 \
      --restart-share "$share"
  done
  for budget in uniform learnability; do
    run family-budget "$budget" "$seed" 400000 --rooms 3 --room-len 6 --room-steps 24 --room-max-steps 72 \
      --milestones-task-features "${family[@]}" --budget "$budget"
  done
done
