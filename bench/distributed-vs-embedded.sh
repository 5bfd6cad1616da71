#!/usr/bin/env bash
# Issue 16, item 1, in one command: distributed CartPole against embedded, measured in the same
# sitting. Each pass runs `bench/solve.sh "" SEEDS` (`volley train`, embedded) and then
# `bench/solve-distributed.sh "COUNTS" SEEDS` (one learner and N actor processes over a fresh
# local nats-server), so both arms see the same machine state; a pass's ratio is the median of
# its distributed learner-loop seconds over the median of its embedded `secs100` (seconds to a
# last-100 mean of 475). Prints every run, then per binary and actor count: the median ratio over
# passes and its range, µs of learner loop per env step, env steps, and in how many passes
# 2 actors were slower than 1. The target: 1 actor ≤ 2× embedded, 2 actors no slower than 1.
# With several binaries (VOLLEY_BINS) or niceness arms (NICE_ARMS), it also prints each against
# the first run by run (same pass, actor count and seed): paired ratios of loop seconds, of loop
# seconds per env step and of env steps.
#
# usage: bench/distributed-vs-embedded.sh [passes] ["ACTOR COUNTS"] [seeds...]   (default 5, "1 2", 1 2 3)
# env:   VOLLEY_BIN / VOLLEY_BINS, LEARNER_FLAGS, ENVS_PER_ACTOR, NATS_GOMAXPROCS: passed on to
#        solve-distributed.sh (VOLLEY_BINS alternates binaries run by run; the embedded arm uses
#        VOLLEY_BIN, or the first of VOLLEY_BINS); KEEP_DIR: keep each pass's distributed runs
#        under KEEP_DIR/pN (an empty or new directory)
# needs: nats-server >= 2.10 (VOLLEY_NATS_SERVER, PATH or the test kit's; bench/lib.sh), python3
set -euo pipefail
cd "$(dirname "$0")/.."
. bench/lib.sh
passes=${1:-5}
counts=${2:-1 2}
shift 2 || shift $# || true
seeds=${*:-1 2 3}
if [ -z "${VOLLEY_BIN:-}" ] && [ -z "${VOLLEY_BINS:-}" ]; then
  VOLLEY_BIN=$(volley_bin)
  export VOLLEY_BIN
fi
embedded_bin=${VOLLEY_BIN:-${VOLLEY_BINS%% *}}
work=$(mktemp -d -t volley-dist-vs-emb-XXXXXX)
temp_dirs+=("$work")
cleanup_on_exit
# The distributed runs of pass N go to $keep/pN, whose `rows` (solve-distributed.sh's JSON
# lines) the summary reads: a KEEP_DIR from an earlier call would mix its rows in.
keep=${KEEP_DIR:-$work/distributed}
if [ -n "${KEEP_DIR:-}" ] && [ -n "$(ls -A "$KEEP_DIR" 2>/dev/null)" ]; then
  echo "KEEP_DIR $KEEP_DIR is not empty; give an empty or new directory" >&2
  exit 1
fi

for pass in $(seq "$passes"); do
  echo "== pass $pass of $passes"
  # shellcheck disable=SC2086
  VOLLEY_BIN=$embedded_bin bench/solve.sh "" $seeds | tee "$work/embedded-p$pass"
  # shellcheck disable=SC2086
  KEEP_DIR=$keep/p$pass bench/solve-distributed.sh "$counts" $seeds
done

python3 - "$work" "$keep" "$passes" <<'PY'
import collections, json, math, os, statistics as st, sys

work, keep, n_passes = sys.argv[1], sys.argv[2], int(sys.argv[3])
embedded = collections.defaultdict(list)      # pass -> [(secs100, steps100)]
distributed = collections.defaultdict(list)   # (pass, actors, binary) -> [(loop s, env steps)]
by_seed = {}                                  # (pass, actors, seed, binary) -> (loop s, env steps)
order = []                                    # binaries (and niceness arms) as first run: the first is the base
for p in range(1, n_passes + 1):
    with open(f"{work}/embedded-p{p}") as table:
        cols = {name: i for i, name in enumerate(next(table).split())}
        for line in table:
            row = line.split()
            if row[cols["solved"]] != "True":
                print(f"pass {p}: unsolved embedded run, left out: {line.strip()}")
                continue
            embedded[p].append((float(row[cols["secs100"]]), int(row[cols["steps100"]])))
    rows = f"{keep}/p{p}/rows"
    for line in open(rows) if os.path.exists(rows) else []:
        r = json.loads(line)
        if not r["solved"]:
            print(f"pass {p}: unsolved distributed run, left out: {r}")
            continue
        distributed[(p, str(r["n"]), r["binary"])].append((r["learner_s"], r["env_steps"]))
        if r["binary"] not in order:
            order.append(r["binary"])
        if "seed" in r:
            by_seed[(p, str(r["n"]), r["seed"], r["binary"])] = (r["learner_s"], r["env_steps"])

passes = sorted(embedded)
if not passes:
    sys.exit("no embedded run solved; nothing to compare")
runs = [r for p in passes for r in embedded[p]]
embedded_median = {p: st.median(r[0] for r in embedded[p]) for p in passes}
print()
print(f"embedded: {len(runs)} runs, secs100 median {st.median(r[0] for r in runs):.3f} s, "
      f"{st.median(r[0] / r[1] * 1e6 for r in runs):.2f} µs per env step")
print("%-20s %-7s %-6s %-22s %-16s %-12s %-10s" % (
    "binary", "actors", "runs", "/ embedded (range)", "loop s (median)", "µs/env step", "env steps"))
keys = sorted({(n, b) for _, n, b in distributed}, key=lambda k: (k[1], int(k[0])))
ratios = {}
for n, binary in keys:
    per_pass = {p: distributed[(p, n, binary)] for p in passes if distributed.get((p, n, binary))}
    ratio = {p: st.median(r[0] for r in rs) / embedded_median[p] for p, rs in per_pass.items()}
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
# With several binaries (or niceness arms), each against the first, run by run: the same pass,
# actor count and seed, so the seed's env steps and the pass's machine state cancel out.
geo = lambda xs: math.exp(st.mean(math.log(x) for x in xs))
base = order[0] if order else None
for other in order[1:]:
    for n in sorted({n for n, _ in keys}, key=int):
        loop, step, steps = [], [], []
        for (p, nn, seed, b), (secs, env) in by_seed.items():
            a = by_seed.get((p, nn, seed, base))
            if nn == n and b == other and a:
                loop.append(secs / a[0])
                step.append((secs / env) / (a[0] / a[1]))
                steps.append(env / a[1])
        if loop:
            print(f"{other} / {base}, {n} actor(s), {len(loop)} pairs: loop {st.median(loop):.3f} (median; "
                  f"geometric mean {geo(loop):.3f}), per env step {st.median(step):.3f} ({geo(step):.3f}), "
                  f"env steps {geo(steps):.3f} (geometric mean); faster per env step in {sum(x < 1 for x in step)} of {len(step)}")
PY
