#!/usr/bin/env bash
# MuJoCo through the environment service for docs/BENCHMARKS.md (issue 14, item 5): for each
# environment and seed, start a fresh nats-server (JetStream, loopback, temp store) and
# SERVERS `volley-envs serve gymnasium:<ENV>` processes, then train with `volley train --env
# remote:<service>` (embedded learner, actor threads stepping the remote environments) for a
# fixed env-step budget with an unreachable target, and keep each run's directory
# (metrics.jsonl: the learning curve against env steps and wall seconds; summary.json).
#
# Hyper-parameters follow CleanRL's ppo_continuous_action.py where Volley has the knob: PPO,
# 2048 env steps per update (T=64 × B=32), 10 epochs of 32 minibatches, lr 3e-4 decaying
# linearly to 0, γ 0.99, GAE λ 0.95, clip 0.2, no entropy bonus, observation normalisation,
# a 64×64 tanh MLP and a state-independent log-std. Differences: 8 environments per actor
# thread instead of 1, a fixed reward scale (0.1) instead of a running return normaliser, and
# no gradient-norm clip at 0.5.
#
# usage: bench/mujoco.sh OUT_DIR ["ENVS"] [seeds...]
#        (default ENVS "HalfCheetah-v5 Hopper-v5", seeds 1 2 3)
# env:   VOLLEY_BIN (default target/release/volley, built when unset), PYTHON (a python with
#        volley_envs, gymnasium[mujoco] and mujoco installed; default python3), STEPS (default
#        1000000), SERVERS (environment server processes, default 2), ACTORS (actor threads,
#        default 2), EXTRA (more `volley train` flags)
# needs: nats-server >= 2.10 (VOLLEY_NATS_SERVER, PATH or the test kit's; bench/lib.sh)
set -euo pipefail
cd "$(dirname "$0")/.."
. bench/lib.sh
out=${1:?usage: bench/mujoco.sh OUT_DIR [\"ENVS\"] [seeds...]}
envs=${2:-HalfCheetah-v5 Hopper-v5}
shift 2 || shift || true
seeds=${*:-1 2 3}
python=${PYTHON:-python3}
steps=${STEPS:-1000000}
servers=${SERVERS:-2}
actors=${ACTORS:-2}
volley=$(volley_bin)
NATS_SERVER=$(nats_server_bin)
"$python" -c 'import mujoco, volley_envs' || { echo "$python lacks mujoco or volley_envs" >&2; exit 1; }
mkdir -p "$out"

cleanup_on_exit

printf '%-16s %-5s %-9s %-10s %-10s %-12s\n' env seed env_steps wall_s steps_per_s final_return100
for env in $envs; do
  service=$(echo "$env" | tr '[:upper:]' '[:lower:]')
  for seed in $seeds; do
    dir="$out/$service-s$seed"
    rm -rf "$dir"
    mkdir -p "$dir/jetstream"
    port=$(free_port)
    url="nats://127.0.0.1:$port"
    start_nats "$port" "$dir/jetstream" "$dir/nats.log"
    for i in $(seq "$servers"); do
      "$python" -m volley_envs serve "gymnasium:$env" --nats "$url" > "$dir/server-$i.log" 2>&1 &
      started_pids+=("$!")
    done
    for i in $(seq "$servers"); do
      for _ in $(seq 600); do
        grep -q "environment server ready" "$dir/server-$i.log" && break
        sleep 0.1
      done
    done
    # shellcheck disable=SC2086
    "$volley" train --env "remote:$service" --nats "$url" --seed "$seed" \
      --loss ppo --normalize-obs --learning-rate 3e-4 --gamma 0.99 --gae-lambda 0.95 \
      --segment-len 64 --batch-segments 32 --ppo-epochs 10 --ppo-minibatches 32 --ent-coef 0 \
      --reward-scale 0.1 --actors "$actors" --max-env-steps "$steps" --max-secs 7200 --target-return 1e9 \
      --progress quiet --run-dir "$dir/run" ${EXTRA:-} > "$dir/summary.json" 2> "$dir/train.log"
    stop_started
    rm -rf "$dir/jetstream"
    python3 - "$env" "$seed" "$dir/summary.json" <<'EOF'
import json, sys
env, seed, path = sys.argv[1:]
s = json.load(open(path))
print(f"{env:<16} {seed:<5} {s['env_steps']:<9} {s['wall_secs']:<10.1f} {s['env_steps'] / s['wall_secs']:<10.0f} {s['final_mean_return']:<12.1f}")
EOF
  done
done
