#!/usr/bin/env bash
# Long-run stability benchmark for docs/STABILITY.md (issue 11): train with an unreachable target
# for a fixed env-step budget and record, per seed, the minimum over time of the last-100 mean
# return after it first reached the solved threshold, and the entropy and gradient-norm ranges
# over the same stretch (bench/long_run_summary.py). Not a test: it takes minutes per seed.
#
# usage: bench/long-run.sh [OUT_DIR]
# env:   VOLLEY_BIN     volley binary (default: target/release/volley, built here when unset)
#        SEEDS          embedded seeds (default "1 2 3 4 5"; "" skips them)
#        CARTPOLE_STEPS CartPole budget (default 20000000; 0 skips it)
#        MEMORY_STEPS   memory task (GRU) budget (default 3000000; 0 skips it)
#        MILESTONES_STEPS milestones budget (default 3000000; 0 skips it)
#        DIST_SEEDS     seeds of the distributed CartPole run, 1 learner + 2 actor processes
#                       over a local nats-server (default "": skipped; e.g. "1 2")
#        DIST_STEPS     distributed budget (default 20000000)
#        FLAGS          extra flags for every run (e.g. "--adam-eps 1e-8" for the old default)
# needs: python3; for DIST_SEEDS, nats-server >= 2.10 (VOLLEY_NATS_SERVER, PATH or the test kit's; bench/lib.sh)
set -euo pipefail
cd "$(dirname "$0")/.."
. bench/lib.sh
out=${1:-$(mktemp -d -t volley-long-run-XXXXXX)}
mkdir -p "$out"
volley=$(volley_bin)
seeds=${SEEDS-1 2 3 4 5}
flags=${FLAGS:-}

train() { # name steps flags...
  local name=$1 steps=$2
  shift 2
  # shellcheck disable=SC2086
  nice "$volley" train --progress quiet --target-return 1e9 --max-env-steps "$steps" --max-secs 1e6 \
    --run-dir "$out/$name" "$@" $flags > "$out/$name.json" 2> "$out/$name.log" \
    || echo "$name failed; see $out/$name.log" >&2
}

if [ "${CARTPOLE_STEPS:-20000000}" != 0 ]; then
  for seed in $seeds; do
    train "cartpole-s$seed" "${CARTPOLE_STEPS:-20000000}" --seed "$seed"
  done
fi
if [ "${MEMORY_STEPS:-3000000}" != 0 ]; then
  for seed in $seeds; do
    train "memory-s$seed" "${MEMORY_STEPS:-3000000}" --seed "$seed" --env memory --core gru
  done
fi
if [ "${MILESTONES_STEPS:-3000000}" != 0 ]; then
  for seed in $seeds; do
    train "milestones-s$seed" "${MILESTONES_STEPS:-3000000}" --seed "$seed" --env milestones
  done
fi

if [ -n "${DIST_SEEDS:-}" ]; then
  NATS_SERVER=$(nats_server_bin)
  for seed in $DIST_SEEDS; do
    dir="$out/dist-cartpole-s$seed"
    mkdir -p "$dir/jetstream" "$dir/checkpoints"
    port=$(free_port)
    start_nats "$port" "$dir/jetstream" "$dir/nats.log"
    nats_pid=$NATS_PID
    url="nats://127.0.0.1:$port"
    # shellcheck disable=SC2086
    nice "$volley" learner --nats "$url" --run long --seed "$seed" --checkpoint-dir "$dir/checkpoints" \
      --target-return 1e9 --max-env-steps "${DIST_STEPS:-20000000}" $flags \
      > "$dir.json" 2> "$dir/learner.log" &
    learner_pid=$!
    actor_pids=()
    for i in 0 1; do
      nice "$volley" actor --nats "$url" --run long --actor-id "actor-$i" --envs 8 --seed $((seed * 1000 + i)) \
        > /dev/null 2> "$dir/actor-$i.log" &
      actor_pids+=($!)
    done
    wait "$learner_pid" || echo "distributed seed $seed failed; see $dir/learner.log" >&2
    for pid in "${actor_pids[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
    for pid in "${actor_pids[@]}"; do wait "$pid" 2>/dev/null || true; done
    kill -TERM "$nats_pid" 2>/dev/null || true
    wait "$nats_pid" 2>/dev/null || true
  done
fi

python3 bench/long_run_summary.py "$out"
echo "runs in $out" >&2
