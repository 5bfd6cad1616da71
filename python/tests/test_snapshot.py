"""Save-load through the service (``snapshot``/``restore``, volley_envs.snapshot): a state taken
from one environment continues bit for bit in another one, of the same session or of a new
one, for CartPole, a MuJoCo environment and Atari Pong; hostile states are refused with 400."""

from __future__ import annotations

import asyncio

import gymnasium as gym
import msgpack
import numpy as np
import pytest

from volley_envs.client import RemoteSession, call
from volley_envs.protocol import ProtocolError, f32_bin
from volley_envs.server import EnvServer, make_factory
from volley_envs.snapshot import MAX_STATE_BYTES, SNAPSHOT_VERSION

ENVS = [
    ("gymnasium:CartPole-v1", "cartpole"),
    ("gymnasium:HalfCheetah-v5", "mujoco"),
    ("gymnasium:Hopper-v5", "mujoco"),
    ("atari:Pong", "ale"),
]
REPLAY_STEPS = 30


def run(coro):
    return asyncio.run(coro)


def actions_for(spaces: dict, rng: np.random.Generator, n_envs: int, steps: int):
    """``steps`` step requests' actions for ``n_envs`` environments."""
    action = spaces["action_space"]
    if action["kind"] == "discrete":
        return [rng.integers(0, action["n"], size=n_envs).tolist() for _ in range(steps)]
    dim = int(np.prod(action["shape"]))
    return [rng.uniform(-1.0, 1.0, size=(n_envs, dim)).astype(np.float32) for _ in range(steps)]


def one_row(actions, row: int, n_envs: int, at: int):
    """A request's actions for ``n_envs`` environments: ``row`` of ``actions`` at ``at``, the
    action 0 (or zeros) elsewhere."""
    if isinstance(actions, list):
        out = [0] * n_envs
        out[at] = actions[row]
        return out
    out = np.zeros((n_envs, actions.shape[1]), dtype=np.float32)
    out[at] = actions[row]
    return out


async def replay(session: RemoteSession, env_idx: int, recorded_actions) -> list:
    """Step environment ``env_idx`` with row 0 of each recorded request; its trajectory."""
    trajectory = []
    for actions in recorded_actions:
        reply = await session.step(one_row(actions, 0, session.n_envs, env_idx))
        assert reply["errors"] == [], reply["errors"]
        ended = reply["terminated"][env_idx] or reply["truncated"][env_idx]
        trajectory.append(
            (
                reply["obs"][env_idx].tobytes(),
                float(reply["rewards"][env_idx]),
                reply["terminated"][env_idx],
                reply["truncated"][env_idx],
                ended,
            )
        )
    return trajectory


@pytest.mark.parametrize("spec,kind", ENVS, ids=[spec for spec, _ in ENVS])
def test_a_restored_state_continues_bit_for_bit(serve, spec, kind):
    async def scenario():
        server = EnvServer(make_factory(spec), "snap", label=spec)
        async with serve(server) as served:
            nc, instance = served.nc, served.instance
            spaces = await call(nc, instance, "spaces", {})
            assert spaces["snapshot"] is True
            session = RemoteSession.for_spaces(nc, instance, spaces)
            await session.open([11, 12])
            rng = np.random.default_rng(5)
            for actions in actions_for(spaces, rng, 2, 25):
                reply = await session.step(actions)
                assert reply["errors"] == []
            at_snapshot = reply["obs"][0].copy()
            state = (await call(nc, instance, "snapshot", {"session": session.session, "env": 0}))["state"]
            decoded = msgpack.unpackb(state, raw=False)
            assert decoded["volley_snapshot"] == SNAPSHOT_VERSION and decoded["kind"] == kind
            recorded = actions_for(spaces, np.random.default_rng(9), 1, REPLAY_STEPS)
            reference = await replay(session, 0, recorded)
            assert len(reference) == REPLAY_STEPS

            # Into env 1 of the same session: the observation at the snapshot, then the same steps.
            restored = await call(nc, instance, "restore", {"session": session.session, "env": 1, "state": state})
            assert session._obs(restored["obs"], 1)[0].tobytes() == at_snapshot.tobytes()
            assert await replay(session, 1, recorded) == reference

            # Into a new session, over an environment that has run its own episode.
            fresh = RemoteSession.for_spaces(nc, instance, spaces)
            await fresh.open([99])
            for actions in actions_for(spaces, rng, 1, 3):
                await fresh.step(actions)
            restored = await call(nc, instance, "restore", {"session": fresh.session, "env": 0, "state": state})
            assert fresh._obs(restored["obs"], 1)[0].tobytes() == at_snapshot.tobytes()
            assert await replay(fresh, 0, recorded) == reference
            # Twice from the same state: the same again.
            await call(nc, instance, "restore", {"session": fresh.session, "env": 0, "state": state})
            assert await replay(fresh, 0, recorded) == reference

            await session.close()
            await fresh.close()

    run(scenario())


