"""The encoding, byte for byte as the Rust side expects it (transport/src/envsvc/protocol.rs)."""

import msgpack
import numpy as np
import pytest

from volley_envs.protocol import (
    ProtocolError,
    default_name,
    endpoint_subject,
    f32_bin,
    from_f32_bin,
    pack,
    service_name,
    unpack,
)


def test_open_reply_bytes_match_the_rust_encoding():
    # The same bytes volley_transport::envsvc::protocol's test expects from rmp_serde::to_vec_named.
    data = pack({"session": 7, "obs": f32_bin([1.0]), "idle_timeout_ms": 0})
    assert data[:10] == bytes([0x83, 0xA7]) + b"session" + bytes([7])
    assert data[10:20] == bytes([0xA3]) + b"obs" + bytes([0xC4, 4, 0, 0, 0x80, 0x3F])


def test_float_arrays_round_trip_as_little_endian_bins():
    values = np.array([1.5, -0.0, np.inf, -3.25], dtype=np.float32)
    data = f32_bin(values)
    assert data == values.astype("<f4").tobytes() and len(data) == 16
    assert np.array_equal(from_f32_bin(data), values)
    with pytest.raises(ProtocolError):
        from_f32_bin(b"abc")


def test_names_and_subjects():
    assert default_name("CartPole-v1") == "cartpole-v1"
    assert default_name("ALE/Pong-v5") == "ale-pong-v5"
    assert service_name("cartpole-v1") == "volley-env-cartpole-v1"
    assert endpoint_subject("x", "AbC", "step") == "volley.env.x.AbC.step"


def test_garbage_is_a_bad_request():
    for data in (b"\xc1", msgpack.packb([1, 2]), b""):
        with pytest.raises(ProtocolError) as err:
            unpack(data)
        assert err.value.code == 400
