#!/usr/bin/env bash
# Run the README's long commands as written (the LONG list of .ci/readme-check.py: solves and
# multi-million-step runs that CI only checks the flags of), each block with the processes it
# needs, and fail when one fails. Minutes to hours; run by hand, like the other bench scripts.
# usage: bench/readme-long.sh   (needs volley-envs on PATH for the served Pong example)
set -euo pipefail
cd "$(dirname "$0")/.."
. bench/lib.sh
VOLLEY_BIN=$(volley_bin)
nats_dir=$(dirname "$(nats_server_bin)")
VOLLEY_BIN="$VOLLEY_BIN" PATH="$nats_dir:$PATH" exec python3 .ci/readme-check.py --long
