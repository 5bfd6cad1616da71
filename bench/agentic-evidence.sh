#!/usr/bin/env bash
# Evidence for issue 18 (docs/AGENTIC.md), 5 seeds per configuration, 1M env steps each:
#   chain-restarts: a long sparse chain (5 rooms of 6 cells, 24 steps allowed per room): a random
#     policy clears a room with probability about 0.1, so fresh episodes finish about once in
#     10^5; restart share 0 (fresh only) vs 0.5 (Go-Explore-style restarts from saved room entries).
#   family-budget: a task family whose observations say the member (task features): a too-easy
#     member (1 room of 4 cells), two learnable ones (2 and 3 rooms of 6 cells, 24 steps per
#     room) and a too-hard one (6 rooms of 8 cells, 24 steps per room); uniform vs learnability,
#     fresh starts only.
# Each run writes work.jsonl; bench/plot_work.py EVIDENCE_DIR docs/img makes the plots and tables.
#   bench/agentic-evidence.sh [OUT_DIR] [SEEDS]   (default runs/agentic-evidence, "1 2 3 4 5")
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-runs/agentic-evidence}"
seeds="${2:-1 2 3 4 5}"
mkdir -p "$out"
if [ -z "${VOLLEY_BIN:-}" ]; then
  cargo build --release -p volley >/dev/null 2>&1
fi
volley=${VOLLEY_BIN:-target/release/volley}
run() { # study config seed flags...
  local study=$1 name=$2 seed=$3; shift 3
  "$volley" train --seed "$seed" --target-return 1e9 --max-secs 900 --progress lines \
    --env milestones --reward-scale 1 --ent-coef 0.01 --work --max-env-steps 1000000 \
    --run-dir "$out/$study/$name/seed$seed" "$@" > /dev/null 2>&1
  echo "$study $name seed $seed done"
}
family=(--task "milestones:n_rooms=1,room_len=4,max_steps=32,task_features=true"
        --task "milestones:n_rooms=2,room_len=6,room_steps=24,max_steps=48,task_features=true"
        --task "milestones:n_rooms=3,room_len=6,room_steps=24,max_steps=72,task_features=true"
        --task "milestones:n_rooms=6,room_len=8,room_steps=24,max_steps=144,task_features=true")
for seed in $seeds; do
  for share in 0 0.5; do
    run chain-restarts "restart-share-$share" "$seed" --rooms 5 --room-len 6 --room-steps 24 --room-max-steps 120 \
      --restart-share "$share"
  done
  for budget in uniform learnability; do
    run family-budget "$budget" "$seed" --rooms 3 --room-len 6 --room-steps 24 --room-max-steps 72 \
      --milestones-task-features "${family[@]}" --budget "$budget"
  done
done
