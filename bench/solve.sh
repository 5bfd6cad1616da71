#!/usr/bin/env bash
# Time-to-solve benchmark for docs/BENCHMARKS.md: runs `volley train` over several seeds and
# prints, per seed, env steps and seconds until the last-20 and last-100 mean returns first
# reached the solved threshold, plus the whole process's wall time.
# usage: bench/solve.sh "<extra volley train flags>" [seeds...]   (default seeds 1..5)
set -euo pipefail
cd "$(dirname "$0")/.."
flags=${1:-}
shift || true
seeds=${*:-1 2 3 4 5}
. bench/lib.sh
# VOLLEY_BIN: a volley binary to use instead of building ./target/release/volley.
volley=$(volley_bin)
out=$(mktemp -d)
printf '%-5s %-7s %-9s %-9s %-10s %-9s %-10s %-9s %-9s\n' seed solved return100 steps20 secs20 steps100 secs100 env_steps process_s
for seed in $seeds; do
  start=$(date +%s.%N)
  # shellcheck disable=SC2086
  "$volley" train --seed "$seed" --progress quiet --run-dir "$out/$seed" $flags > "$out/$seed.json" 2>/dev/null
  end=$(date +%s.%N)
  python3 - "$out/$seed.json" "$seed" "$(awk -v a="$start" -v b="$end" 'BEGIN { print b - a }')" <<'PY'
import json, sys
s = json.load(open(sys.argv[1]))
f = lambda v, fmt: (fmt % v) if v is not None else "-"
print("%-5s %-7s %-9.2f %-9s %-10s %-9s %-10s %-9d %-9s" % (
    sys.argv[2], s["solved"], s["final_mean_return"], f(s["steps_to_target_20"], "%d"),
    f(s["secs_to_target_20"], "%.3f"), f(s["steps_to_target_100"], "%d"),
    f(s["secs_to_target_100"], "%.3f"), s["env_steps"], "%.2f" % float(sys.argv[3])))
PY
done
rm -rf "$out"
