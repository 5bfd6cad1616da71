"""An environment server: any Gymnasium environment as one instance of ``volley-env-<name>``.

A session is a list of environments stepped in one request (vector batching): the server
steps each, resets those whose episode ended (auto-reset) and returns all observations,
rewards and flags in one reply, the last observation of every ended episode in ``final_obs``.

Actions are ``Discrete`` (one integer per environment) or ``Box`` (protocol version 2:
``n_envs x action_dim`` little-endian float32s). A non-finite Box action fails its environment
(reported in ``errors``); a finite one outside the bounds is clipped to them, as Gymnasium's
MuJoCo environments and Pendulum do themselves (docs/ENV_PROTOCOL.md, "Continuous actions").

Observations are flat ``float32`` vectors, or (protocol version 3) images: a ``uint8`` Box with
bounds 0 and 255 of shape ``(H, W)`` or ``(H, W, C)`` with C in {1, 3, 4} travels as one byte
per value, each observation transposed to C,H,W. ``atari:<Game>`` serves ``ALE/<Game>-v5``
with the standard Atari preprocessing (84x84 grayscale, frame skip 4, sticky actions).
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import logging
import math
import os
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np
from nats.micro import add_service
from nats.micro.request import Request

from . import __version__
from .protocol import (
    ACTION_BOX,
    ACTION_DISCRETE,
    BAD_REQUEST,
    CAPACITY,
    IMAGE_PROTOCOL_VERSION,
    INTERNAL,
    METADATA_ENV,
    METADATA_PROTOCOL,
    MIN_PROTOCOL_VERSION,
    OBS_BOX,
    OBS_DTYPE_U8,
    OBS_IMAGE,
    OPS,
    PROTOCOL_VERSION,
    UNKNOWN_SESSION,
    UNSUPPORTED,
    UNSUPPORTED_VERSION,
    ProtocolError,
    check_name,
    endpoint_subject,
    f32_bin,
    from_f32_bin,
    pack,
    service_name,
    u8_bin,
    unpack,
)
from .snapshot import Adapter, SnapshotError, adapter_for

log = logging.getLogger("volley_envs")

EnvFactory = Callable[[], object]


# `atari:<Game>`: ALE/<Game>-v5 with the standard preprocessing of the v5 environments: sticky
# actions (0.25), the minimal action set, frame skip 4 with max-pooling over the last two frames,
# 84x84 grayscale, up to 30 no-op starts, no episodic life. Single frames: actors stack them.
ATARI_MAKE_DEFAULTS = {"frameskip": 1, "repeat_action_probability": 0.25, "full_action_space": False}
ATARI_WRAPPER_DEFAULTS = {
    "noop_max": 30,
    "frame_skip": 4,
    "screen_size": 84,
    "terminal_on_life_loss": False,
    "grayscale_obs": True,
    "scale_obs": False,
}


def atari_factory(game: str, kwargs: Optional[dict] = None) -> EnvFactory:
    """A factory for ``ALE/<game>-v5`` in ``gymnasium.wrappers.AtariPreprocessing``.

    Each key of ``kwargs`` overrides a default of the wrapper if the wrapper takes it (e.g.
    ``terminal_on_life_loss``, ``noop_max``), else of ``gymnasium.make`` (e.g.
    ``repeat_action_probability``, ``max_num_frames_per_episode``)."""
    if not game.isascii() or not game.isalnum():
        raise ValueError(f"atari game {game!r}: expected a name such as Pong or Breakout")
    import gymnasium
    from gymnasium.wrappers import AtariPreprocessing

    try:
        import ale_py
    except ImportError as exc:
        raise ValueError(
            f"atari:{game} needs the ale-py package (pip install 'volley-envs[atari]'): {exc}"
        ) from None
    gymnasium.register_envs(ale_py)
    wrapper_keys = set(inspect.signature(AtariPreprocessing.__init__).parameters) - {"self", "env"}
    make_kwargs, wrapper_kwargs = dict(ATARI_MAKE_DEFAULTS), dict(ATARI_WRAPPER_DEFAULTS)
    for key, value in (kwargs or {}).items():
        (wrapper_kwargs if key in wrapper_keys else make_kwargs)[key] = value
    env_id = f"ALE/{game}-v5"
    return lambda: AtariPreprocessing(gymnasium.make(env_id, **make_kwargs), **wrapper_kwargs)


def make_factory(spec: str, kwargs: Optional[dict] = None) -> EnvFactory:
    """A factory for ``gymnasium:<id>`` (``gymnasium.make``), ``atari:<Game>`` (see
    :func:`atari_factory`) or ``<module>:<callable>``."""
    kwargs = dict(kwargs or {})
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"environment {spec!r}: expected gymnasium:<id>, atari:<Game> or <module>:<callable>")
    if module_name == "atari":
        return atari_factory(attr, kwargs)
    if module_name == "gymnasium":
        import gymnasium

        return lambda: gymnasium.make(attr, **kwargs)
    target = getattr(importlib.import_module(module_name), attr)
    return lambda: target(**kwargs)


@dataclass
class Spaces:
    """What every environment of the server looks like."""

    obs_dim: int
    obs_low: np.ndarray
    obs_high: np.ndarray
    # Discrete: the number of actions and the first one (Gymnasium's ``start``); 0 for a Box.
    n_actions: int
    action_start: int
    reward_threshold: Optional[float]
    max_episode_steps: Optional[int]
    # Box: the action's shape, flat bounds and dtype; None for Discrete.
    action_shape: Optional[tuple] = None
    action_low: Optional[np.ndarray] = None
    action_high: Optional[np.ndarray] = None
    action_dtype: Optional[np.dtype] = None
    # The observation space's shape as the environment returns it, and for an image (protocol
    # version 3) the shape it travels in, [C, H, W]; None for a vector.
    obs_shape: tuple = ()
    image_shape: Optional[tuple] = None

    @property
    def continuous(self) -> bool:
        return self.action_shape is not None

    @property
    def image(self) -> bool:
        return self.image_shape is not None

    @property
    def min_version(self) -> int:
        """The oldest protocol version that can describe these spaces."""
        if self.image:
            return IMAGE_PROTOCOL_VERSION
        return 2 if self.continuous else MIN_PROTOCOL_VERSION

    @property
    def action_dim(self) -> int:
        """Values per action: 1 for Discrete (one integer), ``prod(shape)`` for a Box."""
        return int(np.prod(self.action_shape)) if self.continuous else 1

    @staticmethod
    def probe(env) -> "Spaces":
        """Read the spaces of a Gymnasium environment; refuse what the protocol cannot carry."""
        from gymnasium import spaces

        obs_space, act_space = env.observation_space, env.action_space
        if not isinstance(obs_space, spaces.Box):
            raise ValueError(f"observation space {obs_space} is not a Box")
        box = None
        if isinstance(act_space, spaces.Box):
            low = np.asarray(act_space.low, dtype=np.float32).reshape(-1)
            high = np.asarray(act_space.high, dtype=np.float32).reshape(-1)
            # Volley's Gaussian policy needs a bounded box to clip into (docs/ENV_PROTOCOL.md).
            if low.size == 0 or not (np.isfinite(low).all() and np.isfinite(high).all() and (low <= high).all()):
                raise ValueError(f"action space {act_space} is not a non-empty Box with finite bounds, low <= high")
            box = (tuple(int(d) for d in act_space.shape), low, high, np.dtype(act_space.dtype))
        elif not isinstance(act_space, spaces.Discrete):
            raise ValueError(f"action space {act_space} is neither Discrete nor Box")
        spec = getattr(env, "spec", None)
        threshold = getattr(spec, "reward_threshold", None)
        max_steps = getattr(spec, "max_episode_steps", None)
        if max_steps is None:
            max_steps = _ale_max_episode_steps(spec)
        return Spaces(
            obs_dim=int(np.prod(obs_space.shape)),
            obs_low=np.asarray(obs_space.low, dtype=np.float32).reshape(-1),
            obs_high=np.asarray(obs_space.high, dtype=np.float32).reshape(-1),
            n_actions=0 if box else int(act_space.n),
            action_start=0 if box else int(getattr(act_space, "start", 0)),
            reward_threshold=float(threshold) if threshold is not None and math.isfinite(threshold) else None,
            max_episode_steps=int(max_steps) if max_steps is not None else None,
            action_shape=box[0] if box else None,
            action_low=box[1] if box else None,
            action_high=box[2] if box else None,
            action_dtype=box[3] if box else None,
            obs_shape=tuple(int(d) for d in obs_space.shape),
            image_shape=image_shape(obs_space),
        )


def image_shape(obs_space) -> Optional[tuple]:
    """``(C, H, W)`` if the Box ``obs_space`` is an image (protocol version 3): dtype uint8,
    bounds 0 and 255, shape ``(H, W)`` or ``(H, W, C)`` with C in {1, 3, 4}; else None."""
    shape = tuple(int(d) for d in obs_space.shape)
    if np.dtype(obs_space.dtype) != np.uint8 or 0 in shape:
        return None
    if not (np.all(obs_space.low == 0) and np.all(obs_space.high == 255)):
        return None
    if len(shape) == 2:
        return (1, *shape)
    if len(shape) == 3 and shape[2] in (1, 3, 4):
        return (shape[2], shape[0], shape[1])
    return None


def _ale_max_episode_steps(spec) -> Optional[int]:
    """The agent steps an ALE episode can last: its frame limit (v5: 108,000 frames, 30 minutes
    at 60 Hz) over the frames of one step (the environment's frameskip times the frame_skip of
    an ``AtariPreprocessing`` wrapper). None for other environments, or without a limit."""
    kwargs = getattr(spec, "kwargs", None) or {}
    frames = kwargs.get("max_num_frames_per_episode")
    if not isinstance(frames, int) or isinstance(frames, bool) or frames <= 0:
        return None
    skip = kwargs.get("frameskip", 1)
    # Stochastic frame skip (a (low, high) range in v0/v4 ids): the fewest frames per step.
    skip = min(skip) if isinstance(skip, (tuple, list)) else skip
    if not isinstance(skip, int) or skip < 1:
        return None
    for wrapper in getattr(spec, "additional_wrappers", None) or ():
        if getattr(wrapper, "name", None) == "AtariPreprocessing":
            wrapper_skip = (getattr(wrapper, "kwargs", None) or {}).get("frame_skip", 1)
            if isinstance(wrapper_skip, int) and wrapper_skip >= 1:
                skip *= wrapper_skip
    return -(-frames // skip)


@dataclass
class Session:
    """Environments stepped together, their current observations and last use."""

    envs: list
    obs: np.ndarray
    last_used: float = field(default_factory=time.monotonic)
    # Per environment, the last action it was stepped with since its episode started (0 after
    # a reset), for snapshot adapters that need it (ALE's sticky action); else unused.
    last_actions: list = field(default_factory=list)


# Default limits, sized to a pod of about 1 GiB serving light environments (docs/OPERATIONS.md,
# "Sizing an environment server"): the memory a server holds is about its open environments
# times the memory of one, so `max_envs` bounds it; `max_sessions` bounds the per-session
# overhead and `max_envs_per_session` one actor's share. The old defaults (1,024 sessions of up
# to 1,024 environments) let one server grow to several GB (issue 46).
DEFAULT_MAX_SESSIONS = 64
DEFAULT_MAX_ENVS_PER_SESSION = 64
DEFAULT_MAX_ENVS = 256
# Seconds after which a session without requests is dropped, freeing its slots.
DEFAULT_IDLE_TIMEOUT_SECS = 300.0


class EnvServer:
    """Serves environments built by ``factory`` as environment service ``name``.

    At most ``max_sessions`` sessions and ``max_envs`` environments over all sessions are open
    at once, and one session has at most ``max_envs_per_session`` (clamped to ``max_envs``);
    an ``open`` beyond them is refused with 503 (``CAPACITY``) and a message naming the limit.
    """

    def __init__(
        self,
        factory: EnvFactory,
        name: str,
        label: str = "",
        max_sessions: int = DEFAULT_MAX_SESSIONS,
        max_envs_per_session: int = DEFAULT_MAX_ENVS_PER_SESSION,
        idle_timeout: float = DEFAULT_IDLE_TIMEOUT_SECS,
        max_abs_reward: Optional[float] = None,
        snapshot_key: Optional[bytes] = None,
        max_envs: int = DEFAULT_MAX_ENVS,
    ):
        for limit, value in (("max_sessions", max_sessions), ("max_envs_per_session", max_envs_per_session),
                             ("max_envs", max_envs)):
            if not (isinstance(value, int) and value >= 1):
                raise ValueError(f"{limit} {value!r} must be an integer of at least 1")
        # A NaN or infinite timeout would keep abandoned sessions, and their slots, forever.
        if not (isinstance(idle_timeout, (int, float)) and math.isfinite(idle_timeout) and idle_timeout > 0):
            raise ValueError(f"idle_timeout {idle_timeout!r} must be a finite number of seconds above 0")
        self.factory = factory
        # Declared in `spaces`: the largest |reward| of one step; the learner rejects segments
        # beyond it (docs/SECURITY.md). None: undeclared (the learner's default applies).
        if max_abs_reward is not None and not (math.isfinite(max_abs_reward) and max_abs_reward > 0):
            raise ValueError(f"max_abs_reward {max_abs_reward} must be finite and positive")
        self.max_abs_reward = max_abs_reward
        self.name = check_name(name)
        self.label = label or name
        self.max_sessions = max_sessions
        self.max_envs = max_envs
        self.max_envs_per_session = min(max_envs_per_session, max_envs)
        self.idle_timeout = idle_timeout
        probe = factory()
        try:
            self.spaces = Spaces.probe(probe)
            self._flat_obs = len(probe.observation_space.shape) == 1
            # Save-load (volley_envs.snapshot): an adapter for this kind of environment, or None.
            # The key authenticates states whose decoder trusts its input (ALE's); instances of
            # one service share it to restore each other's states. Default: this process's own.
            self.snapshots: Optional[Adapter] = adapter_for(probe, snapshot_key or os.urandom(32))
        finally:
            probe.close()
        self._track_actions = bool(self.snapshots is not None and self.snapshots.tracks_last_action)
        if self._track_actions and self.spaces.continuous:
            self.snapshots, self._track_actions = None, False  # ALE's continuous actions: not supported
        # Images travel as one byte per value (protocol version 3), vectors as float32.
        self._obs_dtype = np.uint8 if self.spaces.image else np.float32
        self._obs_bin = u8_bin if self.spaces.image else f32_bin
        self.sessions: dict[int, Session] = {}
        # Ids below 2^53, starting at a different place per process (see the Rust server).
        self._next_session = (time.time_ns() ^ (os.getpid() << 20)) & ((1 << 52) - 1)
        self.requests = 0
        self.rejected = 0
        self.expired = 0
        self._service = None
        self._reaper: Optional[asyncio.Task] = None
        self._nc = None

    @property
    def open_envs(self) -> int:
        """Environments open over all sessions."""
        return sum(len(session.envs) for session in self.sessions.values())

    @property
    def id(self) -> str:
        """The instance id (after :meth:`start`)."""
        return self._service.id

    async def start(self, nc) -> None:
        """Register the service and its endpoints on the connection ``nc``."""
        self._nc = nc
        self._service = await add_service(
            nc,
            name=service_name(self.name),
            version=__version__,
            description=f"volley environment server: {self.label}",
            metadata={METADATA_PROTOCOL: str(PROTOCOL_VERSION), METADATA_ENV: self.name},
        )
        for op in OPS:
            await self._service.add_endpoint(
                name=op, subject=endpoint_subject(self.name, self._service.id, op), handler=self._handler(op)
            )
        self._reaper = asyncio.get_running_loop().create_task(self._expire_idle_sessions())
        await nc.flush()
        log.info(
            "environment server ready service=%s instance=%s env=%s obs_dim=%d obs=%s actions=%s",
            service_name(self.name), self.id, self.label, self.spaces.obs_dim,
            f"image{list(self.spaces.image_shape)}:u8" if self.spaces.image else "box:f32",
            f"box{self.spaces.action_shape}" if self.spaces.continuous else f"discrete({self.spaces.n_actions})",
        )
        log.info(
            "environment server limits max_sessions=%d max_envs=%d max_envs_per_session=%d idle_timeout_secs=%g",
            self.max_sessions, self.max_envs, self.max_envs_per_session, self.idle_timeout,
        )

    async def stop(self) -> None:
        """Deregister: endpoints and ``$SRV`` subscriptions go away; sessions are closed."""
        if self._reaper is not None:
            self._reaper.cancel()
            self._reaper = None
        if self._service is not None:
            await self._service.stop()
            await self._nc.flush()
        for session in self.sessions.values():
            _close_all(session.envs)
        self.sessions.clear()

    def _handler(self, op: str):
        async def handle(request: Request) -> None:
            self.requests += 1
            try:
                reply = self.handle(op, request.data)
            except ProtocolError as err:
                if err.code == BAD_REQUEST:
                    self.rejected += 1
                    log.warning("malformed environment request rejected op=%s reason=bad_request: %s", op, err.message)
                await request.respond_error(str(err.code), err.message.replace("\r", " ").replace("\n", " "))
                return
            await request.respond(reply)

        return handle

    async def _expire_idle_sessions(self) -> None:
        period = min(max(self.idle_timeout / 4, 0.05), 10.0)
        while True:
            await asyncio.sleep(period)
            now = time.monotonic()
            idle = [sid for sid, s in self.sessions.items() if now - s.last_used >= self.idle_timeout]
            for sid in idle:
                _close_all(self.sessions.pop(sid).envs)
            if idle:
                self.expired += len(idle)
                log.info("idle environment sessions dropped expired=%d remaining=%d", len(idle), len(self.sessions))

    # The protocol, synchronously: decode, act, encode. Raises ProtocolError for error replies.

    def handle(self, op: str, data: bytes) -> bytes:
        """Answer one request of operation ``op``."""
        request = unpack(data)
        version = request.get("v")
        if version is None:
            raise ProtocolError(BAD_REQUEST, 'request without a protocol version "v"')
        # A version that is not an unsigned integer is a malformed request, not a foreign
        # protocol (docs/SECURITY.md, issue 12: a string version was answered with 505).
        if not isinstance(version, int) or isinstance(version, bool) or not 0 <= version < 2**32:
            raise ProtocolError(BAD_REQUEST, f"v must be an unsigned integer, got {version!r}")
        # Version 1 is version 2 without Box actions, version 2 is version 3 without image
        # observations: each is served for the environments it can describe.
        oldest = self.spaces.min_version
        if not oldest <= version <= PROTOCOL_VERSION:
            served = f"{oldest} to {PROTOCOL_VERSION}" if oldest < PROTOCOL_VERSION else str(PROTOCOL_VERSION)
            why = ""
            if MIN_PROTOCOL_VERSION <= version < oldest:
                why = (
                    f"image observations need protocol version {IMAGE_PROTOCOL_VERSION}; "
                    if self.spaces.image
                    else "Box actions need protocol version 2; "
                )
            raise ProtocolError(
                UNSUPPORTED_VERSION,
                f"protocol version {version} is not served here ({why}this server speaks {served})",
            )
        if op == "spaces":
            return pack(self._spaces_reply())
        if op == "open":
            return pack(self._open(request))
        if op == "close":
            session = self.sessions.pop(_int(request, "session"), None)
            if session is not None:
                _close_all(session.envs)
            return pack({})
        if op in ("snapshot", "restore") and self.snapshots is None:
            raise ProtocolError(UNSUPPORTED, f"{op} is not supported for {self.label}: no snapshot adapter applies")
        session = self._session(request)
        if op == "step":
            return pack(self._step(session, request))
        if op == "reset":
            # Version 3: `envs` lists the environments to reset (default: all), one seed each.
            envs = request.get("envs")
            if envs is None:
                envs = list(range(len(session.envs)))
            elif (
                not isinstance(envs, list)
                or not envs
                or not all(isinstance(e, int) and not isinstance(e, bool) and 0 <= e < len(session.envs) for e in envs)
                or len(set(envs)) != len(envs)
            ):
                raise ProtocolError(BAD_REQUEST, f"reset envs must be distinct indices below {len(session.envs)}")
            seeds = request.get("seeds")
            if (
                not isinstance(seeds, list)
                or len(seeds) != len(envs)
                or not all(s is None or _is_u64(s) for s in seeds)
            ):
                raise ProtocolError(BAD_REQUEST, f"reset needs {len(envs)} u64 seeds (or nil entries)")
            for env_idx, seed in zip(envs, seeds):
                error = self._reset_one(session, env_idx, seed)
                if error is not None:
                    raise ProtocolError(INTERNAL, f"reset of environment {env_idx}: {error}")
            return pack({"obs": self._obs_bin(session.obs)})
        if op == "snapshot":
            return pack(self._snapshot(session, request))
        if op == "restore":
            return pack(self._restore(session, request))
        raise ProtocolError(BAD_REQUEST, f"unknown operation {op!r}")

    def _spaces_reply(self) -> dict:
        s = self.spaces
        return {
            "env": self.label,
            "obs_dim": s.obs_dim,
            "obs_low": f32_bin(s.obs_low),
            "obs_high": f32_bin(s.obs_high),
            "n_actions": s.n_actions,
            "action_space": self._action_space(),
            "obs_space": self._obs_space(),
            "reward_threshold": s.reward_threshold,
            "max_episode_steps": s.max_episode_steps,
            "max_abs_reward": self.max_abs_reward,
            "snapshot": self.snapshots is not None,
            "max_envs_per_session": self.max_envs_per_session,
        }

    def _env_index(self, session: Session, request: dict) -> int:
        env_idx = _int(request, "env")
        if not 0 <= env_idx < len(session.envs):
            raise ProtocolError(BAD_REQUEST, f"env {env_idx} out of range for {len(session.envs)} environments")
        return env_idx

    def _snapshot(self, session: Session, request: dict) -> dict:
        env_idx = self._env_index(session, request)
        try:
            return {"state": self.snapshots.capture(session.envs[env_idx], session.last_actions[env_idx])}
        except Exception as exc:
            raise ProtocolError(INTERNAL, f"snapshot of environment {env_idx}: {type(exc).__name__}: {exc}") from None

    def _restore(self, session: Session, request: dict) -> dict:
        """Check the whole state first (400), then apply it; an environment that fails while
        applying is reset (500), so that it is never left half restored."""
        env_idx = self._env_index(session, request)
        try:
            checked = self.snapshots.check(request.get("state"))
        except SnapshotError as err:
            raise ProtocolError(BAD_REQUEST, f"restore: {err}") from None
        try:
            row = self._observation(self.snapshots.restore(session.envs[env_idx], checked))
        except Exception as exc:
            self._reset_one(session, env_idx, None)
            raise ProtocolError(INTERNAL, f"restore of environment {env_idx}: {type(exc).__name__}: {exc}") from None
        session.obs[env_idx] = row
        if self._track_actions:
            session.last_actions[env_idx] = checked["last_action"]
        return {"obs": self._obs_bin(row)}

    def _obs_space(self) -> dict:
        s = self.spaces
        if not s.image:
            return {"kind": OBS_BOX}
        return {"kind": OBS_IMAGE, "shape": list(s.image_shape), "dtype": OBS_DTYPE_U8}

    def _action_space(self) -> dict:
        s = self.spaces
        if not s.continuous:
            return {"kind": ACTION_DISCRETE, "n": s.n_actions}
        return {
            "kind": ACTION_BOX,
            "shape": list(s.action_shape),
            "low": f32_bin(s.action_low),
            "high": f32_bin(s.action_high),
        }

    def _box_actions(self, actions, n_envs: int):
        """Box actions of a step request: one row per environment, clipped to the bounds, and
        the environments whose row is not finite (they fail; see the module docstring)."""
        dim = self.spaces.action_dim
        if not isinstance(actions, bytes) or len(actions) != 4 * n_envs * dim:
            got = f"{len(actions)} bytes" if isinstance(actions, bytes) else type(actions).__name__
            raise ProtocolError(
                BAD_REQUEST, f"Box actions must be a bin of {n_envs}x{dim} float32 ({4 * n_envs * dim} bytes), got {got}"
            )
        values = from_f32_bin(actions).reshape(n_envs, dim)
        non_finite = ~np.isfinite(values).all(axis=1)
        clipped = np.clip(values, self.spaces.action_low, self.spaces.action_high)
        rows = clipped.astype(self.spaces.action_dtype).reshape((n_envs, *self.spaces.action_shape))
        return rows, non_finite

    def _open(self, request: dict) -> dict:
        n_envs = _int(request, "n_envs")
        if not 1 <= n_envs <= self.max_envs_per_session:
            raise ProtocolError(BAD_REQUEST, f"n_envs {n_envs} out of range 1..={self.max_envs_per_session}")
        seeds = request.get("seeds")
        # Seeds are u64 (docs/ENV_PROTOCOL.md): a negative one was a 500 from Gymnasium's reset.
        if not isinstance(seeds, list) or len(seeds) != n_envs or not all(_is_u64(s) for s in seeds):
            raise ProtocolError(BAD_REQUEST, f"open needs {n_envs} u64 seeds")
        if len(self.sessions) >= self.max_sessions:
            raise ProtocolError(
                CAPACITY,
                f"{self.max_sessions} sessions already open: the server's max_sessions "
                "(--max-sessions, VOLLEY_ENV_MAX_SESSIONS)",
            )
        open_envs = self.open_envs
        if open_envs + n_envs > self.max_envs:
            raise ProtocolError(
                CAPACITY,
                f"{open_envs} environments open and {n_envs} more would exceed the server's max_envs "
                f"{self.max_envs} (--max-envs, VOLLEY_ENV_MAX_ENVS)",
            )
        session = Session(
            envs=[], obs=np.zeros((n_envs, self.spaces.obs_dim), dtype=self._obs_dtype), last_actions=[0] * n_envs
        )
        try:
            for env_idx, seed in enumerate(seeds):
                session.envs.append(self.factory())
                error = self._reset_one(session, env_idx, seed)
                if error is not None:
                    raise ProtocolError(INTERNAL, f"reset of environment {env_idx}: {error}")
        except ProtocolError:
            _close_all(session.envs)
            raise
        except Exception as exc:
            _close_all(session.envs)
            raise ProtocolError(INTERNAL, f"cannot build the environment: {type(exc).__name__}: {exc}") from None
        session_id = self._next_session
        self._next_session += 1
        self.sessions[session_id] = session
        log.debug("session opened session=%d n_envs=%d", session_id, n_envs)
        return {
            "session": session_id,
            "obs": self._obs_bin(session.obs),
            "idle_timeout_ms": int(self.idle_timeout * 1000),
        }

    def _session(self, request: dict) -> Session:
        session_id = _int(request, "session")
        session = self.sessions.get(session_id)
        if session is None:
            raise ProtocolError(UNKNOWN_SESSION, f"unknown session {session_id}")
        session.last_used = time.monotonic()
        return session

    def _observation(self, obs) -> np.ndarray:
        if self.spaces.image:
            return self._image_row(obs)
        row = np.asarray(obs, dtype=np.float32).reshape(-1)
        if row.shape != (self.spaces.obs_dim,):
            raise ValueError(f"observation of {row.size} values, expected {self.spaces.obs_dim}")
        if not np.all(np.isfinite(row)):
            raise ValueError("non-finite observation")
        return row

    def _image_row(self, obs) -> np.ndarray:
        """An image observation as one row of bytes in C,H,W order."""
        image = np.asarray(obs)
        if image.shape != self.spaces.obs_shape:
            raise ValueError(f"image observation of shape {image.shape}, expected {self.spaces.obs_shape}")
        if image.dtype != np.uint8:
            # Tolerated: integers that fit in a byte (the space says uint8, so this is rare).
            if image.dtype.kind not in "iu" or image.size and (image.min() < 0 or image.max() > 255):
                raise ValueError(f"image observation of dtype {image.dtype} is not bytes 0..=255")
            image = image.astype(np.uint8)
        if image.ndim == 3:
            image = image.transpose(2, 0, 1)
        return image.reshape(-1)

    def _reset_one(self, session: Session, env_idx: int, seed: Optional[int]) -> Optional[str]:
        """Reset one environment into its row; on failure zero the row and return why."""
        if env_idx < len(session.last_actions):
            session.last_actions[env_idx] = 0
        try:
            obs, _info = session.envs[env_idx].reset(seed=seed)
            session.obs[env_idx] = self._observation(obs)
            return None
        except Exception as exc:
            session.obs[env_idx] = 0.0
            return f"{type(exc).__name__}: {exc}"

    def _step(self, session: Session, request: dict) -> dict:
        actions = request.get("actions")
        n_envs = len(session.envs)
        spaces = self.spaces
        failed: dict = {}
        if spaces.continuous:
            actions, non_finite = self._box_actions(actions, n_envs)
            for env_idx in np.flatnonzero(non_finite).tolist():
                failed[env_idx] = "ValueError: non-finite action"
        elif not isinstance(actions, list) or len(actions) != n_envs:
            got = len(actions) if isinstance(actions, list) else type(actions).__name__
            raise ProtocolError(BAD_REQUEST, f"{got} actions for {n_envs} environments")
        dim, n_actions, start = spaces.obs_dim, spaces.n_actions, spaces.action_start
        # The hot loop only steps and copies; checks run once over the whole batch after it.
        rows = np.zeros((n_envs, dim), dtype=self._obs_dtype)
        image, flat = spaces.image, self._flat_obs
        rewards = np.zeros(n_envs, dtype=np.float32)
        terminated = [False] * n_envs
        truncated = [False] * n_envs
        continuous = spaces.continuous
        for env_idx, (env, action) in enumerate(zip(session.envs, actions)):
            if env_idx in failed:
                continue
            try:
                if continuous:
                    obs, reward, term, trunc, _info = env.step(action)
                else:
                    if action.__class__ is not int or not 0 <= action < n_actions:
                        raise ValueError(f"action {action!r} out of range for {n_actions} actions")
                    obs, reward, term, trunc, _info = env.step(start + action)
                if image:
                    rows[env_idx] = self._image_row(obs)
                else:
                    rows[env_idx] = obs if flat else np.ravel(obs)
                rewards[env_idx] = reward
            except Exception as exc:
                failed[env_idx] = f"{type(exc).__name__}: {exc}"
                rewards[env_idx] = 0.0
                continue
            terminated[env_idx] = bool(term)
            truncated[env_idx] = bool(trunc)
        if self._track_actions:
            # Environments that end or fail are reset below, which sets theirs back to 0.
            session.last_actions[:] = [start + a if a.__class__ is int else 0 for a in actions]
        # Bytes are always finite: only float observations need the check.
        finite = np.isfinite(rewards) if image else np.isfinite(rows).all(axis=1) & np.isfinite(rewards)
        if not finite.all():
            for env_idx in np.flatnonzero(~finite).tolist():
                failed.setdefault(env_idx, "ValueError: non-finite observation or reward")
        final_rows = []
        errors = []
        for env_idx in range(n_envs):
            if env_idx in failed:
                # Reported as a truncation with reward 0; the last valid observation is final.
                errors.append({"env": env_idx, "message": failed[env_idx]})
                rewards[env_idx] = 0.0
                terminated[env_idx] = False
                truncated[env_idx] = True
                final_rows.append(session.obs[env_idx].copy())
                self._reset_one(session, env_idx, None)
            elif terminated[env_idx] or truncated[env_idx]:
                final_rows.append(rows[env_idx])
                error = self._reset_one(session, env_idx, None)
                if error is not None:
                    errors.append({"env": env_idx, "message": error})
            else:
                session.obs[env_idx] = rows[env_idx]
        final_obs = np.concatenate(final_rows) if final_rows else np.zeros(0, dtype=self._obs_dtype)
        return {
            "obs": self._obs_bin(session.obs),
            "rewards": f32_bin(rewards),
            "terminated": terminated,
            "truncated": truncated,
            "final_obs": self._obs_bin(final_obs),
            "errors": errors,
        }


def _is_u64(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**64


def _int(request: dict, key: str) -> int:
    value = request.get(key)
    if not isinstance(value, int) or isinstance(value, bool):
        raise ProtocolError(BAD_REQUEST, f"{key} must be an integer, got {value!r}")
    return value


def _close_all(envs: list) -> None:
    for env in envs:
        try:
            env.close()
        except Exception:  # closing is best effort
            pass
