#!/usr/bin/env bash
# GPU check for the CUDA learner backend (issues 4 and 13): finds the CUDA libraries, builds (or takes
# prebuilt) test and bench binaries, runs every CPU/CUDA parity test (learner/src/backend/cuda/tests.rs,
# each operation of the Backend trait, the generic network, both fused losses, clipped Adam, the
# selection values and whole updates) with a device required, runs
# `volley train --backend cuda` briefly, then the learner benchmark, and prints a short table.
# Where a nats-server is at hand (DIR/nats-server, $VOLLEY_NATS_SERVER or on PATH) and the machine
# has 5 cores or more, it also solves CartPole over NATS with 1 and then 2 actor processes, every
# process on cores of its own (`PIN_CORES=1 bench/solve-distributed.sh`): issue 16's "2 actors no
# slower than 1", which a 2-vCPU machine cannot show (docs/BENCHMARKS.md).
# Must finish within 8 minutes on a GPU machine.
#
#   scripts/gpu-check.sh                 # build with cargo, then run
#   scripts/gpu-check.sh --prebuilt DIR  # DIR holds volley-learner-tests, volley-backend-bench, volley
#                                        # (built elsewhere with scripts/gpu-check.sh --build-only DIR)
#   scripts/gpu-check.sh --build-only DIR
#
# Environment: OUT (optional) receives the logs and bench JSON lines.
set -euo pipefail
cd "$(dirname "$0")/.."
mode=build
dir=""
case "${1:-}" in
  --prebuilt) mode=prebuilt; dir="$2" ;;
  --build-only) mode=build-only; dir="$2" ;;
  "") ;;
  *) echo "usage: $0 [--prebuilt DIR | --build-only DIR]" >&2; exit 2 ;;
esac
out="${OUT:-$(mktemp -d)}"
step() { printf '\n==> %s\n' "$*"; }

build() {
  local target="$1"
  mkdir -p "$target"
  cargo build --release -p volley
  local tests bench
  tests=$(cargo test --release -p volley-learner --lib --no-run --message-format=json 2>/dev/null \
    | python3 -c 'import json,sys
for l in sys.stdin:
    m=json.loads(l)
    if m.get("reason")=="compiler-artifact" and m.get("executable") and m["target"]["kind"]==["lib"]: print(m["executable"])' | tail -1)
  bench=$(cargo bench -p volley-learner --bench backend --no-run --message-format=json 2>/dev/null \
    | python3 -c 'import json,sys
for l in sys.stdin:
    m=json.loads(l)
    if m.get("reason")=="compiler-artifact" and m.get("executable") and m["target"]["name"]=="backend": print(m["executable"])' | tail -1)
  cp "$tests" "$target/volley-learner-tests"
  cp "$bench" "$target/volley-backend-bench"
  cp target/release/volley "$target/volley"
  strip "$target"/* 2>/dev/null || true
  # The broker for the distributed step, when one is at hand as a binary (a wrapper script
  # would not run on the GPU machine); not stripped: a Go binary.
  local nats="${VOLLEY_NATS_SERVER:-$(command -v nats-server || true)}"
  if [ -n "$nats" ] && head -c 4 "$(realpath "$nats")" | grep -q ELF; then cp "$(realpath "$nats")" "$target/nats-server"; fi
  ls -la "$target"
}

if [ "$mode" = build-only ]; then build "$dir"; exit 0; fi
if [ "$mode" = build ]; then dir=target/gpu-check; build "$dir"; fi

step "device"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv || true

step "CUDA libraries (cudarc loads libcuda, libnvrtc and libcublas at run time)"
# cudarc asks for libnvrtc.so / libcublas.so (or .so.12/.so.11 …); a CUDA 13 install only has
# .so.13, so link the first one found under the unversioned name.
libdir=$(mktemp -d)
for lib in libnvrtc libcublas libcublasLt; do
  if ldconfig -p 2>/dev/null | grep -q "$lib\.so "; then continue; fi
  found=$(find /usr/local/cuda*/ /usr/lib/x86_64-linux-gnu /opt /usr/local/lib/python3*/ /usr/lib/python3*/ \
            -name "$lib.so*" -not -name "*.alt.*" 2>/dev/null | sort | head -1 || true)
  if [ -n "$found" ]; then
    ln -sf "$found" "$libdir/$lib.so"
    export LD_LIBRARY_PATH="$(dirname "$found"):${LD_LIBRARY_PATH:-}"
    echo "$lib: $found"
  else
    echo "$lib: not found" >&2
  fi
done
export LD_LIBRARY_PATH="$libdir:${LD_LIBRARY_PATH:-}"

status=0
step "parity tests (CUDA vs CPU; a missing device fails them)"
VOLLEY_REQUIRE_CUDA=1 VOLLEY_REQUIRE_NVRTC=1 "$dir/volley-learner-tests" backend --test-threads=1 2>&1 \
  | tee "$out/parity.log" || status=1

step "volley train --backend cuda (CartPole, 60K env steps)"
"$dir/volley" train --backend cuda --max-env-steps 60000 --run-dir "$(mktemp -d)/run" --progress lines \
  > "$out/train.json" 2> "$out/train.log" || status=1
cat "$out/train.json"
grep -q '"backend":"cuda' "$out/train.json" || { echo "train did not run on CUDA" >&2; status=1; }

step "learner benchmark (CPU and CUDA)"
VOLLEY_BENCH_OUT="$out/bench.jsonl" timeout 300 "$dir/volley-backend-bench" ${BENCH_ARGS:-} 2>&1 \
  | tee "$out/bench.log" || status=1

step "distributed CartPole: 1 and 2 actors, each process on cores of its own (issue 16, item 1)"
nats="$dir/nats-server"
[ -x "$nats" ] || nats="${VOLLEY_NATS_SERVER:-$(command -v nats-server || true)}"
if [ -z "$nats" ]; then
  echo "skipped: no nats-server (put one in $dir, on PATH or in VOLLEY_NATS_SERVER)" | tee "$out/distributed.log"
elif [ "$(nproc)" -lt 5 ]; then
  echo "skipped: $(nproc) cores; the learner (2), the broker and 2 actors need 5" | tee "$out/distributed.log"
else
  natsdir=$(mktemp -d)
  ln -s "$(realpath "$nats")" "$natsdir/nats-server"
  PATH="$natsdir:$PATH" PIN_CORES=1 VOLLEY_BIN="$dir/volley" KEEP_DIR="$out/distributed" \
    timeout 240 bench/solve-distributed.sh "1 2" 1 2 3 4 5 2>&1 | tee "$out/distributed.log" || status=1
fi

step "summary"
grep -E "^test .*(ok|FAILED)$" "$out/parity.log" | sed 's/^test backend::/  /' || true
grep -E "^\| (cuda|scan)" "$out/bench.log" | head -40 || true
sed -n '/^actors  *solved/,$p' "$out/distributed.log" || true
exit $status
