#!/usr/bin/env bash
# Broker-restart recovery for docs/BENCHMARKS.md (issue 11 item 5): nats-server (file store), one
# learner and 2 actors on CartPole; after WARM_SECS the server is killed with SIGKILL and restarted
# on the same store and port DOWN_SECS later. Prints, from the learner's log, when it reconnected
# and when its first update after the restart happened (the first "learner progress" line after
# the reconnect: the line is written at the first update once 2 s have passed since the last one,
# and no update happened during the outage), whether any ack gave up, and the env steps per second
# in the 10 s before the kill and the 10 s after the reconnect.
#
# usage: bench/broker-restart.sh [OUT_DIR]
# env:   VOLLEY_BIN (default target/release/volley), WARM_SECS (15), DOWN_SECS (5), AFTER_SECS (40)
set -euo pipefail
cd "$(dirname "$0")/.."
. bench/lib.sh
out=${1:-$(mktemp -d -t volley-restart-XXXXXX)}
mkdir -p "$out/jetstream" "$out/checkpoints"
volley=${VOLLEY_BIN:-target/release/volley}
port=$(free_port)
url="nats://127.0.0.1:$port"
cleanup_on_exit
start_nats "$port" "$out/jetstream" "$out/nats.log"
RUST_LOG=info "$volley" learner --nats "$url" --run restart --checkpoint-dir "$out/checkpoints" --target-return 1e9 \
  --max-env-steps 1000000000 > "$out/learner.json" 2> "$out/learner.log" &
started_pids+=($!)
for i in 0 1; do
  RUST_LOG=info "$volley" actor --nats "$url" --run restart --actor-id "actor-$i" --envs 8 > /dev/null 2> "$out/actor-$i.log" &
  started_pids+=($!)
done
sleep "${WARM_SECS:-15}"
kill -KILL "$NATS_PID"
wait "$NATS_PID" 2>/dev/null || true
killed_at=$(date -u +%H:%M:%S.%N)
sleep "${DOWN_SECS:-5}"
start_nats "$port" "$out/jetstream" "$out/nats.log"
sleep "${AFTER_SECS:-40}"
python3 - "$out/learner.log" "$killed_at" <<'PY'
import re, sys
from datetime import datetime
def ts(line):
    m = re.search(r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d+)Z", re.sub(r"\x1b\[[0-9;]*m", "", line))
    return datetime.fromisoformat(m.group(1)[:26]) if m else None
lines = open(sys.argv[1], errors="replace").read().splitlines()
connected = [i for i, l in enumerate(lines) if "nats connected" in l]
if len(connected) < 2:
    print("the learner did not reconnect"); sys.exit(1)
i = connected[1]
t_reconnect = ts(lines[i])
last_before = max(ts(l) for l in lines[:i] if "learner progress" in l)
first_after = next((ts(l) for l in lines[i:] if "learner progress" in l), None)
gave_up = sum("giving up" in l for l in lines[i:])
abandoned = sum("settled without confirmation" in l for l in lines[i:])
print("server killed at (UTC)        ", sys.argv[2])
print("last update logged before kill", last_before.time())
print("learner reconnected           ", t_reconnect.time())
print("first update after reconnect  ", first_after.time() if first_after else "none")
if first_after:
    print("seconds from reconnect to first update: %.1f" % (first_after - t_reconnect).total_seconds())
print("acks that gave up after the reconnect:", gave_up, "; abandon events:", abandoned)
# Throughput, not only the first update: env steps per second in the 10 s before the kill and in
# the 10 s after the reconnect (progress lines, every 2 s). Actors that waited out lost publish
# acks one deadline after another once stalled for 5-20 s after an otherwise quick reconnect.
progress = [(ts(l), int(re.search(r"env_steps=(\d+)", l).group(1))) for l in lines if "learner progress" in l]
def steps_at(t):
    before = [s for (u, s) in progress if u <= t]
    return before[-1] if before else 0
killed = datetime.combine(t_reconnect.date(), datetime.strptime(sys.argv[2][:15], "%H:%M:%S.%f").time())
from datetime import timedelta
window = timedelta(seconds=10)
rate_before = (steps_at(killed) - steps_at(killed - window)) / 10
rate_after = (steps_at(t_reconnect + window) - steps_at(t_reconnect)) / 10
print("env steps/s, 10 s before the kill: %.0f; 10 s after the reconnect: %.0f (%.0f %%)" % (
    rate_before, rate_after, 100 * rate_after / rate_before if rate_before else 0))
PY
