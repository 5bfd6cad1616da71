#!/usr/bin/env bash
# The Pendulum-v1 sweep behind `volley train --env pendulum`'s defaults (issue 45, item 4):
# each arm is the bare command plus one or two flags, 5 seeds, the default 300 K-step budget
# (the learning rate decays over it), stopping at a last-100 mean of -250; the table gives the
# median env steps to a last-20 mean of -250. Results: docs/benchmarks/solve.md.
# usage: bench/pendulum-sweep.sh OUT [seeds]   (default seeds 1..5)
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: bench/pendulum-sweep.sh OUT [seeds]}
seeds=${2:-1..5}
. bench/lib.sh
volley=$(volley_bin)
# Round 1: one knob at a time around the old defaults (T=64, B=32, lr 1e-3, 8 minibatches).
bench/sweep.py --envs pendulum --seeds "$seeds" --frames 300000 --out "$out/round1" --volley "$volley" \
  --arm "old=--segment-len 64 --batch-segments 32 --learning-rate 1e-3" \
  --arm "B16=--segment-len 64 --batch-segments 16 --learning-rate 1e-3" \
  --arm "B16mb4=--segment-len 64 --batch-segments 16 --learning-rate 1e-3 --ppo-minibatches 4" \
  --arm "T32=--segment-len 32 --batch-segments 32 --learning-rate 1e-3" \
  --arm "lr2e-3=--segment-len 64 --batch-segments 32 --learning-rate 2e-3" \
  --arm "lr3e-3=--segment-len 64 --batch-segments 32 --learning-rate 3e-3" \
  --arm "ep20=--segment-len 64 --batch-segments 32 --learning-rate 1e-3 --ppo-epochs 20" \
  --arm "gae0.9=--segment-len 64 --batch-segments 32 --learning-rate 1e-3 --gae-lambda 0.9" \
  --arm "gae0.98=--segment-len 64 --batch-segments 32 --learning-rate 1e-3 --gae-lambda 0.98" \
  --arm "w128=--segment-len 64 --batch-segments 32 --learning-rate 1e-3 --torso 128,128" \
  --arm "nobs=--segment-len 64 --batch-segments 32 --learning-rate 1e-3 --normalize-obs" \
  --arm "squash=--segment-len 64 --batch-segments 32 --learning-rate 1e-3 --squash-actions" \
  --arm "mb16=--segment-len 64 --batch-segments 32 --learning-rate 1e-3 --ppo-minibatches 16" \
  --arm "mb4=--segment-len 64 --batch-segments 32 --learning-rate 1e-3 --ppo-minibatches 4"
# Round 2: smaller updates (the lever of round 1) combined with the learning rate.
bench/sweep.py --envs pendulum --seeds "$seeds" --frames 300000 --out "$out/round2" --volley "$volley" \
  --arm "old=--segment-len 64 --batch-segments 32 --learning-rate 1e-3" \
  --arm "T32=--segment-len 32 --batch-segments 32 --learning-rate 1e-3" \
  --arm "T32B16=--segment-len 32 --batch-segments 16 --learning-rate 1e-3" \
  --arm "T32B16mb4=--segment-len 32 --batch-segments 16 --learning-rate 1e-3 --ppo-minibatches 4" \
  --arm "T16=--segment-len 16 --batch-segments 32 --learning-rate 1e-3" \
  --arm "T32lr2e-3=--segment-len 32 --batch-segments 32 --learning-rate 2e-3" \
  --arm "T32lr1.5e-3=--segment-len 32 --batch-segments 32 --learning-rate 1.5e-3" \
  --arm "T32mb4=--segment-len 32 --batch-segments 32 --learning-rate 1e-3 --ppo-minibatches 4" \
  --arm "T32B16lr2e-3=--segment-len 32 --batch-segments 16 --learning-rate 2e-3"
# The new defaults, bare.
bench/sweep.py --envs pendulum --seeds "$seeds" --frames 300000 --out "$out/defaults" --volley "$volley" --arm "defaults="
