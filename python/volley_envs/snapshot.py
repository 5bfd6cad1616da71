"""Save-load (``snapshot``/``restore``) of served Gymnasium environments, without pickle.

The server picks one adapter per environment at start, from the unwrapped environment's type
and its wrappers (:func:`adapter_for`); without one it declares ``snapshot: false`` and answers
501. A state is a MessagePack map (never pickle, never eval)::

    {"volley_snapshot": 1, "kind": <adapter kind>, "env": <Gymnasium id>,
     "wrappers": [<wrapper class names, outermost first>], "rng": {<PCG64 state>},
     "time_limit": <TimeLimit's elapsed steps or nil>, ...the kind's own fields}

``rng`` is the unwrapped environment's ``np_random`` (PCG64: the 128-bit ``state`` and ``inc``
as 16 little-endian bytes each, ``has_uint32``, ``uinteger``). The kinds:

- ``cartpole``, ``pendulum``, ``acrobot``, ``mountaincar`` (Gymnasium classic control):
  ``state``, the state vector as little-endian float64 bytes, ``state_f32`` whether the
  environment holds it as float32 (Acrobot at an episode's start); CartPole also
  ``steps_beyond_terminated``, Pendulum ``last_u``.
- ``mujoco`` (``gymnasium.envs.mujoco`` environments): ``physics``, MuJoCo's integration state
  (``mj_getState(..., mjSTATE_INTEGRATION)``: time, qpos, qvel, act, qacc_warmstart, ctrl,
  applied forces, ...) as float64 bytes, and ``xpos``/``xipos``, the body positions as the
  last step left them (rewards read them before stepping). Restore sets the state, runs
  ``mj_forward`` and ``mj_rnePostConstraint`` (as the environment's step does), puts the body
  positions back and observes with ``_get_obs()``.
- ``ale`` (``ALE/...`` environments, optionally in ``AtariPreprocessing``): ``ale``, ALE's
  ``cloneState(include_rng=True).serialize()`` (emulator, sticky-action generator, frame
  counters), ``mac``, an HMAC-SHA256 of it, ``last_action``, the last action the server
  stepped the environment with since its episode started (ALE's state leaves out the sticky
  action; restore sets it by acting it before restoring), and the wrapper's ``frames`` (its two max-pooled
  screen buffers), ``lives`` and ``game_over``. ALE's own decoder trusts its input (random
  bytes hang or crash it), so a state is only decoded if its MAC verifies under the server's
  snapshot key: states restore on instances that share the key (``--snapshot-key-file``).

``restore`` checks everything before it touches the environment: the version, the kind, the
id and wrappers, every length and type, finite floats, ranges; anything else is a
:class:`SnapshotError` (the server's 400).
"""

from __future__ import annotations

import hashlib
import hmac
import math
from typing import Optional

import msgpack
import numpy as np

SNAPSHOT_VERSION = 1
# No state of a supported environment comes near this (an RGB Atari state: about 215 KB).
MAX_STATE_BYTES = 1 << 20
# TimeLimit's counter and CartPole's steps_beyond_terminated are at most this.
MAX_COUNTER = 2**53


class SnapshotError(ValueError):
    """A state that this server's environments cannot restore (the server answers 400)."""


def _wrappers(env) -> tuple[list, object]:
    """The wrapper chain of ``env``, outermost first, and the unwrapped environment."""
    chain = []
    while hasattr(env, "env") and env is not getattr(env, "unwrapped", env):
        chain.append(env)
        env = env.env
    return chain, env


def _known_wrappers() -> dict:
    """Wrappers whose state the adapters know: name -> class."""
    from gymnasium.wrappers import AtariPreprocessing, OrderEnforcing, PassiveEnvChecker, TimeLimit

    return {cls.__name__: cls for cls in (TimeLimit, OrderEnforcing, PassiveEnvChecker, AtariPreprocessing)}


# -- field checks: each raises SnapshotError --------------------------------------------------


def _field(state: dict, key: str):
    if key not in state:
        raise SnapshotError(f"state misses {key!r}")
    return state[key]