def hostile_states(good: bytes) -> list:
    """States that must be refused (400) by the server that made ``good``."""
    state = msgpack.unpackb(good, raw=False)

    def edit(**changes):
        edited = dict(state)
        for key, value in changes.items():
            if value is KeyError:
                edited.pop(key)
            else:
                edited[key] = value
        return msgpack.packb(edited, use_bin_type=True)

    rng = np.random.default_rng(3)
    out = [
        b"",
        b"\xc1",
        good[: len(good) // 2],
        good[:-1],
        rng.integers(0, 256, 3000, dtype=np.uint8).tobytes(),
        msgpack.packb([1, 2, 3]),
        msgpack.packb({}),
        edit(volley_snapshot=2),
        edit(volley_snapshot=True),
        edit(kind="ale" if state["kind"] != "ale" else "cartpole"),
        edit(env="Other-v0"),
        edit(wrappers=["TimeLimit"]),
        edit(rng=KeyError),
        edit(rng={**state["rng"], "state": b"\x00" * 15}),
        edit(rng={**state["rng"], "has_uint32": 2}),
        edit(rng={**state["rng"], "uinteger": -1}),
        edit(rng="PCG64"),
        edit(time_limit=-1),
        edit(time_limit=10**9),
        edit(time_limit="3"),
    ]
    nan = np.float64("nan").tobytes()
    kind = state["kind"]
    if kind in ("cartpole", "pendulum", "acrobot", "mountaincar"):
        out += [
            edit(state=state["state"][:-8]),
            edit(state=state["state"] + b"\x00" * 8),
            edit(state=nan + state["state"][8:]),
            edit(state=[0.0, 0.0, 0.0, 0.0]),
            edit(state_f32=1),
            edit(steps_beyond_terminated=-3),
            edit(steps_beyond_terminated=1.5),
        ]
    if kind == "mujoco":
        out += [
            edit(physics=state["physics"][:-8]),
            edit(physics=state["physics"][:8] + nan + state["physics"][16:]),
            edit(physics=np.float64(-1.0).tobytes() + state["physics"][8:]),
            edit(xpos=state["xpos"] + b"\x00"),
            edit(xipos=KeyError),
        ]
    if kind == "ale":
        ale_state = state["ale"]
        flipped = bytearray(ale_state)
        flipped[len(flipped) // 2] ^= 0xFF
        out += [
            # The emulator's bytes are only decoded when their MAC verifies: random or edited
            # bytes never reach ALE's decoder (random bytes hang it).
            edit(ale=bytes(flipped)),
            edit(ale=rng.integers(0, 256, len(ale_state), dtype=np.uint8).tobytes()),
            edit(mac=b"\x00" * 32),
            edit(mac=KeyError),
            edit(ale=b"\x00" * 300_000),
            edit(frames=[state["frames"][0]]),
            edit(frames=[state["frames"][0], state["frames"][1][:-1]]),
            edit(frames="frames"),
            edit(lives=256),
            edit(game_over=0),
        ]
    return out


@pytest.mark.parametrize("spec", ["gymnasium:CartPole-v1", "gymnasium:Hopper-v5", "atari:Pong"])
def test_garbage_truncated_and_foreign_states_are_400(serve, spec):
    async def scenario():
        server = EnvServer(make_factory(spec), "hostile", label=spec)
        other = EnvServer(make_factory("gymnasium:Pendulum-v1"), "other")
        async with serve(server, other) as served:
            nc, (instance, other_instance) = served.nc, served.instances
            opened = await call(nc, instance, "open", {"n_envs": 2, "seeds": [1, 2]})
            session = opened["session"]
            good = (await call(nc, instance, "snapshot", {"session": session, "env": 0}))["state"]
            other_session = (await call(nc, other_instance, "open", {"n_envs": 1, "seeds": [0]}))["session"]
            foreign = (await call(nc, other_instance, "snapshot", {"session": other_session, "env": 0}))["state"]
            states = hostile_states(good) + [foreign, 5, None, "state", [good]]
            for index, state in enumerate(states):
                with pytest.raises(ProtocolError) as err:
                    await call(nc, instance, "restore", {"session": session, "env": 1, "state": state})
                assert err.value.code == 400, (index, err.value)
            # Over the size limit (more than NATS carries by default, so straight to the handler).
            oversized = msgpack.packb({"v": 3, "session": session, "env": 1, "state": b"\x00" * (MAX_STATE_BYTES + 1)})
            with pytest.raises(ProtocolError) as err:
                server.handle("restore", oversized)
            assert err.value.code == 400 and "exceeds" in err.value.message
            # Out-of-range and malformed environment indices.
            for env in (2, -1, "0", None):
                for op, extra in (("snapshot", {}), ("restore", {"state": good})):
                    with pytest.raises(ProtocolError) as err:
                        await call(nc, instance, op, {"session": session, "env": env, **extra})
                    assert err.value.code == 400
            with pytest.raises(ProtocolError) as err:
                await call(nc, instance, "restore", {"session": session + 1000, "env": 0, "state": good})
            assert err.value.code == 404
            # The environments still work, and the good state still restores.
            await call(nc, instance, "restore", {"session": session, "env": 1, "state": good})
            actions = [0, 0] if spec != "gymnasium:Hopper-v5" else f32_bin(np.zeros((2, 3)))
            assert (await call(nc, instance, "step", {"session": session, "actions": actions}))["errors"] == []

    run(scenario())


def test_an_ale_state_restores_only_where_the_key_is_shared(serve):
    async def scenario():
        key = b"k" * 32
        a = EnvServer(make_factory("atari:Pong"), "pong-a", snapshot_key=key)
        b = EnvServer(make_factory("atari:Pong"), "pong-b", snapshot_key=key)
        c = EnvServer(make_factory("atari:Pong"), "pong-c")
        async with serve(a, b, c) as served:
            nc = served.nc
            instances = {server.name: instance for server, instance in zip((a, b, c), served.instances)}
            sessions = {
                name: (await call(nc, instance, "open", {"n_envs": 1, "seeds": [4]}))["session"]
                for name, instance in instances.items()
            }
            state = (await call(nc, instances["pong-a"], "snapshot", {"session": sessions["pong-a"], "env": 0}))["state"]
            await call(nc, instances["pong-b"], "restore", {"session": sessions["pong-b"], "env": 0, "state": state})
            with pytest.raises(ProtocolError) as err:
                await call(nc, instances["pong-c"], "restore", {"session": sessions["pong-c"], "env": 0, "state": state})
            assert err.value.code == 400 and "snapshot key" in err.value.message

    run(scenario())


class Opaque(gym.Env):
    """An environment no adapter knows."""

    observation_space = gym.spaces.Box(-1.0, 1.0, (2,), np.float32)
    action_space = gym.spaces.Discrete(2)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return np.zeros(2, np.float32), {}

    def step(self, action):
        return np.zeros(2, np.float32), 0.0, False, False, {}


def test_an_env_without_an_adapter_declares_no_snapshot_and_answers_501(serve):
    async def scenario():
        wrapped = EnvServer(
            lambda: gym.wrappers.RecordEpisodeStatistics(gym.make("CartPole-v1")), "unknown-wrapper"
        )
        opaque = EnvServer(Opaque, "opaque")
        for server in (wrapped, opaque):
            async with serve(server) as served:
                nc, instance = served.nc, served.instance
                assert (await call(nc, instance, "spaces", {}))["snapshot"] is False
                session = (await call(nc, instance, "open", {"n_envs": 1, "seeds": [0]}))["session"]
                for op, request in (("snapshot", {}), ("restore", {"state": b"x"})):
                    with pytest.raises(ProtocolError) as err:
                        await call(nc, instance, op, {"session": session, "env": 0, **request})
                    assert err.value.code == 501

    run(scenario())


@pytest.mark.parametrize("env_id", ["Pendulum-v1", "Acrobot-v1", "MountainCar-v0", "Ant-v5"])
def test_other_classic_control_and_mujoco_envs_continue_bit_for_bit(env_id):
    """The same without the network (``EnvServer.handle``), for the other adapters."""
    server = EnvServer(make_factory(f"gymnasium:{env_id}"), "local")
    assert server.snapshots is not None

    def handle(op, **request):
        return msgpack.unpackb(server.handle(op, msgpack.packb({"v": 3, **request}, use_bin_type=True)), raw=False)

    session = handle("open", n_envs=2, seeds=[1, 2])["session"]
    spaces = handle("spaces")
    rng = np.random.default_rng(0)

    def wire(actions):
        return actions if isinstance(actions, list) else actions.astype("<f4").tobytes()

    for actions in actions_for(spaces, rng, 2, 7):
        handle("step", session=session, actions=wire(actions))
    state = handle("snapshot", session=session, env=0)["state"]
    recorded = actions_for(spaces, rng, 1, REPLAY_STEPS)

    row = 4 * server.spaces.obs_dim

    def trajectory(env_idx):
        out = []
        for actions in recorded:
            reply = handle("step", session=session, actions=wire(one_row(actions, 0, 2, env_idx)))
            assert reply["errors"] == []
            out.append((
                reply["obs"][env_idx * row:(env_idx + 1) * row],
                reply["rewards"][4 * env_idx:4 * env_idx + 4],
                reply["terminated"][env_idx],
                reply["truncated"][env_idx],
            ))
        return out

    reference = trajectory(0)
    handle("restore", session=session, env=1, state=state)
    assert trajectory(1) == reference
