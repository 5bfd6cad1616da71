"""The Gymnasium server against a real nats-server, through the protocol's own client."""

from __future__ import annotations

import asyncio
import os
import queue
import signal
import subprocess
import threading
import time

import gymnasium as gym
import msgpack
import nats
import numpy as np
import pytest

from volley_envs.client import Gone, RemoteSession, call, discover
from volley_envs.protocol import ProtocolError, from_f32_bin
from volley_envs.server import EnvServer, make_factory

import conftest
from conftest import free_port


def run(coro):
    return asyncio.run(coro)


def cartpole_server(name="cartpole-v1", **kwargs) -> EnvServer:
    return EnvServer(make_factory("gymnasium:CartPole-v1"), name, label="gymnasium:CartPole-v1", **kwargs)



def test_discovery_lists_every_instance_with_its_endpoints(serve):
    async def scenario():
        a, b = cartpole_server("disc"), cartpole_server("disc")
        async with serve(a, b) as served:
            nc = served.nc
            instances = await discover(nc, "disc")
            assert sorted(i.id for i in instances) == sorted([a.id, b.id])
            for instance in instances:
                assert instance.subjects["step"] == f"volley.env.disc.{instance.id}.step"
            assert await discover(nc, "nobody") == []
            spaces = await call(nc, instances[0], "spaces", {})
            assert (spaces["obs_dim"], spaces["n_actions"]) == (4, 2)
            assert spaces["reward_threshold"] == 475.0 and spaces["max_episode_steps"] == 500
            assert spaces["snapshot"] is True  # CartPole's state is captured (volley_envs.snapshot)
            assert np.array_equal(from_f32_bin(spaces["obs_low"]), gym.make("CartPole-v1").observation_space.low)

    run(scenario())


def test_a_batched_session_steps_like_local_gymnasium_envs_with_auto_reset(serve):
    async def scenario():
        server = cartpole_server("batch")
        async with serve(server) as served:
            nc, instance = served.nc, served.instance
            session = RemoteSession(nc, instance, obs_dim=4)
            seeds = [3, 4, 5]
            obs = await session.open(seeds)
            local = [gym.make("CartPole-v1") for _ in seeds]
            expected = np.stack([env.reset(seed=seed)[0] for env, seed in zip(local, seeds)])
            assert np.array_equal(obs, expected)
            n_done = 0
            for step_idx in range(300):
                actions = [(step_idx + i) % 2 if step_idx % 7 else 1 for i in range(3)]
                reply = await session.step(actions)
                finals = []
                for i, (env, action) in enumerate(zip(local, actions)):
                    o, r, te, tr, _ = env.step(action)
                    assert (reply["terminated"][i], reply["truncated"][i], reply["rewards"][i]) == (te, tr, r)
                    if te or tr:
                        finals.append(o)
                        o, _ = env.reset()
                        n_done += 1
                    expected[i] = o
                assert np.array_equal(reply["obs"], expected), step_idx
                assert np.array_equal(reply["final_obs"], np.array(finals, dtype=np.float32).reshape(-1, 4))
                assert reply["errors"] == []
            assert n_done > 5
            reset = await session.reset([11, None, None])
            assert np.array_equal(reset[0], gym.make("CartPole-v1").reset(seed=11)[0])
            # Version 3: reset a subset; the others keep their state.
            before = np.array(reset)
            reply = await call(nc, instance, "reset", {"session": session.session, "envs": [2], "seeds": [21]})
            obs = from_f32_bin(reply["obs"]).reshape(3, 4)
            assert np.array_equal(obs[2], gym.make("CartPole-v1").reset(seed=21)[0])
            assert np.array_equal(obs[:2], before[:2])
            for bad in ({"envs": [3], "seeds": [1]}, {"envs": [0, 0], "seeds": [1, 2]}, {"envs": [1], "seeds": [1, 2]},
                        {"envs": [], "seeds": []}, {"envs": [True], "seeds": [1]}):
                with pytest.raises(ProtocolError) as err:
                    await call(nc, instance, "reset", {"session": session.session, **bad})
                assert err.value.code == 400, bad
            await session.close()
            assert server.sessions == {}

    run(scenario())


