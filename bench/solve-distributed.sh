#!/usr/bin/env bash
# Time-to-solve over NATS for docs/BENCHMARKS.md: for each actor count N and seed, start a fresh
# nats-server (JetStream, file store, loopback), one `volley learner` and N `volley actor`
# processes (8 environments each, or ENVS_PER_ACTOR) on this machine, and record the learner's JSON summary (its
# loop seconds, env steps, whether it reached the solved threshold) and the process wall time
# from starting the learner to its exit. The learner stops by itself when solved (or at its step
# budget); then the actors and the server are stopped. Compare with `bench/solve.sh "" SEEDS`
# (`volley train`, embedded) run in the same session.
#
# usage: bench/solve-distributed.sh ["ACTOR COUNTS"] [seeds...]   (default "1 2 3", seeds 1 2 3)
# env:   VOLLEY_BIN (default: target/release/volley, built here when VOLLEY_BIN is unset),
#        VOLLEY_BINS (several binaries, space-separated: each (actor count, seed) runs with each
#        in turn, so an A/B comparison alternates run by run instead of block by block; the
#        rows and the summary name the binary),
#        LEARNER_FLAGS (extra `volley learner` flags, e.g. "--loss ppo"),
#        ENVS_PER_ACTOR (environments per actor process, default 8: "2 actors of 4" holds the
#        environment count of "1 actor of 8", whose data the learner sees from 8 environments),
#        KEEP_DIR (keep every run's logs and learner JSON there instead of a removed temp dir),
#        PERF=1 (each run under `perf record -a`, every CPU at 4 kHz; after its row, a `cores:` line
#        with who held the two cores inside the learner's loop (its last `wall_secs` before it
#        exits), in µs per env step: the learner process (weights publisher included), the actor
#        processes, nats-server, neither core busy (`idle`), anything else; a sample is 250 µs of
#        one core. Needs perf allowed to sample every CPU: root, or perf_event_paranoid <= 0),
#        NATS_GOMAXPROCS (the broker's Go scheduler threads; default 1, as k8s/base/nats runs it:
#        a CPU limit of 1, which GOMAXPROCS follows. "" leaves it to the Go runtime, which takes
#        every core of this machine),
#        NICE_ARMS (niceness values for the broker and the actors, space-separated, default "0":
#        each (actor count, seed, binary) runs once per value, and a run with a value other than
#        0 is named BINARY+niceV in the rows and the summary; "idle" runs them under SCHED_IDLE
#        (`chrt -i 0`), named BINARY+idle; "B/A" runs the broker at B and the actors at A (either
#        a niceness or idle), named BINARY+natsB-actorsA. The learner keeps its priority, so it takes a core
#        before them, as `deploy/local-run.sh` runs a machine's processes),
#        PIN_CORES=1 (every process on cores of its own, as pods with CPU requests on nodes with
#        room: the learner on LEARNER_CORES cores (default 2: its loop and its weights publisher),
#        the broker on the next one, actor i on the one after it plus i (`taskset`); needs
#        LEARNER_CORES + 1 + the largest actor count cores, and refuses to run on fewer. On a
#        machine whose cores the processes share, a second actor adds no CPU, only its own
#        messages (docs/benchmarks/distributed.md, issue 16 item 1); this measures 2 actors
#        against 1 where each brings its core)
# needs: nats-server >= 2.10 (VOLLEY_NATS_SERVER, PATH or the test kit's; bench/lib.sh)
set -euo pipefail
cd "$(dirname "$0")/.."
. bench/lib.sh
counts=${1:-1 2 3}
shift || true
seeds=${*:-1 2 3}
volley=$(volley_bin)
envs=${ENVS_PER_ACTOR:-8}
bins=${VOLLEY_BINS:-$volley}
# Every (niceness, binary) pair, niceness outermost: binaries alternate within each niceness.
arms_bins=()
for arm in ${NICE_ARMS:-0}; do
  for volley in $bins; do arms_bins+=("$arm $volley"); done
