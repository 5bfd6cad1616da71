"""ALE throughput through the Python environment server, and of the raw wrapped env in-process.

    python python/bench_ale.py [--game Pong] [--n-envs 8] [--steps 2000] [--nats URL]

Starts ``volley-envs serve atari:<Game>`` as a subprocess (one server process, one core at most:
it steps its environments one after another), opens a session of ``--n-envs`` environments
through :mod:`volley_envs.client` and steps it ``--steps`` times with uniformly random actions,
one request in flight. Prints agent steps/s (environment steps, all environments together) and
frames/s (x frame skip 4). Then steps one ``AtariPreprocessing`` environment in this process for
comparison. Without ``--nats`` it starts a nats-server (``$VOLLEY_NATS_SERVER`` or on ``PATH``)
on a free loopback port.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time

import nats
import numpy as np

from volley_envs.client import RemoteSession, call, discover
from volley_envs.server import make_factory

FRAME_SKIP = 4


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_nats() -> tuple:
    binary = os.environ.get("VOLLEY_NATS_SERVER") or shutil.which("nats-server")
    if not binary:
        raise SystemExit("nats-server not found: pass --nats URL, set VOLLEY_NATS_SERVER or put it on PATH")
    port = free_port()
    store = tempfile.mkdtemp(prefix="volley-bench-nats-")
    process = subprocess.Popen([binary, "-a", "127.0.0.1", "-p", str(port), "-sd", store],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return process, f"nats://127.0.0.1:{port}", store
        except OSError:
            if process.poll() is not None or time.monotonic() > deadline:
                raise SystemExit("nats-server did not start")
            time.sleep(0.02)


def start_env_server(game: str, url: str, name: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    process = subprocess.Popen(
        [sys.executable, "-m", "volley_envs", "serve", f"atari:{game}", "--nats", url, "--name", name],
        stderr=subprocess.PIPE, text=True, env=env,
    )
    line = ""
    while "environment server ready" not in line:
        line = process.stderr.readline()
        if not line:
            raise SystemExit("the environment server exited before it was ready")
    return process


async def remote(url: str, name: str, n_envs: int, steps: int, seed: int) -> float:
    nc = await nats.connect(url)
    (instance,) = await discover(nc, name)
    spaces = await call(nc, instance, "spaces", {})
    session = RemoteSession.for_spaces(nc, instance, spaces)
    await session.open([seed + i for i in range(n_envs)])
    rng = np.random.default_rng(seed)
    n_actions = spaces["n_actions"]
    actions = rng.integers(0, n_actions, size=(steps, n_envs)).tolist()
    for row in actions[:20]:  # warm-up
        await session.step(row)
    episodes = 0
    start = time.perf_counter()
    for row in actions:
        reply = await session.step(row)
        episodes += sum(t or u for t, u in zip(reply["terminated"], reply["truncated"]))
        assert not reply["errors"], reply["errors"]
    elapsed = time.perf_counter() - start
    await session.close()
    await nc.close()
    print(f"  {episodes} episodes ended; obs {reply['obs'].shape} {reply['obs'].dtype}", flush=True)
    return steps * n_envs / elapsed


def local(game: str, steps: int, seed: int) -> float:
    env = make_factory(f"atari:{game}")()
    env.reset(seed=seed)
    actions = np.random.default_rng(seed).integers(0, env.action_space.n, size=steps).tolist()
    start = time.perf_counter()
    for action in actions:
        _obs, _reward, term, trunc, _info = env.step(action)
        if term or trunc:
            env.reset()
    elapsed = time.perf_counter() - start
    env.close()
    return steps / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--game", default="Pong")
    parser.add_argument("--n-envs", type=int, default=8)
    parser.add_argument("--steps", type=int, default=2000, help="step requests of the session")
    parser.add_argument("--local-steps", type=int, default=4000, help="steps of the in-process environment")
    parser.add_argument("--nats", help="NATS URL (default: start a nats-server)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    nats_process = store = None
    url = args.nats
    if url is None:
        nats_process, url, store = start_nats()
    name = f"bench-{args.game.lower()}"
    server = start_env_server(args.game, url, name)
    try:
        print(f"remote: atari:{args.game}, 1 server process, session of {args.n_envs} envs, "
              f"{args.steps} steps, random actions", flush=True)
        rate = asyncio.run(remote(url, name, args.n_envs, args.steps, args.seed))
        print(f"  {rate:,.0f} agent steps/s = {FRAME_SKIP * rate:,.0f} frames/s "
              f"({rate / args.n_envs:,.1f} requests/s)", flush=True)
    finally:
        server.terminate()
        server.wait(timeout=30)
        if nats_process is not None:
            nats_process.kill()
            nats_process.wait()
            shutil.rmtree(store, ignore_errors=True)
    print(f"local: one AtariPreprocessing(ALE/{args.game}-v5) env in-process, {args.local_steps} steps", flush=True)
    rate = local(args.game, args.local_steps, args.seed)
    print(f"  {rate:,.0f} agent steps/s = {FRAME_SKIP * rate:,.0f} frames/s", flush=True)


if __name__ == "__main__":
    main()
