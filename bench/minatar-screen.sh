#!/usr/bin/env bash
# The MinAtar screen behind the family's defaults (issue 45, item 2): candidate learning rates
# and entropy bonuses on the weak games, 2M frames, the same seeds and budget for every arm
# (bench/sweep.py), then a collapse screen on Breakout (0.6M frames, 6 seeds, the learning rate
# decaying as it does over a 5M-frame run, since the collapses seen came at 0.24-0.4M).
# Results: docs/benchmarks/minatar.md, "Screening the defaults".
# usage: bench/minatar-screen.sh OUT
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: bench/minatar-screen.sh OUT}
. bench/lib.sh
volley=$(volley_bin)
# Every arm names its learning rate and bonus, so the screen means the same after a change of defaults.
bench/sweep.py --envs breakout,asterix,seaquest,space-invaders --seeds 1,4 --frames 2000000 --out "$out/screen" \
  --jobs 2 --volley "$volley" \
  --arm "lr2e-3-ent1e-2=--learning-rate 2e-3 --ent-coef 0.01" \
  --arm "lr6e-4-ent1e-2=--learning-rate 6e-4 --ent-coef 0.01" \
  --arm "lr1e-3-ent1e-2=--learning-rate 1e-3 --ent-coef 0.01" \
  --arm "lr2e-3-ent3e-3=--learning-rate 2e-3 --ent-coef 0.003" \
  --arm "lr1e-3-ent3e-3=--learning-rate 1e-3 --ent-coef 0.003" \
  --arm "lr1.5e-3-ent5e-3=--learning-rate 1.5e-3 --ent-coef 0.005"
# --final-learning-rate: the rate a 5M-frame run has at 0.6M frames (0.88 of the start).
bench/sweep.py --envs breakout --seeds 4,11,1,2,3,5 --frames 600000 --out "$out/collapse" --jobs 2 --volley "$volley" \
  --arm "lr2e-3-ent3e-3=--learning-rate 2e-3 --ent-coef 0.003 --final-learning-rate 1.76e-3" \
  --arm "lr2e-3-ent5e-3=--learning-rate 2e-3 --ent-coef 0.005 --final-learning-rate 1.76e-3" \
  --arm "lr1e-3-ent3e-3=--learning-rate 1e-3 --ent-coef 0.003 --final-learning-rate 8.8e-4" \
  --arm "lr1.5e-3-ent5e-3=--learning-rate 1.5e-3 --ent-coef 0.005 --final-learning-rate 1.32e-3"