def test_errors_are_answered_with_codes(serve):
    async def scenario():
        server = cartpole_server("codes", max_sessions=1, max_envs_per_session=4)
        async with serve(server) as served:
            nc, instance = served.nc, served.instance

            async def code_of(op, request, raw=None):
                message = await nc.request(instance.subjects[op], raw if raw is not None else msgpack.packb(request))
                return int(message.headers["Nats-Service-Error-Code"]), message.headers["Nats-Service-Error"]

            assert (await code_of("step", None, raw=b"\xc1"))[0] == 400
            assert (await code_of("spaces", {}))[0] == 400
            code, message = await code_of("spaces", {"v": 4})
            assert code == 505 and "protocol version 4" in message and "1 to 3" in message
            assert (await code_of("step", {"v": 1, "session": 123, "actions": [0]}))[0] == 404
            assert (await code_of("open", {"v": 1, "n_envs": 5, "seeds": [0] * 5}))[0] == 400
            opened = await call(nc, instance, "open", {"n_envs": 2, "seeds": [1, 2]})
            assert (await code_of("open", {"v": 1, "n_envs": 1, "seeds": [0]}))[0] == 503
            code, message = await code_of("step", {"v": 1, "session": opened["session"], "actions": [0]})
            assert code == 400 and "1 actions for 2 environments" in message
            assert (await code_of("snapshot", {"v": 1, "session": opened["session"], "env": 2}))[0] == 400
            assert server.rejected == 5
            # Issue 12: malformed fields are 400, not 505 or 500 (docs/ENV_PROTOCOL.md).
            code, message = await code_of("spaces", {"v": "1"})
            assert code == 400 and "unsigned integer" in message
            assert (await code_of("spaces", {"v": True}))[0] == 400
            assert (await code_of("spaces", {"v": -1}))[0] == 400
            assert (await code_of("spaces", {"v": 2**40}))[0] == 400
            assert (await code_of("open", {"v": 1, "n_envs": 1, "seeds": [-1]}))[0] == 400
            assert (await code_of("open", {"v": 1, "n_envs": 1, "seeds": [1.5]}))[0] == 400
            assert (await code_of("open", {"v": 1, "n_envs": 1, "seeds": ["x"]}))[0] == 400
            assert (await code_of("open", {"v": 1, "n_envs": "1", "seeds": [0]}))[0] == 400
            assert (await code_of("reset", {"v": 1, "session": opened["session"], "seeds": [-5, None]}))[0] == 400
            assert (await code_of("reset", {"v": 1, "session": "abc", "seeds": [1, 2]}))[0] == 400
            assert (await code_of("step", {"v": 1, "session": opened["session"], "actions": "01"}))[0] == 400
            assert server.rejected == 5 + 11
            # An out-of-range action fails that environment only: truncated, reward 0, reset.
            reply = await call(nc, instance, "step", {"session": opened["session"], "actions": [0, 9]})
            assert reply["errors"][0]["env"] == 1 and "out of range" in reply["errors"][0]["message"]
            assert reply["truncated"] == [False, True]
            assert from_f32_bin(reply["rewards"])[1] == 0.0
            assert len(from_f32_bin(reply["final_obs"])) == 4
            await served.stop(server)
            with pytest.raises(Gone):
                await call(nc, instance, "spaces", {})

    run(scenario())


class Exploding(gym.Env):
    """Steps fine until step 3 of an episode, then raises."""

    observation_space = gym.spaces.Box(-1.0, 1.0, (2,), np.float32)
    action_space = gym.spaces.Discrete(2)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return np.zeros(2, np.float32), {}

    def step(self, action):
        self.t += 1
        if self.t == 3:
            raise RuntimeError("kaboom")
        return np.full(2, self.t / 10, np.float32), 1.0, False, False, {}


def test_a_failing_env_is_reported_and_reset_while_the_others_go_on(serve):
    async def scenario():
        server = EnvServer(Exploding, "exploding")
        async with serve(server) as served:
            nc, instance = served.nc, served.instance
            session = RemoteSession(nc, instance, obs_dim=2)
            await session.open([0, 1])
            await session.step([0, 0])
            second = await session.step([0, 0])
            third = await session.step([1, 1])
            assert [e["env"] for e in third["errors"]] == [0, 1]
            assert third["truncated"] == [True, True] and list(third["rewards"]) == [0.0, 0.0]
            assert np.array_equal(third["final_obs"], second["obs"]), "the last valid observations"
            assert np.array_equal(third["obs"], np.zeros((2, 2), np.float32)), "reset"

    run(scenario())


def test_idle_sessions_expire(serve):
    async def scenario():
        server = cartpole_server("idle", idle_timeout=0.1)
        async with serve(server) as served:
            nc, instance = served.nc, served.instance
            opened = await call(nc, instance, "open", {"n_envs": 1, "seeds": [0]})
            while server.sessions:
                await asyncio.sleep(0.02)
            with pytest.raises(ProtocolError) as err:
                await call(nc, instance, "step", {"session": opened["session"], "actions": [0]})
            assert err.value.code == 404 and server.expired == 1

    run(scenario())


def test_the_serve_fixture_stops_its_servers_when_the_test_fails(serve, nats_url, tls_context):
    server = cartpole_server("fixture")

    async def failing():
        async with serve(server) as served:
            assert served.instance.id == server.id
            await call(served.nc, served.instance, "open", {"n_envs": 1, "seeds": [0]})
            raise RuntimeError("the test failed here")

    with pytest.raises(RuntimeError, match="the test failed here"):
        run(failing())
    assert server.sessions == {}

    async def gone():
        nc = await nats.connect(nats_url, tls=tls_context)
        assert await discover(nc, "fixture") == []
        await nc.close()

    run(gone())