def _bytes(state: dict, key: str, length: Optional[int] = None) -> bytes:
    value = _field(state, key)
    if not isinstance(value, bytes):
        raise SnapshotError(f"state field {key!r} must be bytes, got {type(value).__name__}")
    if length is not None and len(value) != length:
        raise SnapshotError(f"state field {key!r} has {len(value)} bytes, expected {length}")
    return value


def _count(state: dict, key: str, high: int, optional: bool = False) -> Optional[int]:
    value = _field(state, key)
    if value is None and optional:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= high:
        raise SnapshotError(f"state field {key!r} must be an integer in 0..={high}, got {value!r}")
    return value


def _f64s(state: dict, key: str, n: int) -> np.ndarray:
    values = np.frombuffer(_bytes(state, key, 8 * n), dtype="<f8").astype(np.float64)
    if not np.isfinite(values).all():
        raise SnapshotError(f"state field {key!r} has non-finite values")
    return values


def _f64_bytes(values) -> bytes:
    return np.ascontiguousarray(values, dtype="<f8").tobytes()


# -- the parts every kind has -----------------------------------------------------------------


def _rng_state(generator) -> dict:
    state = generator.bit_generator.state
    inner = state["state"]
    return {
        "state": int(inner["state"]).to_bytes(16, "little"),
        "inc": int(inner["inc"]).to_bytes(16, "little"),
        "has_uint32": int(state["has_uint32"]),
        "uinteger": int(state["uinteger"]),
    }


def _check_rng(rng) -> dict:
    if not isinstance(rng, dict):
        raise SnapshotError("state field 'rng' must be a map")
    has_uint32 = _count(rng, "has_uint32", 1)
    uinteger = _count(rng, "uinteger", 2**32 - 1)
    return {
        "bit_generator": "PCG64",
        "state": {
            "state": int.from_bytes(_bytes(rng, "state", 16), "little"),
            "inc": int.from_bytes(_bytes(rng, "inc", 16), "little"),
        },
        "has_uint32": has_uint32,
        "uinteger": uinteger,
    }


class Adapter:
    """Captures and restores one kind of environment; built once per server from a probe."""

    kind = ""

    def __init__(self, probe):
        chain, unwrapped = _wrappers(probe)
        self.env_id = probe.spec.id if getattr(probe, "spec", None) is not None else type(unwrapped).__name__
        self.wrapper_names = [type(w).__name__ for w in chain]
        self.max_episode_steps = None
        for wrapper in chain:
            if type(wrapper).__name__ == "TimeLimit":
                self.max_episode_steps = int(wrapper._max_episode_steps)

    # Subclasses: the kind's own fields, checked fields, and how to put them in place.

    def _capture(self, env, unwrapped) -> dict:
        raise NotImplementedError

    def _check(self, state: dict) -> dict:
        raise NotImplementedError

    def _apply(self, env, unwrapped, checked: dict):
        """Put the checked fields in place and return the environment's observation."""
        raise NotImplementedError

    # Whether the server must pass the last action since the episode's start to capture()
    # and keep the one restore() returns (ALE: the emulator's sticky action).
    tracks_last_action = False

    def capture(self, env, last_action: int = 0) -> bytes:
        chain, unwrapped = _wrappers(env)
        self._last_action = last_action
        state = {
            "volley_snapshot": SNAPSHOT_VERSION,
            "kind": self.kind,
            "env": self.env_id,
            "wrappers": self.wrapper_names,
            "rng": _rng_state(unwrapped.np_random),
            "time_limit": _time_limit(chain),
        }
        state.update(self._capture(env, unwrapped))
        return msgpack.packb(state, use_bin_type=True)

    def check(self, data) -> dict:
        """Decode and check ``data``; nothing is applied yet."""
        if not isinstance(data, bytes):
            raise SnapshotError(f"state must be bytes, got {type(data).__name__}")
        if len(data) > MAX_STATE_BYTES:
            raise SnapshotError(f"state of {len(data)} bytes exceeds {MAX_STATE_BYTES}")
        try:
            state = msgpack.unpackb(data, raw=False, strict_map_key=True, use_list=True)
        except Exception as exc:  # msgpack raises several types for garbage
            raise SnapshotError(f"state does not decode: {type(exc).__name__}") from None
        if not isinstance(state, dict):
            raise SnapshotError("state is not a map")
        version = state.get("volley_snapshot")
        if version != SNAPSHOT_VERSION or isinstance(version, bool):
            raise SnapshotError(f"state version {version!r} is not {SNAPSHOT_VERSION}")
        if state.get("kind") != self.kind:
            raise SnapshotError(f"state of kind {state.get('kind')!r}, this server's environments are {self.kind!r}")
        if state.get("env") != self.env_id:
            raise SnapshotError(f"state of environment {state.get('env')!r}, this server serves {self.env_id!r}")
        if state.get("wrappers") != self.wrapper_names:
            raise SnapshotError(f"state of wrappers {state.get('wrappers')!r}, expected {self.wrapper_names!r}")
        checked = self._check(state)
        checked["rng"] = _check_rng(_field(state, "rng"))
        limit = self.max_episode_steps
        checked["time_limit"] = _count(state, "time_limit", limit if limit is not None else MAX_COUNTER, optional=True)
        if (checked["time_limit"] is None) != (limit is None):
            raise SnapshotError("state field 'time_limit' does not match the environment's time limit")
        return checked

    def restore(self, env, checked: dict):
        """Apply a state from :meth:`check`; returns the observation."""
        chain, unwrapped = _wrappers(env)
        unwrapped.np_random.bit_generator.state = checked["rng"]
        for wrapper in chain:
            name = type(wrapper).__name__
            if name == "TimeLimit":
                wrapper._elapsed_steps = checked["time_limit"]
            elif name == "OrderEnforcing":
                wrapper._has_reset = True
        return self._apply(env, unwrapped, checked)


