"""Image observations, protocol version 3: a tiny uint8 (H, W, 3) environment defined here and
Atari Pong (``atari:Pong``, ale-py), each against a real nats-server."""

from __future__ import annotations

import asyncio
import signal

import gymnasium as gym
import nats
import numpy as np
import pytest
from gymnasium import spaces

from volley_envs.client import RemoteSession, call, discover, is_image
from volley_envs.protocol import ProtocolError, from_f32_bin
from volley_envs.server import EnvServer, image_shape, make_factory

H, W = 5, 7


def run(coro):
    return asyncio.run(coro)



class Pixels(gym.Env):
    """RGB frames of H x W whose bytes depend on the seed, the step and the action; an episode
    ends (terminated) after 4 steps. The action 3 raises, to fail the environment."""

    observation_space = spaces.Box(0, 255, (H, W, 3), np.uint8)
    action_space = spaces.Discrete(4)

    def _frame(self):
        values = self.base + self.t * 37 + self.last * 11 + np.arange(H * W * 3)
        return (values % 256).astype(np.uint8).reshape(H, W, 3)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.base = int(self.np_random.integers(0, 256))
        self.t, self.last = 0, 0
        return self._frame(), {}

    def step(self, action):
        if action == 3:
            raise RuntimeError("kaboom")
        self.t += 1
        self.last = int(action)
        return self._frame(), float(action), self.t == 4, False, {}


def chw(frame) -> np.ndarray:
    """What the server sends for one (H, W, C) frame: its bytes in C, H, W order."""
    return np.asarray(frame, dtype=np.uint8).transpose(2, 0, 1).reshape(-1)


def test_which_boxes_are_images():
    assert image_shape(spaces.Box(0, 255, (84, 84), np.uint8)) == (1, 84, 84)
    assert image_shape(spaces.Box(0, 255, (H, W, 3), np.uint8)) == (3, H, W)
    assert image_shape(spaces.Box(0, 255, (H, W, 1), np.uint8)) == (1, H, W)
    assert image_shape(spaces.Box(0, 255, (H, W, 4), np.uint8)) == (4, H, W)
    # Anything else stays a float vector.
    assert image_shape(spaces.Box(0, 255, (H, W, 2), np.uint8)) is None
    assert image_shape(spaces.Box(0, 255, (8,), np.uint8)) is None
    assert image_shape(spaces.Box(0, 255, (2, H, W, 3), np.uint8)) is None
    assert image_shape(spaces.Box(0, 1, (H, W), np.uint8)) is None
    assert image_shape(spaces.Box(0.0, 255.0, (H, W), np.float32)) is None


def test_an_image_env_sends_chw_bytes_and_refuses_version_2(serve):
    async def scenario():
        server = EnvServer(Pixels, "pixels")
        async with serve(server) as served:
            nc, instance = served.nc, served.instance
            assert instance.protocol == 3
            reply = await call(nc, instance, "spaces", {})
            assert reply["obs_space"] == {"kind": "image", "shape": [3, H, W], "dtype": "u8"}
            dim = 3 * H * W
            assert reply["obs_dim"] == dim and reply["n_actions"] == 4
            assert from_f32_bin(reply["obs_low"]).tolist() == [0.0] * dim
            assert from_f32_bin(reply["obs_high"]).tolist() == [255.0] * dim
            assert is_image(reply)

            # Version 2 cannot carry image observations: 505, naming version 3.
            for v in (1, 2):
                old = type(instance)(id=instance.id, subjects=instance.subjects, protocol=v)
                for op, request in (("spaces", {}), ("open", {"n_envs": 1, "seeds": [0]})):
                    with pytest.raises(ProtocolError) as err:
                        await call(nc, old, op, request)
                    assert err.value.code == 505
                    assert "image observations need protocol version 3" in err.value.message

            # The wire: one byte per value, each row the frame transposed to C, H, W.
            seeds = [3, 4]
            opened = await call(nc, instance, "open", {"n_envs": 2, "seeds": seeds})
            assert isinstance(opened["obs"], bytes) and len(opened["obs"]) == 2 * dim
            local = [Pixels() for _ in seeds]
            expected = [env.reset(seed=seed)[0] for env, seed in zip(local, seeds)]
            assert opened["obs"] == b"".join(chw(frame).tobytes() for frame in expected)
            stepped = await call(nc, instance, "step", {"session": opened["session"], "actions": [1, 2]})
            assert len(stepped["obs"]) == 2 * dim and stepped["final_obs"] == b""
            await call(nc, instance, "close", {"session": opened["session"]})

            # Through the client, with auto-reset: final rows are the frames that ended the episodes.
            session = RemoteSession.for_spaces(nc, instance, reply)
            obs = await session.open(seeds)
            assert obs.dtype == np.uint8 and obs.shape == (2, dim)
            local = [Pixels() for _ in seeds]
            expected = np.stack([chw(env.reset(seed=seed)[0]) for env, seed in zip(local, seeds)])
            assert np.array_equal(obs, expected)
            n_final = 0
            for step_idx in range(9):
                actions = [(step_idx + i) % 3 for i in range(2)]
                reply_step = await session.step(actions)
                finals = []
                for i, (env, action) in enumerate(zip(local, actions)):
                    frame, reward, term, trunc, _ = env.step(action)
                    assert reply_step["terminated"][i] == term and reply_step["rewards"][i] == reward
                    if term or trunc:
                        finals.append(chw(frame))
                        frame, _ = env.reset()
                    expected[i] = chw(frame)
                assert np.array_equal(reply_step["obs"], expected), step_idx
                assert reply_step["final_obs"].dtype == np.uint8
                assert np.array_equal(reply_step["final_obs"], np.array(finals, np.uint8).reshape(-1, dim))
                n_final += len(finals)
            assert n_final == 4

            # A failing environment: its last valid frame is its final row, as bytes.
            before = (await session.step([0, 0]))["obs"]
            failed = await session.step([3, 0])
            assert [e["env"] for e in failed["errors"]] == [0] and failed["truncated"][0]
            assert np.array_equal(failed["final_obs"], before[:1])
            reset = await session.reset([7, None])
            assert np.array_equal(reset[0], chw(Pixels().reset(seed=7)[0]))
            await session.close()

    run(scenario())


