"""Box (continuous) actions, protocol version 2: Pendulum (no MuJoCo needed) and, when the
``mujoco`` package imports, HalfCheetah-v5, each against a real nats-server."""

from __future__ import annotations

import asyncio
import importlib.util

import gymnasium as gym
import msgpack
import numpy as np
import pytest

from volley_envs.client import RemoteSession, call
from volley_envs.protocol import ProtocolError, f32_bin, from_f32_bin
from volley_envs.server import EnvServer, make_factory

HAVE_MUJOCO = importlib.util.find_spec("mujoco") is not None


def run(coro):
    return asyncio.run(coro)



def pendulum_server(name="pendulum-v1", **kwargs) -> EnvServer:
    return EnvServer(make_factory("gymnasium:Pendulum-v1"), name, label="gymnasium:Pendulum-v1", **kwargs)


def test_pendulum_spaces_announce_a_box_and_protocol_3(serve):
    async def scenario():
        server = pendulum_server("pend-spaces")
        async with serve(server) as served:
            nc, instance = served.nc, served.instance
            assert instance.protocol == 3
            spaces = await call(nc, instance, "spaces", {})
            assert spaces["obs_dim"] == 3 and spaces["n_actions"] == 0
            action = spaces["action_space"]
            assert action["kind"] == "box" and action["shape"] == [1]
            assert from_f32_bin(action["low"]).tolist() == [-2.0]
            assert from_f32_bin(action["high"]).tolist() == [2.0]
            assert spaces["max_episode_steps"] == 200
            # A version-1 client cannot step floats: it is told which version to speak.
            with pytest.raises(ProtocolError) as err:
                await call(nc, type(instance)(id=instance.id, subjects=instance.subjects, protocol=1), "spaces", {})
            assert err.value.code == 505 and "Box actions need protocol version 2" in err.value.message
            # Version 2 is still served for vector observations.
            v2 = type(instance)(id=instance.id, subjects=instance.subjects, protocol=2)
            assert (await call(nc, v2, "spaces", {}))["action_space"]["kind"] == "box"

    run(scenario())


def test_pendulum_steps_like_local_gymnasium_with_clipping_and_auto_reset(serve):
    async def scenario():
        server = pendulum_server("pend-step")
        async with serve(server) as served:
            nc, instance = served.nc, served.instance
            session = RemoteSession(nc, instance, obs_dim=3)
            seeds = [11, 12]
            obs = await session.open(seeds)
            local = [gym.make("Pendulum-v1") for _ in seeds]
            expected = np.stack([env.reset(seed=seed)[0] for env, seed in zip(local, seeds)])
            assert np.array_equal(obs, expected)
            rng = np.random.default_rng(0)
            n_done = 0
            for _ in range(210):
                # Out-of-range values too: the server clips them to [-2, 2] as Pendulum would.
                actions = rng.uniform(-5.0, 5.0, size=(2, 1)).astype(np.float32)
                reply = await session.step(actions)
                assert reply["errors"] == []
                for i, env in enumerate(local):
                    o, r, te, tr, _ = env.step(np.clip(actions[i], -2.0, 2.0))
                    assert reply["terminated"][i] == te and reply["truncated"][i] == tr
                    assert reply["rewards"][i] == np.float32(r)
                    if te or tr:
                        n_done += 1
                        o, _ = env.reset()
                    np.testing.assert_allclose(reply["obs"][i], o, rtol=0, atol=1e-6)
            # Pendulum truncates at 200 steps: both environments ended once and were reset.
            assert n_done == 2
            await session.close()

    run(scenario())


def test_pendulum_clips_out_of_range_actions_at_the_server():
    server = pendulum_server("pend-clip")
    session_reply = msgpack.unpackb(server.handle("open", msgpack.packb({"v": 2, "n_envs": 1, "seeds": [5]})))
    session = session_reply["session"]
    env = server.sessions[session].envs[0]
    seen = []
    original = env.step
    env.step = lambda action: (seen.append(np.array(action)), original(action))[1]
    server.handle("step", msgpack.packb({"v": 2, "session": session, "actions": f32_bin([[1e6]])}))
    server.handle("step", msgpack.packb({"v": 2, "session": session, "actions": f32_bin([[-3.0]])}))
    assert [a.tolist() for a in seen] == [[2.0], [-2.0]]
    assert all(a.dtype == np.float32 for a in seen)