def _time_limit(chain) -> Optional[int]:
    for wrapper in chain:
        if type(wrapper).__name__ == "TimeLimit":
            return int(wrapper._elapsed_steps or 0)
    return None


class ClassicControl(Adapter):
    """CartPole, Pendulum, Acrobot, MountainCar: a float64 state vector (and a few scalars)."""

    def __init__(self, probe, kind: str):
        super().__init__(probe)
        self.kind = kind
        unwrapped = probe.unwrapped
        probe.reset(seed=0)
        state = np.asarray(unwrapped.state)
        if state.dtype.kind != "f" or state.ndim != 1:
            raise ValueError(f"{kind} state is {state.dtype}{state.shape}, expected a float vector")
        self.state_len = int(state.size)

    def _capture(self, env, unwrapped) -> dict:
        # Acrobot starts an episode with a float32 state and continues in float64: the dtype
        # travels with the values, so that the arithmetic continues exactly.
        state = np.asarray(unwrapped.state)
        if state.dtype not in (np.float32, np.float64) or state.shape != (self.state_len,):
            raise ValueError(f"{self.kind} state of {state.dtype}{state.shape}")
        fields = {"state": _f64_bytes(state), "state_f32": state.dtype == np.float32}
        if self.kind == "cartpole":
            fields["steps_beyond_terminated"] = unwrapped.steps_beyond_terminated
        elif self.kind == "pendulum":
            last_u = unwrapped.last_u
            fields["last_u"] = None if last_u is None else float(np.asarray(last_u).reshape(-1)[0])
        return fields

    def _check(self, state: dict) -> dict:
        values = _f64s(state, "state", self.state_len)
        f32 = _field(state, "state_f32")
        if not isinstance(f32, bool):
            raise SnapshotError("state field 'state_f32' must be a bool")
        if f32:
            values = values.astype(np.float32)
            if not np.isfinite(values).all():
                raise SnapshotError("state field 'state' has values beyond float32")
        checked = {"state": values}
        if self.kind == "cartpole":
            checked["steps_beyond_terminated"] = _count(state, "steps_beyond_terminated", MAX_COUNTER, optional=True)
        elif self.kind == "pendulum":
            last_u = _field(state, "last_u")
            if last_u is not None and not (isinstance(last_u, float) and math.isfinite(last_u)):
                raise SnapshotError(f"state field 'last_u' must be a finite float or nil, got {last_u!r}")
            checked["last_u"] = last_u
        return checked

    def _apply(self, env, unwrapped, checked: dict):
        unwrapped.state = checked["state"].copy()
        if self.kind == "cartpole":
            unwrapped.steps_beyond_terminated = checked["steps_beyond_terminated"]
            return np.array(unwrapped.state, dtype=np.float32)
        if self.kind == "pendulum":
            unwrapped.last_u = checked["last_u"]
            return unwrapped._get_obs()
        if self.kind == "acrobot":
            return unwrapped._get_ob()
        return np.array(unwrapped.state, dtype=np.float32)


