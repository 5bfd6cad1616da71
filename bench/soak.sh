#!/usr/bin/env bash
# Bounded-resource soak for docs/BENCHMARKS.md (issue 11 item 6): a fresh nats-server (JetStream,
# file store, loopback), one `volley learner` and 3 `volley actor` processes on CartPole with an
# unreachable target, for SOAK_SECS; every 15 s it samples the RSS of each process and the
# JetStream store (bytes on disk, and messages and bytes per stream from the monitoring port),
# one CSV row per sample. Every figure should be flat after warm-up.
#
# usage: bench/soak.sh [OUT_DIR]
# env:   VOLLEY_BIN (default target/release/volley, built here when unset), SOAK_SECS (600),
#        SAMPLE_SECS (15), LEARNER_FLAGS (extra `volley learner` flags)
# needs: nats-server >= 2.10 (VOLLEY_NATS_SERVER, PATH or the test kit's; bench/lib.sh), python3
set -euo pipefail
cd "$(dirname "$0")/.."
. bench/lib.sh
out=${1:-$(mktemp -d -t volley-soak-XXXXXX)}
mkdir -p "$out/jetstream" "$out/checkpoints"
volley=$(volley_bin)
soak_secs=${SOAK_SECS:-600}
sample_secs=${SAMPLE_SECS:-15}
port=$(free_port)
monitor=$(free_port)
cleanup_on_exit
start_nats "$port" "$out/jetstream" "$out/nats.log" -m "$monitor"
nats_pid=$NATS_PID
url="nats://127.0.0.1:$port"
# shellcheck disable=SC2086
"$volley" learner --nats "$url" --run soak --checkpoint-dir "$out/checkpoints" --target-return 1e9 \
  --max-env-steps 100000000000 --max-secs "$soak_secs" ${LEARNER_FLAGS:-} > "$out/learner.json" 2> "$out/learner.log" &
learner_pid=$!
started_pids+=("$learner_pid")
actor_pids=()
for i in 0 1 2; do
  "$volley" actor --nats "$url" --run soak --actor-id "actor-$i" --envs 8 > /dev/null 2> "$out/actor-$i.log" &
  actor_pids+=($!)
done
started_pids+=("${actor_pids[@]}")
rss() { awk '/VmRSS/ {print $2}' "/proc/$1/status" 2>/dev/null || echo 0; }
echo "secs,learner_rss_kib,actor0_rss_kib,actor1_rss_kib,actor2_rss_kib,nats_rss_kib,store_disk_kib,store_msgs,store_bytes,weights_msgs,weights_bytes,traj_msgs,traj_bytes" > "$out/samples.csv"
start=$(date +%s)
while kill -0 "$learner_pid" 2>/dev/null; do
  now=$(( $(date +%s) - start ))
  disk=$(du -sk "$out/jetstream" | cut -f1)
  streams=$(python3 - "$monitor" <<'PY'
import json, sys, urllib.request
try:
    jsz = json.load(urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/jsz?streams=true", timeout=2))
except OSError:
    print("0,0,0,0,0,0"); sys.exit()
total = (jsz.get("messages", 0), jsz.get("bytes", 0))
per = {"wts": (0, 0), "traj": (0, 0)}
for account in jsz.get("account_details", []):
    for stream in account.get("stream_detail", []):
        state = stream.get("state", {})
        for key in per:
            if stream["name"].endswith(key) or stream["name"].endswith(key + "s"):
                per[key] = (state.get("messages", 0), state.get("bytes", 0))
print("%d,%d,%d,%d,%d,%d" % (*total, *per["wts"], *per["traj"]))
PY
)
  echo "$now,$(rss "$learner_pid"),$(rss "${actor_pids[0]}"),$(rss "${actor_pids[1]}"),$(rss "${actor_pids[2]}"),$(rss "$nats_pid"),$disk,$streams" >> "$out/samples.csv"
  sleep "$sample_secs"
done
cat "$out/samples.csv"
echo "soak files in $out" >&2
