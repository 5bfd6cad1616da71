#!/usr/bin/env bash
# Evidence for issue 6: budget assignment and save-load restarts, 3 seeds each.
#   milestones (long, sparse): tasks = chains of 2, 3 and 4 rooms of 6 cells;
#     uniform vs learnability vs uniform + restarts vs learnability + restarts.
#   memory (multi-task, GRU): tasks = recall delays 2, 8, 16, 32; uniform vs learnability vs ucb.
# Each run writes work.jsonl (per-task fresh-start success per update); bench/plot_work.py
# turns them into docs/img/*.svg and a table.
#   bench/work-evidence.sh [OUT_DIR]   (default runs/work-evidence)
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-runs/work-evidence}"
mkdir -p "$out"
cargo build --release -p volley >/dev/null 2>&1
volley=target/release/volley
ms_tasks=(--task milestones:n_rooms=2,room_len=6,max_steps=48 --task milestones:n_rooms=3,room_len=6,max_steps=72
          --task milestones:n_rooms=4,room_len=6,max_steps=96)
mem_tasks=(--task memory:n_cues=2,delay=2 --task memory:n_cues=2,delay=8 --task memory:n_cues=2,delay=16
           --task memory:n_cues=2,delay=32)
for seed in 1 2 3; do
  for cfg in "uniform:--budget uniform" "learnability:--budget learnability" \
             "uniform+restarts:--budget uniform --restart-share 0.5" \
             "learnability+restarts:--budget learnability --restart-share 0.5"; do
    name=${cfg%%:*}; flags=${cfg#*:}
    # shellcheck disable=SC2086
    "$volley" train --env milestones --rooms 4 --room-len 6 --work "${ms_tasks[@]}" $flags --ent-coef 0.01 \
      --seed "$seed" --max-env-steps 1000000 --target-return 1e9 --max-secs 600 --progress lines \
      --run-dir "$out/milestones/$name/seed$seed" > /dev/null 2>&1
    echo "milestones $name seed $seed done"
  done
  for cfg in "uniform:--budget uniform" "learnability:--budget learnability" "ucb:--budget ucb"; do
    name=${cfg%%:*}; flags=${cfg#*:}
    # shellcheck disable=SC2086
    "$volley" train --env memory --memory-delay 2 --core gru --gru-hidden 32 --work "${mem_tasks[@]}" $flags \
      --seed "$seed" --max-env-steps 600000 --target-return 1e9 --max-secs 600 --progress lines \
      --run-dir "$out/memory/$name/seed$seed" > /dev/null 2>&1
    echo "memory $name seed $seed done"
  done
done