def test_the_command_line_serves_until_sigterm(nats_url, serve_command, tls_context):
    with serve_command("gymnasium:CartPole-v1") as (process, line):
        assert "service=volley-env-cartpole-v1" in line

        async def scenario():
            nc = await nats.connect(nats_url, tls=tls_context)
            (instance,) = await discover(nc, "cartpole-v1")
            opened = await call(nc, instance, "open", {"n_envs": 2, "seeds": [1, 2]})
            assert len(from_f32_bin(opened["obs"])) == 8
            await nc.close()

        run(scenario())
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0

    async def gone():
        nc = await nats.connect(nats_url, tls=tls_context)
        assert await discover(nc, "cartpole-v1") == []
        await nc.close()

    run(gone())


class NonFinite(Exploding):
    """First episode: a NaN observation on step 2; later episodes: an infinite reward on step 1."""

    episodes = 0

    def reset(self, *, seed=None, options=None):
        self.episodes += 1
        return super().reset(seed=seed, options=options)

    def step(self, action):
        self.t += 1
        nan = self.episodes == 1 and self.t == 2
        inf = self.episodes > 1 and self.t == 1
        return np.full(2, np.nan if nan else 0.5, np.float32), (np.inf if inf else 1.0), False, False, {}


def test_non_finite_outputs_fail_the_environment(serve):
    async def scenario():
        server = EnvServer(NonFinite, "nonfinite")
        async with serve(server) as served:
            nc, instance = served.nc, served.instance
            session = RemoteSession(nc, instance, obs_dim=2)
            await session.open([0])
            first = await session.step([0])
            assert first["errors"] == [] and list(first["rewards"]) == [1.0]
            second = await session.step([0])
            assert second["errors"][0]["message"] == "ValueError: non-finite observation or reward"
            assert np.array_equal(second["final_obs"], first["obs"]) and second["truncated"] == [True]
            assert np.all(np.isfinite(second["obs"]))
            third = await session.step([0])
            assert [e["env"] for e in third["errors"]] == [0] and list(third["rewards"]) == [0.0]

    run(scenario())


def start_nats(port, store, tls_dir):
    """A nats-server on `port` requiring TLS with the test CA, up when this returns."""
    process = conftest.start_nats(tls_dir, store, port, subprocess.DEVNULL)
    conftest.wait_for_port(process, port)
    return process


class Lines:
    """A subprocess's stderr, read line by line on a thread so a wait can give up."""

    def __init__(self, stream):
        self.lines = []
        self.queue = queue.Queue()
        threading.Thread(target=self._read, args=(stream,), daemon=True).start()

    def _read(self, stream):
        for line in stream:
            self.queue.put(line)
        self.queue.put(None)

    def until(self, text, limit_secs=60):
        """The next line containing `text`; fails when the stream ends or nothing matches
        within `limit_secs` (a bound on a hang, not a timing assertion)."""
        deadline = time.monotonic() + limit_secs
        while True:
            try:
                line = self.queue.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"no line with {text!r}: {''.join(self.lines)}") from None
            assert line is not None, f"the server exited before logging {text!r}: {''.join(self.lines)}"
            self.lines.append(line)
            assert "Traceback" not in line, f"a traceback on stderr: {''.join(self.lines)}"
            if text in line:
                return line

    def rest(self):
        """Every line until the stream ends (the process has exited)."""
        while (line := self.queue.get(timeout=30)) is not None:
            self.lines.append(line)
        return self.lines


def test_a_broker_outage_logs_one_line_per_reconnect_attempt(tmp_path, tls_dir, tls_context):
    """Issue 48: during a broker outage volley-envs printed a full Python traceback for every
    failed reconnect attempt. Each attempt is one line now, the server reconnects when the
    broker is back, and serves again."""
    port = free_port()
    url = f"nats://127.0.0.1:{port}"
    broker = start_nats(port, str(tmp_path / "js"), tls_dir)
    process = conftest.start_serve(url, tls_dir, "gymnasium:CartPole-v1")
    stderr = Lines(process.stderr)
    try:
        stderr.until("environment server ready")
        broker.kill()
        broker.wait()
        stderr.until("disconnected from NATS")
        # Two failed attempts while the broker is down (the server retries every 2 s).
        for _ in range(2):
            stderr.until(f"NATS at {url}:")
        broker = start_nats(port, str(tmp_path / "js"), tls_dir)
        stderr.until("reconnected to NATS")

        async def serves_again():
            nc = await nats.connect(url, tls=tls_context)
            (instance,) = await discover(nc, "cartpole-v1")
            opened = await call(nc, instance, "open", {"n_envs": 1, "seeds": [1]})
            assert len(from_f32_bin(opened["obs"])) == 4
            await nc.close()

        run(serves_again())
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0
        lines = stderr.rest()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        broker.kill()
        broker.wait()
    log = "".join(lines)
    assert "Traceback" not in log, log
    # Every line on stderr is a log line of its own (a timestamp first): no traceback's lines.
    assert all(line[:4].isdigit() and line[4] == "-" for line in lines), log