class Mujoco(Adapter):
    """Gymnasium's MuJoCo environments: MuJoCo's full integration state."""

    kind = "mujoco"

    def __init__(self, probe):
        super().__init__(probe)
        import mujoco

        self._mujoco = mujoco
        self._spec = int(mujoco.mjtState.mjSTATE_INTEGRATION)
        self.size = int(mujoco.mj_stateSize(probe.unwrapped.model, self._spec))
        self.n_bodies = int(probe.unwrapped.model.nbody)

    def _capture(self, env, unwrapped) -> dict:
        physics = np.empty(self.size, dtype=np.float64)
        self._mujoco.mj_getState(unwrapped.model, unwrapped.data, physics, self._spec)
        data = unwrapped.data
        return {"physics": _f64_bytes(physics), "xpos": _f64_bytes(data.xpos), "xipos": _f64_bytes(data.xipos)}

    def _check(self, state: dict) -> dict:
        physics = _f64s(state, "physics", self.size)
        if physics[0] < 0:
            raise SnapshotError("state field 'physics' has a negative time")
        shape = (self.n_bodies, 3)
        return {
            "physics": physics,
            "xpos": _f64s(state, "xpos", 3 * self.n_bodies).reshape(shape),
            "xipos": _f64s(state, "xipos", 3 * self.n_bodies).reshape(shape),
        }

    def _apply(self, env, unwrapped, checked: dict):
        mujoco = self._mujoco
        mujoco.mj_setState(unwrapped.model, unwrapped.data, checked["physics"].copy(), self._spec)
        # Derived quantities as the environment's step leaves them (mj_step, then this).
        mujoco.mj_forward(unwrapped.model, unwrapped.data)
        mujoco.mj_rnePostConstraint(unwrapped.model, unwrapped.data)
        # After mj_step the body positions are still those of the step's start (mj_step
        # integrates after computing them), and some environments read them before they step
        # (Ant's, Humanoid's and Reacher's rewards): put those back too.
        unwrapped.data.xpos[...] = checked["xpos"]
        unwrapped.data.xipos[...] = checked["xipos"]
        return unwrapped._get_obs()


