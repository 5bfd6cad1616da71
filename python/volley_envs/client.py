"""A small asyncio client of the environment protocol: discovery and session calls.

Volley's actors use the Rust client; this one serves tests, tools and Python programs that
want to step a remote environment.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Optional

import numpy as np
from nats.errors import NoRespondersError

from .protocol import (
    ERROR_CODE_HEADER,
    ERROR_HEADER,
    METADATA_PROTOCOL,
    MIN_PROTOCOL_VERSION,
    OBS_IMAGE,
    OPS,
    PROTOCOL_VERSION,
    ProtocolError,
    f32_bin,
    from_f32_bin,
    from_u8_bin,
    pack,
    service_name,
)

import msgpack


class Gone(Exception):
    """Nobody listens on the instance's subject any more."""


@dataclass
class Instance:
    """One server: its id and the subject of each operation."""

    id: str
    subjects: dict
    # The protocol version the instance announces; its requests carry it.
    protocol: int = PROTOCOL_VERSION


async def discover(nc, name: str, window: float = 0.3) -> list:
    """The instances of service ``name`` that answer ``$SRV.INFO`` within ``window`` seconds."""
    inbox = nc.new_inbox()
    replies = await nc.subscribe(inbox)
    await nc.publish(f"$SRV.INFO.{service_name(name)}", b"", reply=inbox)
    await nc.flush()
    instances = []
    loop = asyncio.get_running_loop()
    deadline = loop.time() + window
    while True:
        remaining = deadline - loop.time()
        if remaining <= 0:
            break
        try:
            message = await replies.next_msg(timeout=remaining)
        except (asyncio.TimeoutError, TimeoutError):
            break
        except Exception as exc:  # nats-py raises its own TimeoutError subclass
            if "timeout" in type(exc).__name__.lower():
                break
            raise
        if not message.data:
            # With no instance at all the server answers with an empty "no responders" status.
            if (message.headers or {}).get("Status") == "503":
                break
            continue
        info = json.loads(message.data)
        # Older instances serve the environments they can describe with the newer messages.
        announced = (info.get("metadata") or {}).get(METADATA_PROTOCOL)
        served = [str(v) for v in range(MIN_PROTOCOL_VERSION, PROTOCOL_VERSION + 1)]
        if announced not in served:
            continue
        endpoints = {e["name"]: e["subject"] for e in info.get("endpoints") or []}
        if all(op in endpoints for op in OPS):
            instances.append(Instance(id=info["id"], subjects=endpoints, protocol=int(announced)))
    await replies.unsubscribe()
    return instances


async def call(nc, instance: Instance, op: str, request: dict, timeout: float = 5.0) -> dict:
    """One request; error replies raise :class:`ProtocolError`, a dead instance :class:`Gone`."""
    try:
        message = await nc.request(instance.subjects[op], pack({"v": instance.protocol, **request}), timeout=timeout)
    except NoRespondersError:
        raise Gone(f"instance {instance.id} is gone ({op}: no responders)") from None
    headers = message.headers or {}
    if ERROR_CODE_HEADER in headers:
        raise ProtocolError(int(headers[ERROR_CODE_HEADER]), headers.get(ERROR_HEADER, ""))
    return msgpack.unpackb(message.data, raw=False)


def is_image(spaces: dict) -> bool:
    """Whether a ``spaces`` reply declares image observations (protocol version 3: u8 bins)."""
    return (spaces.get("obs_space") or {}).get("kind") == OBS_IMAGE


class RemoteSession:
    """A session of ``n_envs`` environments on one instance.

    Observations come back as ``float32`` rows of ``obs_dim`` values, or with ``image=True``
    (a ``spaces`` reply whose ``obs_space`` is an image) as ``uint8`` rows of C*H*W bytes."""

    def __init__(self, nc, instance: Instance, obs_dim: int, image: bool = False):
        self.nc = nc
        self.instance = instance
        self.obs_dim = obs_dim
        self.image = image
        self.session: Optional[int] = None
        self.n_envs = 0

    @classmethod
    def for_spaces(cls, nc, instance: Instance, spaces: dict) -> "RemoteSession":
        """A session shaped by the instance's ``spaces`` reply."""
        return cls(nc, instance, obs_dim=int(spaces["obs_dim"]), image=is_image(spaces))

    def _obs(self, data: bytes, rows: int) -> np.ndarray:
        values = from_u8_bin(data) if self.image else from_f32_bin(data)
        return values.reshape(rows, self.obs_dim)

    async def open(self, seeds: list) -> np.ndarray:
        reply = await call(self.nc, self.instance, "open", {"n_envs": len(seeds), "seeds": list(seeds)})
        self.session = reply["session"]
        self.n_envs = len(seeds)
        return self._obs(reply["obs"], self.n_envs)

    async def step(self, actions) -> dict:
        """Step with a list of integers (Discrete) or a float array of ``n_envs`` rows (Box)."""
        if isinstance(actions, np.ndarray) and actions.dtype.kind == "f":
            wire = f32_bin(actions)
        else:
            wire = list(actions)
        reply = await call(self.nc, self.instance, "step", {"session": self.session, "actions": wire})
        reply["obs"] = self._obs(reply["obs"], self.n_envs)
        reply["rewards"] = from_f32_bin(reply["rewards"])
        reply["final_obs"] = self._obs(reply.get("final_obs", b""), -1)
        return reply

    async def reset(self, seeds: list) -> np.ndarray:
        reply = await call(self.nc, self.instance, "reset", {"session": self.session, "seeds": list(seeds)})
        return self._obs(reply["obs"], self.n_envs)

    async def close(self) -> None:
        await call(self.nc, self.instance, "close", {"session": self.session})
