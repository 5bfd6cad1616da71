# shellcheck shell=bash
# Shared helpers of the bench scripts: the volley binary, a free port, a nats-server started on
# loopback with its store, and the processes and stores stopped and removed at exit.
# Source it from the repository root: `. bench/lib.sh` (after `cd "$(dirname "$0")/.."`).

# A free TCP port on 127.0.0.1 (the kernel's pick; free when asked, so start the server soon).
free_port() {
  python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

# Wait until something accepts connections on 127.0.0.1:PORT, polling every 0.05 s up to TRIES
# times (default 100, 5 s). Returns either way, as the scripts' own loops did; a port that never
# opened is said on stderr, and the first client to connect then reports the error.
wait_for_port() {
  local port=$1 tries=${2:-100}
  for _ in $(seq "$tries"); do
    (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null && return 0
    sleep 0.05
  done
  echo "nothing listens on 127.0.0.1:$port after $tries tries" >&2
}

# The volley binary to run: VOLLEY_BIN, or the release build, built here when VOLLEY_BIN is
# unset (in CARGO_TARGET_DIR when that is set, as cargo builds it there).
volley_bin() {
  if [ -z "${VOLLEY_BIN:-}" ]; then
    cargo build --release -p volley >/dev/null 2>&1
  fi
  echo "${VOLLEY_BIN:-${CARGO_TARGET_DIR:-target}/release/volley}"
}

# The nats-server to run, found as the test kit finds it: VOLLEY_NATS_SERVER, else nats-server
# on PATH, else the test kit's pinned one (installed on first use by volley-nats-server).
nats_server_bin() {
  if [ -n "${VOLLEY_NATS_SERVER:-}" ]; then
    echo "$VOLLEY_NATS_SERVER"
  elif command -v nats-server >/dev/null; then
    command -v nats-server
  else
    cargo run -q -p volley-testkit --bin volley-nats-server
  fi
}

# Processes the script started in the background, stopped by stop_started, and temporary
# directories, removed by remove_temp_dirs; cleanup_on_exit does both when the script exits.
started_pids=()
temp_dirs=()

# SIGTERM to every started process, then wait for each; the list is empty afterwards.
stop_started() {
  local pid
  for pid in "${started_pids[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  for pid in "${started_pids[@]}"; do wait "$pid" 2>/dev/null || true; done
  started_pids=()
}

remove_temp_dirs() {
  if [ "${#temp_dirs[@]}" -gt 0 ]; then rm -rf "${temp_dirs[@]}"; fi
  temp_dirs=()
}

# Stop the started processes and remove the temporary directories when the script exits; an
# interrupt exits with 130 through the same path.
cleanup_on_exit() {
  trap 'stop_started; remove_temp_dirs' EXIT
  trap 'exit 130' INT TERM
}

# TLS for the bench brokers (issue 46), as deployments run them: on the first start_nats, a
# development CA and a certificate for 127.0.0.1 (`volley tls-certs`, into a temporary
# directory) and VOLLEY_NATS_TLS_CA exported, so every volley and volley_envs process started
# afterwards trusts it. BENCH_NATS_TLS=0 runs the brokers in plain text instead (to measure
# what TLS costs).
nats_tls_args() {
  NATS_TLS_ARGS=()
  [ "${BENCH_NATS_TLS:-1}" = 0 ] && return 0
  if [ -z "${NATS_TLS_DIR:-}" ]; then
    NATS_TLS_DIR=$(mktemp -d -t volley-nats-tls-XXXXXX)
    temp_dirs+=("$NATS_TLS_DIR")
    "$(volley_bin)" tls-certs --tls-dir "$NATS_TLS_DIR" --tls-server-names 127.0.0.1,localhost 2> /dev/null
    export VOLLEY_NATS_TLS_CA="$NATS_TLS_DIR/ca.crt"
  fi
  NATS_TLS_ARGS=(--tls --tlscert "$NATS_TLS_DIR/server.crt" --tlskey "$NATS_TLS_DIR/server.key")
}

# start_nats PORT STORE LOG [nats-server args...]: a nats-server with JetStream on 127.0.0.1:PORT,
# TLS required (nats_tls_args), its store in STORE (a fresh temporary directory, removed at
# exit, when STORE is ""), its output appended to LOG; started in the background, its pid in
# NATS_PID and among the started processes, and waited for until its port is open. The binary
# is NATS_SERVER, found by nats_server_bin on first use.
start_nats() {
  local port=$1 store=$2 log=$3
  shift 3
  if [ -z "$store" ]; then
    store=$(mktemp -d -t volley-nats-XXXXXX)
    temp_dirs+=("$store")
  fi
  NATS_SERVER=${NATS_SERVER:-$(nats_server_bin)}
  nats_tls_args
  "$NATS_SERVER" -js -a 127.0.0.1 -p "$port" -sd "$store" "${NATS_TLS_ARGS[@]}" "$@" >> "$log" 2>&1 &
  NATS_PID=$!
  started_pids+=("$NATS_PID")
  wait_for_port "$port"
}