done
NATS_SERVER=$(nats_server_bin)
# Cores of their own (PIN_CORES=1): the learner's list, the broker's core, and the first actor's.
learner_cores=${LEARNER_CORES:-2}
if [ -n "${PIN_CORES:-}" ]; then
  command -v taskset >/dev/null || { echo "PIN_CORES=1 needs taskset (util-linux)" >&2; exit 1; }
  [ "$learner_cores" -ge 1 ] 2>/dev/null || { echo "LEARNER_CORES must be a whole number of cores, 1 or more" >&2; exit 1; }
  most=0
  for n in $counts; do [ "$n" -gt "$most" ] && most=$n; done
  need=$((learner_cores + 1 + most))
  have=$(nproc)
  if [ "$have" -lt "$need" ]; then
    echo "PIN_CORES=1 needs $need cores for the learner ($learner_cores), the broker and $most actors; this machine has $have" >&2
    exit 1
  fi
fi
# The command prefix that pins a process to cores FIRST..LAST (nothing without PIN_CORES).
pin() { if [ -n "${PIN_CORES:-}" ]; then echo "taskset -c $1-$2"; fi; }
if [ -n "${PERF:-}" ]; then command -v perf >/dev/null || { echo "PERF=1 needs perf on PATH" >&2; exit 1; }; fi

out=${KEEP_DIR:-$(mktemp -d -t volley-solve-dist-XXXXXX)}
mkdir -p "$out"
if [ -z "${KEEP_DIR:-}" ]; then temp_dirs+=("$out"); fi
cleanup_on_exit

# The broker's Go scheduler threads: 1 unless NATS_GOMAXPROCS says otherwise; empty: Go's default.
gomaxprocs=${NATS_GOMAXPROCS-1}
# Run "$@" at niceness $1, or under SCHED_IDLE for "idle" (runs only when no other task wants the
# core; lowering one's own policy needs no privilege). Called as `lower ... &`: it execs, so $!
# is the command's pid, which the script stops.
lower() {
  local arm=$1
  shift
  if [ "$arm" = idle ]; then exec chrt -i 0 "$@"; else exec nice -n "$arm" "$@"; fi
}

printf '%-7s %-5s %-7s %-9s %-9s %-11s %-10s %-9s %-6s %-11s %-7s %-7s %-8s %-7s %s\n' \
  actors seed solved return100 env_steps learner_s process_s wait_ratio stale stale_share recv_s update_s publish_s ack_s binary