def test_a_vector_env_still_sends_floats_to_every_version(serve):
    async def scenario():
        server = EnvServer(make_factory("gymnasium:CartPole-v1"), "cp-box")
        async with serve(server) as served:
            nc, instance = served.nc, served.instance
            for v in (1, 2, 3):
                versioned = type(instance)(id=instance.id, subjects=instance.subjects, protocol=v)
                reply = await call(nc, versioned, "spaces", {})
                assert reply["obs_space"] == {"kind": "box"} and not is_image(reply)
                opened = await call(nc, versioned, "open", {"n_envs": 2, "seeds": [1, 2]})
                assert len(opened["obs"]) == 2 * 4 * 4
                await call(nc, versioned, "close", {"session": opened["session"]})

    run(scenario())


def atari_pong(**kwargs):
    return make_factory("atari:Pong", kwargs)()


def test_atari_pong_serves_84x84_grayscale_frames(serve):
    async def scenario():
        server = EnvServer(make_factory("atari:Pong"), "pong", label="atari:Pong")
        async with serve(server) as served:
            nc, instance = served.nc, served.instance
            spaces_reply = await call(nc, instance, "spaces", {})
            assert spaces_reply["obs_space"] == {"kind": "image", "shape": [1, 84, 84], "dtype": "u8"}
            assert spaces_reply["obs_dim"] == 7056
            assert spaces_reply["n_actions"] == 6
            assert spaces_reply["action_space"] == {"kind": "discrete", "n": 6}
            assert spaces_reply["max_episode_steps"] == 27000
            assert spaces_reply["max_abs_reward"] is None and spaces_reply["snapshot"] is True
            session = RemoteSession.for_spaces(nc, instance, spaces_reply)
            seeds = [0, 1]
            obs = await session.open(seeds)
            assert obs.shape == (2, 7056) and obs.dtype == np.uint8
            # The same frames as the wrapped environment stepped here (sticky actions included).
            local = atari_pong()
            frame, _ = local.reset(seed=seeds[0])
            assert np.array_equal(obs[0], frame.reshape(-1))
            rng = np.random.default_rng(0)
            for _ in range(50):
                actions = rng.integers(0, 6, size=2).tolist()
                raw = await call(nc, instance, "step", {"session": session.session, "actions": actions})
                assert isinstance(raw["obs"], bytes) and len(raw["obs"]) == 2 * 7056
                rewards = from_f32_bin(raw["rewards"])
                assert rewards.shape == (2,) and np.all(np.isfinite(rewards))
                assert raw["errors"] == []
                frame, reward, term, trunc, _ = local.step(actions[0])
                assert raw["obs"][:7056] == frame.tobytes() and rewards[0] == reward
            await session.close()
            local.close()

    run(scenario())


def test_atari_env_kwargs_go_to_make_or_to_the_wrapper():
    env = atari_pong(terminal_on_life_loss=True, repeat_action_probability=0.0, noop_max=0)
    try:
        assert env.terminal_on_life_loss is True and env.noop_max == 0 and env.frame_skip == 4
        assert env.unwrapped.ale.getFloat("repeat_action_probability") == 0.0
        assert env.spec.kwargs["frameskip"] == 1 and env.spec.kwargs["full_action_space"] is False
    finally:
        env.close()
    # Colour frames are images too, with 3 channels; a limit of frames sets the episode steps.
    server = EnvServer(make_factory("atari:Pong", {"grayscale_obs": False, "max_num_frames_per_episode": 4000}), "pong")
    assert server.spaces.image_shape == (3, 84, 84) and server.spaces.max_episode_steps == 1000
    with pytest.raises(ValueError, match="atari game"):
        make_factory("atari:ALE/Pong-v5")


def test_the_command_line_serves_atari_as_pong(nats_url, serve_command, tls_context):
    with serve_command("atari:Pong", "--env-kwargs", '{"terminal_on_life_loss": true}') as (process, line):
        assert "service=volley-env-pong " in line and "image[1, 84, 84]:u8" in line

        async def scenario():
            nc = await nats.connect(nats_url, tls=tls_context)
            (instance,) = await discover(nc, "pong")
            assert (await call(nc, instance, "spaces", {}))["env"] == "atari:Pong"
            opened = await call(nc, instance, "open", {"n_envs": 1, "seeds": [5]})
            assert len(opened["obs"]) == 7056
            await nc.close()

        run(scenario())
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0
