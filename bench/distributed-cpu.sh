#!/usr/bin/env bash
# CPU accounting of distributed CartPole for docs/BENCHMARKS.md (issue 16): for each pass, seed
# and binary (interleaved), start a fresh nats-server (JetStream, file store, loopback), one
# `volley learner --seed S` and one `volley actor --envs 8`, and print the learner's loop
# seconds and env steps with the CPU seconds (user + system, from /proc) of the learner, the
# actor and the server, then the medians per binary, of whole runs and per env step.
#
# usage: bench/distributed-cpu.sh "BIN..." [seeds...]   (default seeds 1 2 3)
# env:   PASSES (default 2), LEARNER_FLAGS (extra `volley learner` flags), NATS_GOMAXPROCS (the
#        broker's Go scheduler threads; default 1 as in bench/solve-distributed.sh, "" for Go's default)
# needs: nats-server >= 2.10 (VOLLEY_NATS_SERVER, PATH or the test kit's; bench/lib.sh)
set -euo pipefail
cd "$(dirname "$0")/.."
. bench/lib.sh
bins=${1:?"usage: bench/distributed-cpu.sh \"BIN...\" [seeds...]"}
shift
seeds=${*:-1 2 3}
NATS_SERVER=$(nats_server_bin)
out=$(mktemp -d -t volley-dist-cpu-XXXXXX)
trap 'rm -rf "$out"' EXIT
# The broker's Go scheduler threads: 1 unless NATS_GOMAXPROCS says otherwise; empty: Go's default.
gomaxprocs=${NATS_GOMAXPROCS-1}
cpu() { awk '{printf "%.2f", ($14 + $15) / 100}' "/proc/$1/stat"; }
for pass in $(seq "${PASSES:-2}"); do
  for seed in $seeds; do
    for bin in $bins; do
      dir="$out/$pass-$seed-$(basename "$bin")"
      mkdir -p "$dir"
      port=$(free_port)
      env ${gomaxprocs:+"GOMAXPROCS=$gomaxprocs"} "$NATS_SERVER" -js -a 127.0.0.1 -p "$port" -sd "$dir/js" > "$dir/nats.log" 2>&1 &
      ns=$!
      wait_for_port "$port"
      ns0=$(cpu "$ns")
      # shellcheck disable=SC2086
      /usr/bin/time -o "$dir/time" -f "%U %S" "$bin" learner --nats "nats://127.0.0.1:$port" --run cpu --seed "$seed" \
        --checkpoint-dir "$dir/ck" --max-secs 300 ${LEARNER_FLAGS:-} > "$dir/learner.json" 2> "$dir/learner.log" &
      lp=$!
      "$bin" actor --nats "nats://127.0.0.1:$port" --run cpu --actor-id actor-0 --envs 8 --seed $((seed * 1000)) \
        > /dev/null 2> "$dir/actor.log" &
      ap=$!
      wait "$lp" || echo "learner failed: $dir/learner.log" >&2
      actor_cpu=$(cpu "$ap"); ns_cpu=$(awk -v a="$(cpu "$ns")" -v b="$ns0" 'BEGIN { printf "%.2f", a - b }')
      kill -TERM "$ap"; wait "$ap" 2>/dev/null || true
      kill -TERM "$ns"; wait "$ns" 2>/dev/null || true
      python3 - "$dir" "$bin" "$seed" "$actor_cpu" "$ns_cpu" >> "$out/rows" <<'PY'
import json, sys
d, bin_, seed, actor, ns = sys.argv[1:6]
s = json.load(open(d + "/learner.json"))
user, system = map(float, open(d + "/time").read().split()[-2:])
print(bin_, seed, "%.3f" % s["wall_secs"], s["env_steps"], s["solved"], "%.2f" % (user + system), actor, ns)
PY
      tail -1 "$out/rows"
    done
  done
done
python3 - "$out/rows" <<'PY'
import collections, statistics, sys
rows = collections.defaultdict(list)
for line in open(sys.argv[1]):
    f = line.split()
    rows[f[0]].append((float(f[2]), int(f[3]), float(f[5]) + float(f[6]) + float(f[7])))
# Per env step as well: the steps a seed needs to solve vary by 1.5x between runs (policy lag),
# so a change to the cost of a step shows in the per-step medians long before the loop's.
print("%-40s %-6s %-14s %-12s %-13s %-15s %s" % ("binary", "runs", "median_loop_s", "median_steps", "median_cpu_s",
                                                 "loop_us/step", "cpu_us/step"))
for b, r in rows.items():
    med = statistics.median
    print("%-40s %-6d %-14.3f %-12d %-13.2f %-15.2f %.2f" % (
        b, len(r), med(x[0] for x in r), med(x[1] for x in r), med(x[2] for x in r),
        med(x[0] / x[1] * 1e6 for x in r), med(x[2] / x[1] * 1e6 for x in r)))
PY
