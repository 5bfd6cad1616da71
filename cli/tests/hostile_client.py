"""A hostile actor for cli/tests/hostile.rs (issue 12, docs/SECURITY.md).

Independent of the Rust codec: segments are built here from the documented wire format
(docs/SECURITY.md, "Wire format for independent clients": the envelope, then the bincode 2
"standard" encoding of `TrajectorySegment`), with nats-py, msgpack-free. It reads the run spec
and the weights pointer from KV, sends every kind of bad input the threat model names, forges
the weights pointer first, samples the learner's resident set before and after, and prints one JSON
line: what it sent, by the rejection reason the learner must count it under.

Usage: python hostile_client.py NATS_URL RUN LEARNER_PID ROUNDS
"""

import asyncio
import json
import math
import os
import random
import ssl
import struct
import sys

import nats
import xxhash

MAGIC = b"VLLY"
FORMAT_VERSION = 7
KIND_SEGMENT = 1


def varint(n: int) -> bytes:
    """bincode 2 "standard" unsigned varint."""
    if n < 251:
        return bytes([n])
    if n < 2**16:
        return b"\xfb" + struct.pack("<H", n)
    if n < 2**32:
        return b"\xfc" + struct.pack("<I", n)
    return b"\xfd" + struct.pack("<Q", n)


def string(s: bytes) -> bytes:
    return varint(len(s)) + s


def option(value, encode) -> bytes:
    return b"\x00" if value is None else b"\x01" + encode(value)


def f32s(values) -> bytes:
    """An `f32` column (format 7): its length in bytes, then the values little-endian."""
    return varint(4 * len(values)) + b"".join(struct.pack("<f", v) for v in values)


def segment_body(seg: dict) -> bytes:
    out = string(seg["run"]) + string(seg["actor"])
    out += varint(seg["incarnation"]) + varint(seg["env_idx"]) + varint(seg["episode_id"]) + varint(seg["segment_idx"])
    out += varint(seg["task_id"]) + option(seg["start_snapshot"], string)
    out += varint(seg["policy_version"]) + varint(seg["layout_hash"]) + varint(seg["obs_dim"])
    out += varint(0) + f32s(seg["observations"])  # the F32 variant of the observations enum
    out += varint(len(seg["actions"])) + b"".join(varint(a) for a in seg["actions"])
    out += f32s(seg.get("continuous_actions", []))  # format 5: continuous actions (none here)
    out += f32s(seg["rewards"])
    out += varint(len(seg["terminated"])) + bytes(seg["terminated"])
    out += varint(len(seg["truncated"])) + bytes(seg["truncated"])
    out += f32s(seg["behaviour_log_probs"]) + f32s(seg["truncation_values"]) + f32s(seg["initial_hidden"])
    out += varint(0)  # restored_states
    out += varint(len(seg["finished_episodes"]))
    for ep in seg["finished_episodes"]:
        out += struct.pack("<f", ep["episode_return"]) + varint(ep["episode_len"]) + varint(0)
        out += option(None, varint) + option(None, string)
        out += option(None, varint)  # format 6: the episode's group (none here)
    out += varint(0)  # saved_snapshots
    out += varint(0)  # format 6: episode_groups (none here)
    return out


def envelope(body: bytes) -> bytes:
    header = MAGIC + struct.pack("<HB", FORMAT_VERSION, KIND_SEGMENT)
    return header + struct.pack("<Q", xxhash.xxh3_64_intdigest(body)) + body


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def stored_spec(value: bytes) -> dict:
    """The run spec from its KV envelope (docs/SECURITY.md), checksum verified."""
    head = b'{"format":1,"xxh3":"'
    middle = b'","spec":'
    assert value.startswith(head) and value.endswith(b"}"), value[:40]
    checksum = int(value[len(head):len(head) + 16], 16)
    body = value[len(head) + 16:-1]
    assert body.startswith(middle), body[:20]
    body = body[len(middle):]
    assert xxhash.xxh3_64_intdigest(body) == checksum, "run spec checksum mismatch"
    return json.loads(body)


