"""TLS towards NATS (issue 46): the environment server connects over TLS with --tls-ca or
VOLLEY_NATS_TLS_CA, and refuses, with one line and at once, a CA that did not sign the server's
certificate, missing files, and a server without TLS; a plain-text client is refused by the
test broker, which requires TLS like broker-config/."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import tempfile

import nats
import pytest

import conftest
from conftest import free_port

# A bound on a hang, not a timed assertion: each command must end by itself long before.
PATIENCE_SECS = 60


def serve(url: str, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run `python -m volley_envs serve` to its end (these tests expect it to fail)."""
    environment = {k: v for k, v in os.environ.items() if not k.startswith("VOLLEY_NATS_TLS")}
    environment.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "volley_envs", "serve", "gymnasium:CartPole-v1", "--nats", url, *args],
        capture_output=True, text=True, timeout=PATIENCE_SECS, env=environment,
    )


def test_a_plain_text_client_is_refused(nats_url):
    async def plain():
        await nats.connect(nats_url, allow_reconnect=False, max_reconnect_attempts=0, connect_timeout=5)

    with pytest.raises(Exception):
        asyncio.run(plain())


def test_a_ca_that_did_not_sign_the_server_certificate_is_refused(nats_url, tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    command = [os.environ["VOLLEY_TEST_CERTS"]] if os.environ.get("VOLLEY_TEST_CERTS") else [
        "cargo", "run", "--quiet", "-p", "volley-testkit", "--bin", "volley-test-certs", "--"]
    subprocess.run([*command, str(other)], check=True, cwd=conftest.REPO, stdout=subprocess.DEVNULL)
    result = serve(nats_url, "--tls-ca", str(other / "ca.pem"))
    assert result.returncode != 0
    assert "cannot connect to NATS" in result.stderr and "CERTIFICATE_VERIFY_FAILED" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr, result.stderr


def test_missing_tls_files_are_named(nats_url):
    result = serve(nats_url, env={"VOLLEY_NATS_TLS_CA": "/nonexistent/ca.pem"})
    assert result.returncode != 0
    assert "TLS files" in result.stderr and "/nonexistent/ca.pem" in result.stderr, result.stderr
    result = serve(nats_url, "--tls-cert", "/nonexistent/cert.pem")
    assert "--tls-cert and --tls-key go together" in result.stderr, result.stderr


def test_a_server_without_tls_is_refused_when_tls_is_required(tls_dir):
    port = free_port()
    with tempfile.TemporaryDirectory() as store:
        broker = conftest.start_nats(None, store, port, subprocess.DEVNULL)
        try:
            conftest.wait_for_port(broker, port)
            result = serve(f"nats://127.0.0.1:{port}", "--tls-ca", os.path.join(tls_dir, "ca.pem"))
        finally:
            broker.kill()
            broker.wait()
    assert result.returncode != 0
    assert "does not offer TLS" in result.stderr, result.stderr