def test_non_finite_and_malformed_box_actions(serve):
    async def scenario():
        server = pendulum_server("pend-bad")
        async with serve(server) as served:
            nc, instance = served.nc, served.instance
            session = RemoteSession(nc, instance, obs_dim=3)
            obs = await session.open([1, 2, 3])
            # A NaN or infinite action fails its environment only: reported, truncated with reward
            # 0 and its last observation final, then reset; the others step normally.
            reply = await session.step(np.array([[0.5], [np.nan], [-np.inf]], dtype=np.float32))
            assert [e["env"] for e in reply["errors"]] == [1, 2]
            assert all("non-finite action" in e["message"] for e in reply["errors"])
            assert reply["truncated"] == [False, True, True] and reply["terminated"] == [False] * 3
            assert reply["rewards"][1] == 0.0 and reply["rewards"][2] == 0.0 and reply["rewards"][0] != 0.0
            np.testing.assert_array_equal(reply["final_obs"], obs[1:])
            # Wrong length, integers instead of floats, or a bin of odd length: request errors.
            for actions in (f32_bin([[0.0], [0.0]]), [0, 1, 2], b"\x00" * 11, f32_bin([[0.0]] * 4)):
                with pytest.raises(ProtocolError) as err:
                    await call(nc, instance, "step", {"session": session.session, "actions": actions})
                assert err.value.code == 400, actions
            assert server.rejected == 4
            # The session survives bad requests.
            reply = await session.step(np.zeros((3, 1), dtype=np.float32))
            assert reply["errors"] == []

    run(scenario())


def test_a_discrete_server_still_answers_version_1_and_refuses_floats(serve):
    async def scenario():
        server = EnvServer(make_factory("gymnasium:CartPole-v1"), "cp-v1")
        async with serve(server) as served:
            nc, instance = served.nc, served.instance
            v1 = type(instance)(id=instance.id, subjects=instance.subjects, protocol=1)
            spaces = await call(nc, v1, "spaces", {})
            assert spaces["n_actions"] == 2 and spaces["action_space"] == {"kind": "discrete", "n": 2}
            session = RemoteSession(nc, v1, obs_dim=4)
            await session.open([0])
            reply = await session.step([1])
            assert reply["errors"] == []
            with pytest.raises(ProtocolError) as err:
                await call(nc, v1, "step", {"session": session.session, "actions": f32_bin([0.0])})
            assert err.value.code == 400

    run(scenario())


def test_unbounded_box_actions_are_refused_at_start():
    from gymnasium import spaces

    class Unbounded(gym.Env):
        observation_space = spaces.Box(-1.0, 1.0, (2,), np.float32)
        action_space = spaces.Box(-np.inf, np.inf, (1,), np.float32)

    with pytest.raises(ValueError, match="finite bounds"):
        EnvServer(Unbounded, "unbounded")


@pytest.mark.skipif(not HAVE_MUJOCO, reason="the mujoco package is not installed (pip install 'gymnasium[mujoco]')")
def test_halfcheetah_serves_box_actions_of_dim_6(serve):
    async def scenario():
        server = EnvServer(make_factory("gymnasium:HalfCheetah-v5"), "halfcheetah-v5")
        async with serve(server) as served:
            nc, instance = served.nc, served.instance
            spaces = await call(nc, instance, "spaces", {})
            assert spaces["obs_dim"] == 17 and spaces["action_space"]["shape"] == [6]
            assert from_f32_bin(spaces["action_space"]["low"]).tolist() == [-1.0] * 6
            session = RemoteSession(nc, instance, obs_dim=17)
            await session.open([0, 1])
            local = gym.make("HalfCheetah-v5")
            expected, _ = local.reset(seed=0)
            rng = np.random.default_rng(1)
            for _ in range(20):
                actions = rng.uniform(-1.5, 1.5, size=(2, 6)).astype(np.float32)
                reply = await session.step(actions)
                assert reply["errors"] == []
                expected, reward, *_ = local.step(np.clip(actions[0], -1.0, 1.0))
                np.testing.assert_allclose(reply["obs"][0], expected, rtol=1e-5, atol=1e-5)
                assert reply["rewards"][0] == pytest.approx(reward, rel=1e-5, abs=1e-5)

    run(scenario())
