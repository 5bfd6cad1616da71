"""The Python server under the repo's broker permissions (broker-config/accounts.conf, issue 12):
logged in as the environment server user ``env-cartpole`` it serves the service ``cartpole`` to an
client (the learner user; actors, NKey identities since issue 46, call it with the same grants, as
``transport/tests/broker_permissions.rs`` tests) with no permission violation, and the server log
shows a violation for what it may not do.
"""

from __future__ import annotations

import asyncio
import os
import pathlib
import shutil
import subprocess
import tempfile
import time

import nats
import pytest

from volley_envs.client import call, discover
from volley_envs.protocol import from_f32_bin
from volley_envs.server import EnvServer, make_factory

from conftest import find_nats_server, free_port, wait_for_port

ACCOUNTS = pathlib.Path(__file__).resolve().parents[2] / "broker-config" / "accounts.conf"
PASSWORDS = {
    "VOLLEY_LEARNER_PASSWORD": "learner-test-password",
    "VOLLEY_ENV_SERVER_PASSWORD": "env-test-password",
}
# The actor identities' public keys the config reads (the development identities' will do).
ACTOR_KEYS = dict(
    line.split("=", 1)
    for line in (ACCOUNTS.parents[1] / "deploy" / "dev-identities" / "actors-local.env").read_text().splitlines()
    if line and not line.startswith("#")
)


@pytest.fixture(scope="module")
def broker(tls_dir):
    """A nats-server with the repo's accounts: (url, path of its log)."""
    port = free_port()
    store = tempfile.mkdtemp(prefix="volley-envs-perm-")
    config = os.path.join(store, "nats.conf")
    with open(config, "w") as f:
        f.write(f"listen: 127.0.0.1:{port}\njetstream {{ store_dir: {store!r} }}\n")
        cert, key = os.path.join(tls_dir, "server-cert.pem"), os.path.join(tls_dir, "server-key.pem")
        f.write(f"tls {{ cert_file: {cert!r}, key_file: {key!r} }}\n")
        f.write(ACCOUNTS.read_text())
    log_path = os.path.join(store, "nats.log")
    log = open(log_path, "w")
    process = subprocess.Popen([find_nats_server(), "-c", config], stdout=log, stderr=log, env={**os.environ, **PASSWORDS, **ACTOR_KEYS})
    try:
        wait_for_port(process, port, log_path)
        yield f"nats://127.0.0.1:{port}", log_path
    finally:
        process.kill()
        process.wait()
        log.close()
        shutil.rmtree(store, ignore_errors=True)


def violations(log_path: str) -> list[str]:
    return [line for line in open(log_path).read().splitlines() if "Violation" in line]


def test_the_env_server_user_serves_its_service_and_nothing_else(broker, tls_context):
    url, log_path = broker

    async def scenario():
        server_nc = await nats.connect(
            url, user="env-cartpole", password=PASSWORDS["VOLLEY_ENV_SERVER_PASSWORD"], tls=tls_context
        )
        actor_nc = await nats.connect(
            url,
            user="learner-local",
            password=PASSWORDS["VOLLEY_LEARNER_PASSWORD"],
            # The learner user's private inbox prefix, as the Rust transport sets it.
            inbox_prefix="_INBOX_learner-local",
            tls=tls_context,
        )
        server = EnvServer(make_factory("gymnasium:CartPole-v1"), "cartpole", label="gymnasium:CartPole-v1")
        await server.start(server_nc)
        (instance,) = await discover(actor_nc, "cartpole")
        spaces = await call(actor_nc, instance, "spaces", {})
        assert (spaces["obs_dim"], spaces["n_actions"]) == (4, 2)
        opened = await call(actor_nc, instance, "open", {"n_envs": 2, "seeds": [1, 2]})
        stepped = await call(actor_nc, instance, "step", {"session": opened["session"], "actions": [0, 1]})
        assert list(from_f32_bin(stepped["rewards"])) == [1.0, 1.0]
        await server.stop()
        assert violations(log_path) == []

        # Denied next to the grants: the run's data, replies meant for others, other services.
        await server_nc.publish("volley.local.traj.a1", b"x")
        await server_nc.subscribe("_INBOX.>")
        await server_nc.subscribe("volley.env.other.>")
        await server_nc.flush()
        deadline = time.monotonic() + 10
        wanted = ['"volley.local.traj.a1"', '"_INBOX.>"', '"volley.env.other.>"']
        while not all(any(w in line for line in violations(log_path)) for w in wanted):
            assert time.monotonic() < deadline, violations(log_path)
            await asyncio.sleep(0.05)
        await server_nc.close()
        await actor_nc.close()

    asyncio.run(scenario())
