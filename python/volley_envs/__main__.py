"""``volley-envs serve ENV --nats URL``: serve a Gymnasium environment until SIGINT/SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import os
import signal
import ssl
import sys
from urllib.parse import urlparse

import nats

from .protocol import check_name, default_name
from .server import (
    DEFAULT_IDLE_TIMEOUT_SECS,
    DEFAULT_MAX_ENVS,
    DEFAULT_MAX_ENVS_PER_SESSION,
    DEFAULT_MAX_SESSIONS,
    EnvServer,
    make_factory,
)


log = logging.getLogger("volley_envs")

# Pause between reconnect attempts during a broker outage (nats-py's default).
RECONNECT_WAIT_SECS = 2.0


def describe(err: BaseException) -> str:
    """One line for a connection error: its type and message, never a traceback."""
    message = str(err).strip().splitlines()[0] if str(err).strip() else ""
    return f"{type(err).__name__}: {message}" if message else type(err).__name__


def connection_options(url: str, tls_failed: asyncio.Future | None = None) -> dict:
    """nats-py callbacks that log one line per event. Without them nats-py logs every failed
    reconnect attempt during a broker outage with a full traceback (issue 48). The server
    reconnects for as long as the outage lasts; its service comes back with the connection.
    A TLS error (a certificate that does not verify) also completes `tls_failed`, if given:
    retrying cannot fix it, so the first connection gives up (see `connect`)."""
    async def error_cb(err: Exception) -> None:
        log.warning("NATS at %s: %s", url, describe(err))
        if tls_failed is not None and isinstance(err, ssl.SSLError) and not tls_failed.done():
            tls_failed.set_result(err)

    async def disconnected_cb() -> None:
        log.warning("disconnected from NATS at %s; reconnecting every %.0f s", url, RECONNECT_WAIT_SECS)

    async def reconnected_cb() -> None:
        log.info("reconnected to NATS at %s", url)

    return {
        "error_cb": error_cb,
        "disconnected_cb": disconnected_cb,
        "reconnected_cb": reconnected_cb,
        "max_reconnect_attempts": -1,
        "reconnect_time_wait": RECONNECT_WAIT_SECS,
    }


def tls_options(ca: str | None, cert: str | None, key: str | None, required: bool) -> dict | None:
    """nats-py options for TLS (issue 46), as the Rust processes take them; None when no TLS
    setting is given (nats-py then follows the server: TLS when it asks, with the system's CAs).

    A file that is missing or not PEM ends the command with one line.
    """
    if cert and not key or key and not cert:
        raise SystemExit("volley-envs: --tls-cert and --tls-key go together")
    if not (ca or cert or required):
        return None
    try:
        context = ssl.create_default_context(cafile=ca)
        if cert:
            context.load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as err:
        raise SystemExit(f"volley-envs: TLS files (--tls-ca {ca}, --tls-cert {cert}): {describe(err)}") from None
    return {"tls": context}


async def check_server_offers_tls(url: str) -> None:
    """With TLS required, refuse a server whose greeting does not ask for TLS.

    nats-py upgrades to TLS only when the server's INFO says `tls_required`, and would send its
    CONNECT (the password) in plain text to a server without TLS; the Rust client refuses such a
    server by itself. So this reads the greeting first and stops with one line. (An attacker in
    the path could still answer this probe and the real connection differently; the broker
    requiring TLS, as broker-config/ does, is what keeps honest deployments encrypted.)
    """
    parsed = urlparse(url if "://" in url else f"nats://{url}")
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(parsed.hostname, parsed.port or 4222), 10)
        try:
            line = await asyncio.wait_for(reader.readline(), 10)
        finally:
            writer.close()
    except (OSError, asyncio.TimeoutError) as err:
        raise SystemExit(f"volley-envs: cannot connect to NATS at {url}: {describe(err)}") from None
    info = json.loads(line[len(b"INFO "):]) if line.startswith(b"INFO ") else {}
    if not info.get("tls_required"):
        raise SystemExit(f"volley-envs: the NATS server at {url} does not offer TLS, and TLS is required "
                         "(--tls-ca, --tls-cert or --tls-required)")


def positive_int(text: str) -> int:
    """An argparse type: an integer of at least 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be at least 1")
    return value


def positive_seconds(text: str) -> float:
    """An argparse type: a finite number of seconds above 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"{text} must be a finite number of seconds above 0")
    return value


def limit_default(variable: str, default: float) -> str:
    """The default of a limit flag: its environment variable if set (checked by the flag's type)."""
    return os.environ.get(variable) or str(default)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="volley-envs", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="serve one environment as one service instance")
    serve.add_argument("env", help="gymnasium:<id> (e.g. gymnasium:CartPole-v1), atari:<Game> (e.g. atari:Pong: "
                                   "ALE/<Game>-v5 with the standard Atari preprocessing; needs ale-py) or "
                                   "<module>:<callable>")
    serve.add_argument("--nats", default=os.environ.get("VOLLEY_NATS_URL", "nats://127.0.0.1:4222"),
                       help="NATS server URL (env VOLLEY_NATS_URL)")
    serve.add_argument("--name", default=os.environ.get("VOLLEY_ENV_SERVICE"),
                       help="service name actors ask for with --env remote:<name> (default: from the id, "
                            "CartPole-v1 -> cartpole-v1, atari:Pong -> pong)")
    serve.add_argument("--env-kwargs", default="{}",
                       help="JSON object of keyword arguments for the factory (atari: for gymnasium.make or "
                            "AtariPreprocessing, e.g. {\"terminal_on_life_loss\": true})")
    serve.add_argument("--max-sessions", type=positive_int,
                       default=limit_default("VOLLEY_ENV_MAX_SESSIONS", DEFAULT_MAX_SESSIONS),
                       help="sessions held at once; an open beyond them is refused with 503 (env "
                            f"VOLLEY_ENV_MAX_SESSIONS, default {DEFAULT_MAX_SESSIONS})")
    serve.add_argument("--max-envs", type=positive_int,
                       default=limit_default("VOLLEY_ENV_MAX_ENVS", DEFAULT_MAX_ENVS),
                       help="environments held at once over all sessions, the bound on the server's memory "
                            "(environments x memory per environment); an open beyond it is refused with 503 "
                            f"(env VOLLEY_ENV_MAX_ENVS, default {DEFAULT_MAX_ENVS})")
    serve.add_argument("--max-abs-reward", type=float,
                       default=float(os.environ["VOLLEY_ENV_MAX_ABS_REWARD"])
                       if os.environ.get("VOLLEY_ENV_MAX_ABS_REWARD") else None,
                       help="declare the largest |reward| of one step; the learner rejects segments beyond it "
                            "(env VOLLEY_ENV_MAX_ABS_REWARD; default: undeclared)")
    serve.add_argument("--max-envs-per-session", type=positive_int,
                       default=limit_default("VOLLEY_ENV_MAX_ENVS_PER_SESSION", DEFAULT_MAX_ENVS_PER_SESSION),
                       help="largest session, at most --max-envs (env VOLLEY_ENV_MAX_ENVS_PER_SESSION, default "
                            f"{DEFAULT_MAX_ENVS_PER_SESSION})")
    serve.add_argument("--idle-timeout-secs", type=positive_seconds,
                       default=limit_default("VOLLEY_ENV_IDLE_TIMEOUT_SECS", DEFAULT_IDLE_TIMEOUT_SECS),
                       help="drop a session without requests for this long, so abandoned sessions free their "
                            "slots (env VOLLEY_ENV_IDLE_TIMEOUT_SECS, default "
                            f"{DEFAULT_IDLE_TIMEOUT_SECS:g})")
    serve.add_argument("--snapshot-key-file", default=os.environ.get("VOLLEY_ENVS_SNAPSHOT_KEY_FILE"),
                       help="file of at least 16 bytes that authenticates snapshot states whose decoder trusts "
                            "its input (ALE's); instances that share it restore each other's states (env "
                            "VOLLEY_ENVS_SNAPSHOT_KEY_FILE; default: a random key, states restore on this "
                            "instance only)")
    serve.add_argument("--user", default=os.environ.get("VOLLEY_NATS_USER"), help="NATS user (env VOLLEY_NATS_USER)")
    serve.add_argument("--password", default=os.environ.get("VOLLEY_NATS_PASSWORD"),
                       help="NATS password (env VOLLEY_NATS_PASSWORD)")
    serve.add_argument("--tls-ca", default=os.environ.get("VOLLEY_NATS_TLS_CA"),
                       help="PEM file of the CA that signed the NATS server's certificate; requires TLS "
                            "(env VOLLEY_NATS_TLS_CA)")
    serve.add_argument("--tls-cert", default=os.environ.get("VOLLEY_NATS_TLS_CERT"),
                       help="PEM client certificate, for a server that verifies clients (env VOLLEY_NATS_TLS_CERT)")
    serve.add_argument("--tls-key", default=os.environ.get("VOLLEY_NATS_TLS_KEY"),
                       help="PEM private key of --tls-cert (env VOLLEY_NATS_TLS_KEY)")
    serve.add_argument("--tls-required", action="store_true",
                       default=os.environ.get("VOLLEY_NATS_TLS_REQUIRED", "").lower() in ("1", "true"),
                       help="refuse a NATS server without TLS, also without --tls-ca (env VOLLEY_NATS_TLS_REQUIRED)")
    serve.add_argument("--log-level", default=os.environ.get("VOLLEY_LOG_LEVEL", "INFO"))
    return parser.parse_args(argv)


async def connect(options: dict, tls_failed: asyncio.Future):
    """`nats.connect`, or the TLS error that ends it: nats-py retries a failed handshake for as
    long as it retries an unreachable broker (for ever), and a wrong CA never gets better."""
    connecting = asyncio.ensure_future(nats.connect(**options))
    done, _ = await asyncio.wait({connecting, tls_failed}, return_when=asyncio.FIRST_COMPLETED)
    if connecting in done:
        return connecting.result()
    connecting.cancel()
    raise tls_failed.result()


async def serve(args: argparse.Namespace) -> None:
    kwargs = json.loads(args.env_kwargs)
    if not isinstance(kwargs, dict):
        raise SystemExit("--env-kwargs must be a JSON object")
    factory = make_factory(args.env, kwargs)
    env_id = args.env.partition(":")[2]
    name = check_name(args.name) if args.name else default_name(env_id)
    snapshot_key = None
    if args.snapshot_key_file:
        with open(args.snapshot_key_file, "rb") as key_file:
            snapshot_key = key_file.read()
        if len(snapshot_key) < 16:
            raise SystemExit("--snapshot-key-file must hold at least 16 bytes")
    server = EnvServer(factory, name, label=args.env, max_sessions=args.max_sessions,
                       max_envs_per_session=args.max_envs_per_session, max_envs=args.max_envs,
                       idle_timeout=args.idle_timeout_secs,
                       max_abs_reward=args.max_abs_reward, snapshot_key=snapshot_key)
    tls = tls_options(args.tls_ca, args.tls_cert, args.tls_key, args.tls_required)
    if tls is not None:
        await check_server_offers_tls(args.nats)
    tls_failed = asyncio.get_running_loop().create_future()
    options = {"servers": [args.nats], "name": "volley-envs", **connection_options(args.nats, tls_failed), **(tls or {})}
    if args.user:
        options.update(user=args.user, password=args.password)
    try:
        nc = await connect(options, tls_failed)
    except Exception as err:  # noqa: BLE001 - any failure to connect ends the command with one line
        raise SystemExit(f"volley-envs: cannot connect to NATS at {args.nats}: {describe(err)}") from None
    await server.start(nc)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("stopping instance=%s sessions=%d requests=%d", server.id, len(server.sessions), server.requests)
    await server.stop()
    await nc.drain()


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.command == "serve":
        asyncio.run(serve(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