async def main(url: str, run: str, learner_pid: int, rounds: int) -> None:
    # The broker requires TLS (the test kit's CA, passed as VOLLEY_NATS_TLS_CA like to Volley's
    # processes): the attacker is a client like any other.
    ca_file = os.environ.get("VOLLEY_NATS_TLS_CA")
    tls = ssl.create_default_context(cafile=ca_file) if ca_file else None
    nc = await nats.connect(url, tls=tls)
    js = nc.jetstream()
    kv = await js.key_value(f"volley-{run}")
    spec = stored_spec((await kv.get("spec")).value)
    while True:
        try:
            pointer = json.loads((await kv.get("weights")).value)
            break
        except Exception:  # not published yet
            await asyncio.sleep(0.05)
    t_len, obs_dim = spec["segment_len"], spec["policy"]["obs_dim"]
    rng = random.Random(12)
    counter = iter(range(10**9))

    def honest(**changes) -> dict:
        idx = next(counter)
        seg = {
            "run": run.encode(), "actor": b"mallory", "incarnation": 7, "env_idx": 0, "episode_id": idx,
            "segment_idx": idx, "task_id": 0, "start_snapshot": None, "policy_version": pointer["version"],
            "layout_hash": int(pointer["layout_hash"], 16), "obs_dim": obs_dim,
            "observations": [rng.uniform(-0.05, 0.05) for _ in range((t_len + 1) * obs_dim)],
            "actions": [rng.randrange(spec["policy"]["n_actions"]) for _ in range(t_len)],
            "rewards": [1.0] * t_len, "terminated": [0] * (t_len - 1) + [1], "truncated": [0] * t_len,
            "behaviour_log_probs": [-math.log(2)] * t_len, "truncation_values": [0.0] * t_len,
            "initial_hidden": [],
            "finished_episodes": [{"episode_return": float(t_len), "episode_len": t_len}],
        }
        seg.update(changes)
        return seg

    def valid_bytes(**changes) -> bytes:
        return envelope(segment_body(honest(**changes)))

    sent: dict = {}

    async def send(reason: str, payload: bytes) -> None:
        await js.publish(f"volley.{run}.traj.mallory", payload)
        sent[reason] = sent.get(reason, 0) + 1

    rss_before = rss_bytes(learner_pid)
    # First, a forged weights pointer: the highest version there is (an anchor, so its chain
    # adds up), a wrong digest, the real weights inline. Actors must refuse it and keep
    # following the learner's real pointers written after it.
    forged = dict(pointer, version=2**64 - 1, anchor=2**64 - 1, digest="0123456789abcdef")
    await kv.put("weights", json.dumps(forged).encode())
    replayed = valid_bytes()
    for _ in range(rounds):
        await send("bad_magic", bytes(rng.randrange(256) for _ in range(200)))
        await send("truncated", valid_bytes()[:10])
        flipped = bytearray(valid_bytes())
        bit = rng.randrange(15 * 8, len(flipped) * 8)
        flipped[bit // 8] ^= 1 << (bit % 8)
        await send("corrupt", bytes(flipped))
        for version in (pointer["version"] + 1000, 2**63, 2**64 - 1):
            await send("future_version", valid_bytes(policy_version=version))
        rewards = [1.0] * t_len
        rewards[2] = 1e30
        await send("reward_bound", valid_bytes(rewards=rewards))
        nan = [1.0] * t_len
        nan[1] = float("nan")
        await send("non_finite", valid_bytes(rewards=nan))
        await send("episode_summary", valid_bytes(finished_episodes=[{"episode_return": 1e30, "episode_len": t_len}]))
        many = [{"episode_return": 1.0, "episode_len": 1}] * 20_000
        await send("episode_summary", valid_bytes(finished_episodes=many))
        await send("bad_id", valid_bytes(actor=b"m" * 200_000))
        # A header and checksum that are right around a body whose first length is absurd.
        await send("malformed", envelope(b"\xfd" + struct.pack("<Q", 2**62) + b"x" * 32))
        # The same valid segment again: a duplicate, skipped (not a rejection).
        await js.publish(f"volley.{run}.traj.mallory", replayed)
        # Larger than the broker's max_payload: refused by the server, never delivered.
        try:
            await nc.publish(f"volley.{run}.traj.mallory", b"\x00" * (2 << 20))
        except Exception:
            pass
    await nc.flush()
    rss_after = rss_bytes(learner_pid)
    report = {"sent": sent, "rss_before": rss_before, "rss_after": rss_after, "forged_at": pointer["version"]}
    print(json.dumps(report), flush=True)
    await nc.close()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])))
