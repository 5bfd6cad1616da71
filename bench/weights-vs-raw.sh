#!/usr/bin/env bash
# Usage: NATS_SERVER=<path to nats-server> [SIZES="0.0176 1 16"] [PATTERNS="volley volley-durable raw-object raw-core"]
#        [VERSIONS=20] [PASSES=2] [VOLLEY_BIN=<volley binary, built when unset>] bench/weights-vs-raw.sh
#        (NATS_SERVER defaults to VOLLEY_NATS_SERVER, nats-server on PATH or the test kit's)
# Issue 16 item 2: Volley's weight broadcast vs the raw NATS patterns, same sitting, interleaved.
cd "$(dirname "$0")/.." || exit
. bench/lib.sh
NS=${NATS_SERVER:-$(nats_server_bin)}
volley=$(volley_bin)
wb="${TMPDIR:-/tmp}/volley-wb"
rm -rf "$wb" && mkdir -p "$wb"
"$NS" -a 127.0.0.1 -p 14555 -js -sd "$wb/js" > "$wb/ns.log" 2>&1 &
ns=$!
wait_for_port 14555
uptime
for rep in $(seq "${PASSES:-2}"); do
  for size in ${SIZES:-0.0176 1 16}; do
    # volley: the default (live fan-out, then object store and pointer); volley-durable: the
    # object store and pointer alone (--nats-weights-live false), the path before issue 16's live path.
    for pattern in ${PATTERNS:-volley volley-durable raw-object raw-core}; do
      extra=""
      [ "$pattern" != raw-object ] && [ "$pattern" != raw-core ] && [ "$size" != 0.0176 ] && extra="--inline-max-kib 0"
      [ "$pattern" = volley-durable ] && extra="$extra --nats-weights-live false"
      # Volley's followers wait for each version, as the raw followers wait on their subscription
      # (the default, polling every 1 ms like an actor between rounds, adds up to 1 ms and 8
      # processes waking 1,000 times a second on the same two cores).
      [ "$pattern" != raw-object ] && [ "$pattern" != raw-core ] && extra="$extra --poll-ms 0"
      # shellcheck disable=SC2086  # $extra is a list of flags
      out=$("$volley" bench-weights --nats nats://127.0.0.1:14555 --run "wb-${pattern#volley-}" --pattern "${pattern%-durable}" \
        --size-mib "$size" --versions "${VERSIONS:-20}" $extra 2>/dev/null)
      echo "$rep $size $pattern $(echo "$out" | python3 -c 'import json,sys; s=json.load(sys.stdin); print(s["frame_bytes_median"], round(s["publish_ms"]["p50"],1), round(s["last_follower_ms"]["p50"],1), round(s["last_follower_ms"]["p99"],1))')"
    done
  done
done
uptime
kill $ns
