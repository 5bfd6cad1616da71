#!/usr/bin/env bash
# Atari through the environment service (issue 15, item 5): `volley-envs serve atari:<Game>`
# (ALE v5, sticky actions 0.25, frame skip 4 with max-pooling, 84x84 grayscale, up to 30 no-op
# starts; single u8 frames over NATS, protocol version 3) and `volley train` on it: 4 frames
# stacked on the actor, and the served-image defaults: the Nature-DQN network (pixels scaled by
# 1/255 inside the network), PPO, 3 epochs of 4 minibatches over 1,024-step batches, learning rate
# 3e-4, entropy bonus 0.01; 16 environments on one actor thread and the learner on every core.
# One run per seed, bounded by agent steps (1 agent step = 4 frames); it stops early at a last-100
# mean of +18.
#
#   [VOLLEY_NATS_SERVER=<nats-server>] PYTHON=<python with volley_envs, ale_py, cv2> \
#     bench/atari.sh OUT_DIR GAME STEPS SEED...
#   e.g. bench/atari.sh /tmp/pong Pong 1800000 1
#
# Extra `volley train` flags go in TRAIN_FLAGS. Curves: OUT_DIR/<game>-s<seed>/metrics.jsonl and
# curve.svg (written by volley train).
set -euo pipefail
# shellcheck source=bench/lib.sh
. "$(dirname "$0")/lib.sh"
out=${1:?out dir}; game=${2:?game, e.g. Pong}; steps=${3:?agent steps}; shift 3
python=${PYTHON:-python3}
volley=${VOLLEY:-target/release/volley}
port=${PORT:-14888}
mkdir -p "$out"
service=$(echo "$game" | tr '[:upper:]' '[:lower:]')
cleanup_on_exit
start_nats "$port" "" "$out/nats.log"
"$python" -m volley_envs serve "atari:$game" --nats "nats://127.0.0.1:$port" > "$out/server.log" 2>&1 &
started_pids+=($!)
for _ in $(seq 100); do grep -q "environment server ready" "$out/server.log" && break; sleep 0.2; done
for seed in "$@"; do
  run="$out/$service-s$seed"
  # shellcheck disable=SC2086
  "$volley" train --env "remote:$service" --nats "nats://127.0.0.1:$port" --seed "$seed" \
    --frame-stack 4 --envs-per-actor 16 \
    --max-env-steps "$steps" --target-return 18 \
    --run-dir "$run" --progress quiet ${TRAIN_FLAGS:-} > "$run.summary.json" 2> "$run.log"
  cat "$run.summary.json"
done