for n in $counts; do
  for seed in $seeds; do
    for arm_bin in "${arms_bins[@]}"; do
      arm=${arm_bin%% *}
      volley=${arm_bin#* }
      name=$(basename "$volley")
      broker_arm=${arm%/*}
      actor_arm=${arm#*/}
      case $arm in 0) ;; idle) name="$name+idle" ;; */*) name="$name+nats$broker_arm-actors$actor_arm" ;; *) name="$name+nice$arm" ;; esac
      dir="$out/n$n-s$seed-$name"
      mkdir -p "$dir/jetstream" "$dir/checkpoints"
      port=$(free_port)
      url="nats://127.0.0.1:$port"
      # shellcheck disable=SC2046
      lower "$broker_arm" $(pin "$learner_cores" "$learner_cores") env ${gomaxprocs:+"GOMAXPROCS=$gomaxprocs"} "$NATS_SERVER" -js -a 127.0.0.1 -p "$port" -sd "$dir/jetstream" > "$dir/nats.log" 2>&1 &
      nats_pid=$!
      started_pids+=("$nats_pid")
      wait_for_port "$port"
      if [ -n "${PERF:-}" ]; then
        perf record -a -F 4000 -o "$dir/perf.data" > "$dir/perf.log" 2>&1 &
        perf_pid=$!
        sleep 0.3
      fi
      start=$(date +%s.%N)
      # shellcheck disable=SC2086,SC2046
      $(pin 0 $((learner_cores - 1))) "$volley" learner --nats "$url" --run solve --seed "$seed" --checkpoint-dir "$dir/checkpoints" \
        --max-secs 300 ${LEARNER_FLAGS:-} > "$dir/learner.json" 2> "$dir/learner.log" &
      learner_pid=$!
      actor_pids=()
      for i in $(seq 0 $((n - 1))); do
        core=$((learner_cores + 1 + i))
        # shellcheck disable=SC2046
        lower "$actor_arm" $(pin "$core" "$core") "$volley" actor --nats "$url" --run solve --actor-id "actor-$i" --envs "$envs" --seed $((seed * 1000 + i)) \
          > /dev/null 2> "$dir/actor-$i.log" &
        actor_pids+=($!)
      done
      started_pids+=("${actor_pids[@]}")
      wait "$learner_pid" || echo "learner n=$n seed=$seed failed; see $dir/learner.log" >&2
      end=$(date +%s.%N)
      if [ -n "${PERF:-}" ]; then
        kill -INT "$perf_pid"
        wait "$perf_pid" || true
      fi
      # Actors first (they flush), then the server.
      for pid in "${actor_pids[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
      for pid in "${actor_pids[@]}"; do wait "$pid" 2>/dev/null || true; done
      kill -TERM "$nats_pid" 2>/dev/null || true
      wait "$nats_pid" 2>/dev/null || true
      started_pids=()
      python3 - "$dir/learner.json" "$n" "$seed" "$(awk -v a="$start" -v b="$end" 'BEGIN { print b - a }')" "$out/rows" "$name" <<'PY'
import json, sys
path, n, seed, process_s, rows, binary = sys.argv[1:7]
try:
    s = json.load(open(path))
except (OSError, ValueError):
    print("%-7s %-5s failed %s" % (n, seed, binary))
    sys.exit(0)
share = s["segments_stale"] / max(1, s["segments_stale"] + s["segments_used"])
print("%-7s %-5s %-7s %-9.2f %-9d %-11.3f %-10.2f %-9.2f %-6d %-11.3f %-7.3f %-7.3f %-8.3f %-7.3f %s" % (
    n, seed, s["solved"], s["final_mean_return"], s["env_steps"], s["wall_secs"], float(process_s),
    s["learner_wait_ratio"], s["segments_stale"], share, s.get("learner_recv_secs", 0), s.get("learner_update_secs", 0),
    s.get("learner_publish_secs", 0), s.get("learner_ack_secs", 0), binary))
with open(rows, "a") as f:
    f.write(json.dumps({"n": int(n), "seed": int(seed), "solved": s["solved"], "env_steps": s["env_steps"], "binary": binary,
                        "learner_s": s["wall_secs"], "process_s": float(process_s), "stale_share": share}) + "\n")
PY
      if [ -n "${PERF:-}" ]; then
        python3 - "$dir" "$learner_pid" "${actor_pids[@]}" <<'PY'
import collections, json, subprocess, sys
d, learner, actors = sys.argv[1], sys.argv[2], set(sys.argv[3:])
try:
    summary = json.load(open(f"{d}/learner.json"))
    lines = subprocess.run(["perf", "script", "-i", f"{d}/perf.data", "-F", "comm,pid,time"],
                           capture_output=True, text=True, check=True).stdout.splitlines()
except (OSError, ValueError, subprocess.CalledProcessError) as err:
    print(f"        cores: unknown ({err}); see {d}/perf.log")
    sys.exit(0)
samples = [(f[0], f[1], float(f[2].rstrip(":"))) for f in (line.split() for line in lines) if len(f) >= 3]
end = max((t for _, pid, t in samples if pid == learner), default=0.0)
start = end - summary["wall_secs"]
who = collections.Counter(
    "idle" if comm == "swapper" else "learner" if pid == learner else "actors" if pid in actors
    else "nats" if comm == "nats-server" else "other"
    for comm, pid, t in samples if start <= t <= end)
per_step = {k: who[k] * 250.0 / max(1, summary["env_steps"]) for k in ("learner", "actors", "nats", "idle", "other")}
busy = sum(v for k, v in per_step.items() if k != "idle")
print("        cores (µs per env step): " + " ".join(f"{k} {v:.2f}" for k, v in per_step.items()) + f" busy {busy:.2f}")
PY
      fi
    done
  done
done
python3 - "$out/rows" <<'PY'
import json, statistics, sys
rows = [json.loads(line) for line in open(sys.argv[1])] if __import__("os").path.exists(sys.argv[1]) else []
print()
print("%-7s %-7s %-16s %-16s %-16s %-18s %s" % ("actors", "solved", "median_steps", "median_learner_s", "median_process_s", "median_stale_share", "binary"))
for n, binary in sorted({(r["n"], r["binary"]) for r in rows}):
    rs = [r for r in rows if r["n"] == n and r["binary"] == binary]
    print("%-7d %-7s %-16d %-16.3f %-16.2f %-18.3f %s" % (
        n, "%d/%d" % (sum(r["solved"] for r in rs), len(rs)), statistics.median(r["env_steps"] for r in rs),
        statistics.median(r["learner_s"] for r in rs), statistics.median(r["process_s"] for r in rs),
        statistics.median(r["stale_share"] for r in rs), binary))
PY
