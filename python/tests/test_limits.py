"""Issue 46, item 8: the server's limits are sized to a pod, configurable by flags and environment
variables, and an open beyond them is refused with an error that names the limit."""

from __future__ import annotations

import asyncio

import nats
import pytest

from volley_envs.__main__ import parse_args
from volley_envs.client import call, discover
from volley_envs.protocol import ProtocolError
from volley_envs.server import (
    DEFAULT_MAX_ENVS,
    DEFAULT_MAX_ENVS_PER_SESSION,
    DEFAULT_MAX_SESSIONS,
    EnvServer,
    make_factory,
)


def run(coro):
    return asyncio.run(coro)


def cartpole_server(name: str, **kwargs) -> EnvServer:
    return EnvServer(make_factory("gymnasium:CartPole-v1"), name, label="gymnasium:CartPole-v1", **kwargs)


def test_defaults_bound_the_environments_a_server_holds():
    # The old defaults allowed 1,024 sessions of 1,024 environments each.
    server = cartpole_server("defaults")
    assert (server.max_sessions, server.max_envs_per_session, server.max_envs) == (64, 64, 256)
    assert (DEFAULT_MAX_SESSIONS, DEFAULT_MAX_ENVS_PER_SESSION, DEFAULT_MAX_ENVS) == (64, 64, 256)
    args = parse_args(["serve", "gymnasium:CartPole-v1"])
    assert (args.max_sessions, args.max_envs_per_session, args.max_envs) == (64, 64, 256)


def test_an_open_beyond_the_servers_environments_is_refused_with_the_limit_named(serve):
    async def scenario():
        server = cartpole_server("limits", max_sessions=3, max_envs_per_session=4, max_envs=5)
        async with serve(server) as served:
            nc, instance = served.nc, served.instance
            first = await call(nc, instance, "open", {"n_envs": 4, "seeds": [1, 2, 3, 4]})
            with pytest.raises(ProtocolError) as refused:
                await call(nc, instance, "open", {"n_envs": 2, "seeds": [5, 6]})
            assert refused.value.code == 503
            assert "4 environments open and 2 more would exceed the server's max_envs 5" in refused.value.message
            assert "--max-envs" in refused.value.message and "VOLLEY_ENV_MAX_ENVS" in refused.value.message
            await call(nc, instance, "open", {"n_envs": 1, "seeds": [5]})
            assert server.open_envs == 5
            # Closing a session makes room again.
            await call(nc, instance, "close", {"session": first["session"]})
            await call(nc, instance, "open", {"n_envs": 2, "seeds": [6, 7]})
            await call(nc, instance, "open", {"n_envs": 1, "seeds": [8]})
            with pytest.raises(ProtocolError) as refused:
                await call(nc, instance, "open", {"n_envs": 1, "seeds": [9]})
            assert refused.value.code == 503 and "max_sessions" in refused.value.message
            assert "--max-sessions" in refused.value.message

    run(scenario())


def test_a_session_larger_than_the_server_is_a_bad_request():
    # max_envs_per_session is clamped to max_envs and declared in `spaces`.
    server = cartpole_server("clamp", max_envs_per_session=64, max_envs=3)
    assert server.max_envs_per_session == 3
    with pytest.raises(ValueError, match="max_envs 0"):
        cartpole_server("zero", max_envs=0)


def test_limits_come_from_flags_and_environment_variables(nats_url, serve_command, monkeypatch, tls_context):
    monkeypatch.setenv("VOLLEY_ENV_MAX_ENVS", "3")
    monkeypatch.setenv("VOLLEY_ENV_MAX_SESSIONS", "9")
    with serve_command("gymnasium:CartPole-v1", "--name", "limited", "--max-sessions", "2") as (process, _ready):
        limits = process.stderr.readline()
        assert "max_sessions=2 max_envs=3 max_envs_per_session=3" in limits, limits

        async def scenario():
            nc = await nats.connect(nats_url, tls=tls_context)
            try:
                (instance,) = await discover(nc, "limited")
                await call(nc, instance, "open", {"n_envs": 3, "seeds": [1, 2, 3]})
                with pytest.raises(ProtocolError) as refused:
                    await call(nc, instance, "open", {"n_envs": 1, "seeds": [4]})
                assert refused.value.code == 503 and "max_envs 3" in refused.value.message
            finally:
                await nc.close()

        run(scenario())


@pytest.mark.parametrize("flag", ["--max-envs", "--max-sessions", "--max-envs-per-session"])
def test_a_limit_below_one_is_refused_at_start(flag, capsys):
    with pytest.raises(SystemExit):
        parse_args(["serve", "gymnasium:CartPole-v1", flag, "0"])
    assert "must be at least 1" in capsys.readouterr().err


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf", "soon"])
def test_an_idle_timeout_that_never_frees_a_session_is_refused_at_start(value, capsys, monkeypatch):
    # A NaN or infinite timeout kept abandoned sessions (and their slots of --max-sessions)
    # forever; a bad variable was a traceback. Both are now a clear error.
    with pytest.raises(SystemExit):
        parse_args(["serve", "gymnasium:CartPole-v1", "--idle-timeout-secs", value])
    assert "--idle-timeout-secs" in capsys.readouterr().err
    monkeypatch.setenv("VOLLEY_ENV_IDLE_TIMEOUT_SECS", value)
    with pytest.raises(SystemExit):
        parse_args(["serve", "gymnasium:CartPole-v1"])
    assert "--idle-timeout-secs" in capsys.readouterr().err
    with pytest.raises(ValueError, match="idle_timeout"):
        cartpole_server("idle", idle_timeout=float(value) if value != "soon" else "soon")


def test_the_idle_timeout_comes_from_its_flag_or_variable(monkeypatch):
    assert parse_args(["serve", "gymnasium:CartPole-v1"]).idle_timeout_secs == 300.0
    monkeypatch.setenv("VOLLEY_ENV_IDLE_TIMEOUT_SECS", "45")
    assert parse_args(["serve", "gymnasium:CartPole-v1"]).idle_timeout_secs == 45.0
    assert parse_args(["serve", "gymnasium:CartPole-v1", "--idle-timeout-secs", "2.5"]).idle_timeout_secs == 2.5
