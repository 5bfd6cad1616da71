"""The Volley environment protocol, version 3 (docs/ENV_PROTOCOL.md).

Requests and replies are MessagePack maps with string keys. Arrays of floats are ``bin``
values of little-endian ``float32``; image observations (version 3) are ``bin`` values of one
byte per value, each row in C,H,W order. Errors are empty replies with the NATS service-API
headers ``Nats-Service-Error`` (description) and ``Nats-Service-Error-Code`` (code).
"""

from __future__ import annotations

import re

import msgpack
import numpy as np

# Version 2 added Box (continuous) actions, version 3 image (u8) observations. Older messages
# are the newer ones' for the environments they can describe (version 1: Discrete actions and
# vector observations; version 2: vector observations), so servers still answer them there;
# clients accept instances of any of them.
PROTOCOL_VERSION = 3
MIN_PROTOCOL_VERSION = 1
# The first version that carries image observations.
IMAGE_PROTOCOL_VERSION = 3
ACTION_DISCRETE = "discrete"
ACTION_BOX = "box"
OBS_BOX = "box"
OBS_IMAGE = "image"
OBS_DTYPE_U8 = "u8"
METADATA_PROTOCOL = "volley_env_protocol"
METADATA_ENV = "volley_env"
ERROR_HEADER = "Nats-Service-Error"
ERROR_CODE_HEADER = "Nats-Service-Error-Code"
OPS = ("spaces", "open", "reset", "step", "snapshot", "restore", "close")

BAD_REQUEST = 400
UNKNOWN_SESSION = 404
INTERNAL = 500
UNSUPPORTED = 501
CAPACITY = 503
UNSUPPORTED_VERSION = 505

_NAME = re.compile(r"^[a-z0-9_-]{1,48}$")


class ProtocolError(Exception):
    """A request the server answers with an error code."""

    def __init__(self, code: int, message: str):
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


def check_name(name: str) -> str:
    """Return ``name`` if it is a valid service name (``[a-z0-9_-]{1,48}``), else raise ValueError."""
    if not _NAME.match(name):
        raise ValueError(f"invalid environment service name {name!r}: expected [a-z0-9_-]{{1,48}}")
    return name


def default_name(env_id: str) -> str:
    """A service name from an environment id: ``CartPole-v1`` -> ``cartpole-v1``."""
    name = re.sub(r"[^a-z0-9_-]+", "-", env_id.lower()).strip("-")
    return check_name(name[:48] or "env")


def service_name(name: str) -> str:
    """The NATS micro service of environment service ``name``."""
    return f"volley-env-{name}"


def endpoint_subject(name: str, instance_id: str, op: str) -> str:
    """The subject of endpoint ``op`` of instance ``instance_id``."""
    return f"volley.env.{name}.{instance_id}.{op}"


def f32_bin(values) -> bytes:
    """Floats as little-endian float32 bytes."""
    return np.ascontiguousarray(values, dtype="<f4").tobytes()


def from_f32_bin(data: bytes) -> np.ndarray:
    """Little-endian float32 bytes as a float32 array."""
    if len(data) % 4:
        raise ProtocolError(BAD_REQUEST, f"f32 array of {len(data)} bytes is not a multiple of 4")
    return np.frombuffer(data, dtype="<f4").astype(np.float32)


def u8_bin(values) -> bytes:
    """Bytes 0..=255 (an image observation) as a bin of one byte per value."""
    return np.ascontiguousarray(values, dtype=np.uint8).tobytes()


def from_u8_bin(data: bytes) -> np.ndarray:
    """A bin of one byte per value as a uint8 array."""
    return np.frombuffer(data, dtype=np.uint8)


def pack(message: dict) -> bytes:
    """Encode a message (``bytes`` values become ``bin``)."""
    return msgpack.packb(message, use_bin_type=True)


def unpack(data: bytes) -> dict:
    """Decode a request; anything but a map is a bad request."""
    try:
        message = msgpack.unpackb(data, raw=False)
    except Exception as exc:  # msgpack raises several types for garbage
        raise ProtocolError(BAD_REQUEST, f"undecodable request: {exc}") from None
    if not isinstance(message, dict):
        raise ProtocolError(BAD_REQUEST, f"request is a {type(message).__name__}, not a map")
    return message