class Ale(Adapter):
    """ALE environments, optionally in AtariPreprocessing: the emulator with its generator, the
    wrapper's screen buffers and lives; the emulator's bytes are authenticated (module docs)."""

    kind = "ale"
    MAX_ALE_BYTES = 256 * 1024
    PRIME_FRAMES = 32

    def __init__(self, probe, key: bytes):
        super().__init__(probe)
        if not isinstance(key, bytes) or len(key) < 16:
            raise ValueError("the snapshot key must be at least 16 bytes")
        self._key = key
        chain, _ = _wrappers(probe)
        pre = [w for w in chain if type(w).__name__ == "AtariPreprocessing"]
        self.frame_shapes = [tuple(b.shape) for b in pre[0].obs_buffer] if pre else []
        self.n_actions = len(probe.unwrapped._action_set)

    def _mac(self, ale_state: bytes) -> bytes:
        return hmac.new(self._key, self.env_id.encode() + b"\0" + ale_state, hashlib.sha256).digest()

    tracks_last_action = True

    def _capture(self, env, unwrapped) -> dict:
        ale_state = unwrapped.ale.cloneState(include_rng=True).serialize()
        fields = {"ale": ale_state, "mac": self._mac(ale_state), "last_action": int(self._last_action)}
        pre = _preprocessing(env)
        if pre is not None:
            fields["frames"] = [np.ascontiguousarray(b, dtype=np.uint8).tobytes() for b in pre.obs_buffer]
            fields["lives"] = int(pre.lives)
            fields["game_over"] = bool(pre.game_over)
        return fields

    def _check(self, state: dict) -> dict:
        ale_state = _bytes(state, "ale")
        if len(ale_state) > self.MAX_ALE_BYTES:
            raise SnapshotError(f"state field 'ale' of {len(ale_state)} bytes exceeds {self.MAX_ALE_BYTES}")
        if not hmac.compare_digest(_bytes(state, "mac", 32), self._mac(ale_state)):
            raise SnapshotError("state field 'ale' is not authenticated by this service's snapshot key")
        checked = {"ale": ale_state, "last_action": _count(state, "last_action", self.n_actions - 1)}
        if self.frame_shapes:
            frames = _field(state, "frames")
            if not isinstance(frames, list) or len(frames) != len(self.frame_shapes):
                raise SnapshotError(f"state field 'frames' must be a list of {len(self.frame_shapes)} bins")
            checked["frames"] = []
            for frame, shape in zip(frames, self.frame_shapes):
                if not isinstance(frame, bytes) or len(frame) != int(np.prod(shape)):
                    raise SnapshotError(f"state field 'frames' needs bins of {int(np.prod(shape))} bytes")
                checked["frames"].append(np.frombuffer(frame, dtype=np.uint8).reshape(shape))
            checked["lives"] = _count(state, "lives", 255)
            game_over = _field(state, "game_over")
            if not isinstance(game_over, bool):
                raise SnapshotError("state field 'game_over' must be a bool")
            checked["game_over"] = game_over
        return checked

    def _apply(self, env, unwrapped, checked: dict):
        from ale_py import ALEState

        # ALE's state leaves out the emulator's current (sticky) action, which the next frames
        # repeat with the sticky probability: set it first by acting the snapshot's last action
        # (each frame takes it with probability 1 - 0.25; 32 frames miss it with 0.25^32), then
        # restore, which rewinds the emulator, its generator and counters, not that action.
        for _ in range(self.PRIME_FRAMES):
            unwrapped.ale.act(unwrapped._action_set[checked["last_action"]])
        unwrapped.ale.restoreState(ALEState(checked["ale"]))
        pre = _preprocessing(env)
        if pre is None:
            return unwrapped._get_obs()
        for buffer, frame in zip(pre.obs_buffer, checked["frames"]):
            buffer[...] = frame
        pre.lives = checked["lives"]
        pre.game_over = checked["game_over"]
        # Pooling in place is idempotent: the buffers hold what the last step left there.
        return pre._get_obs()


def _preprocessing(env):
    chain, _ = _wrappers(env)
    for wrapper in chain:
        if type(wrapper).__name__ == "AtariPreprocessing":
            return wrapper
    return None


CLASSIC = {"CartPoleEnv": "cartpole", "PendulumEnv": "pendulum", "AcrobotEnv": "acrobot", "MountainCarEnv": "mountaincar"}


def adapter_for(probe, key: bytes) -> Optional[Adapter]:
    """The adapter for environments like ``probe`` (which may be reset), or None when its state
    cannot be captured safely: an unknown environment type or wrapper, or a generator that is
    not PCG64."""
    try:
        chain, unwrapped = _wrappers(probe)
        known = _known_wrappers()
        if any(known.get(type(w).__name__) is not type(w) for w in chain):
            return None
        if type(unwrapped.np_random.bit_generator) is not np.random.PCG64:
            return None
        cls = type(unwrapped)
        if cls.__module__.startswith("gymnasium.envs.classic_control.") and cls.__name__ in CLASSIC:
            return ClassicControl(probe, CLASSIC[cls.__name__])
        if cls.__module__.startswith("gymnasium.envs.mujoco."):
            from gymnasium.envs.mujoco.mujoco_env import MujocoEnv

            if isinstance(unwrapped, MujocoEnv):
                return Mujoco(probe)
        if cls.__module__ == "ale_py.env" and cls.__name__ == "AtariEnv":
            return Ale(probe, key)
    except Exception as exc:  # anything unexpected: no save-load rather than no server
        import logging

        logging.getLogger("volley_envs").warning("no snapshot adapter: %s: %s", type(exc).__name__, exc)
        return None
    return None
