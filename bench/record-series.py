#!/usr/bin/env python3
"""Record the Prometheus series of a real Volley run, for the alert rules' unit tests.

Starts nats-server, a learner and N actor processes (release build) and a real Prometheus
(Debian's package) scraping them every 5 s with deploy/'s rules, lets the run go for --secs,
then reads every series the rules use back through Prometheus's HTTP API and writes them as a
`promtool test rules` input block: deploy/prometheus/rules/recorded/<scenario>.series.yaml.

`bench/make-rule-tests.py` turns the recorded blocks into
deploy/prometheus/rules/volley.recorded_test.yaml, which CI runs with promtool: every alert
stays silent on the healthy recordings and the matching alert fires on each unhealthy one.

Scenarios (each a real run; what makes the unhealthy ones unhealthy is said below):
  healthy-1, healthy-2, healthy-4  learner + 1/2/4 actors (8 envs each), defaults, CartPole
  starving                         learner alone: no actors
  stalled                          data keeps arriving but no update follows: --publish-every 6
                                   with --max-policy-lag 4 (the configuration issue #11 found to
                                   deadlock: after 5 updates every segment is stale). Recorded
                                   with a build from before that configuration was refused at
                                   start; the series stand for any learner that receives but
                                   cannot use data
  collapsed                        the run learns with the defaults until the learner's mean
                                   return passes 400; then the learner is restarted from its
                                   checkpoint with --learning-rate 0.05 --ent-coef 0 (a bad
                                   hyper-parameter change): the policy collapses to near-zero
                                   entropy and the return falls to ~9
  stale-heavy                      4 actors and --max-policy-lag 1: most segments dropped stale

Usage: bench/record-series.py SCENARIO [--secs 150] [--out FILE]
Needs: target/release/volley (cargo build --release -p volley), prometheus on PATH
(apt-get install prometheus), and nats-server (VOLLEY_NATS_SERVER, or the test kit's:
`cargo run -q -p volley-testkit --bin volley-nats-server`).
"""

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRAPE = 5  # seconds; the interval of the recorded series
# The series the rules and the dashboards' health panels read (histograms: their buckets).
SERIES = [
    "volley_build_info",
    "volley_learner_wait_seconds_total",
    "volley_learner_compute_seconds_total",
    "volley_learner_updates_total",
    "volley_learner_segments_total",
    "volley_learner_segments_rejected_total",
    "volley_learner_policy_lag_bucket",
    "volley_learner_checkpoint_age_seconds",
    "volley_learner_seconds_since_progress",
    "volley_learner_entropy",
    "volley_learner_episode_return_mean",
    "volley_learner_policy_version",
    "volley_learner_max_policy_lag",
    "volley_actor_throttled_seconds_total",
    "volley_actor_env_steps_total",
    "volley_actor_policy_version",
]

SCENARIOS = {
    "healthy-1": dict(actors=1, learner=[]),
    "healthy-2": dict(actors=2, learner=[]),
    "healthy-4": dict(actors=4, learner=[]),
    "starving": dict(actors=0, learner=[]),
    "stalled": dict(actors=2, learner=["--publish-every", "6"]),
    "collapsed": dict(actors=2, learner=[], then=["--learning-rate", "0.05", "--ent-coef", "0"]),
    "stale-heavy": dict(actors=4, learner=["--max-policy-lag", "1"]),
}


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def nats_server():
    found = os.environ.get("VOLLEY_NATS_SERVER") or shutil.which("nats-server")
    if found:
        return found
    out = subprocess.run(["cargo", "run", "-q", "-p", "volley-testkit", "--bin", "volley-nats-server"],
                         cwd=ROOT, check=True, capture_output=True, text=True)
    return out.stdout.strip()


def wait_http(url, timeout=60):
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"{url} did not answer within {timeout} s")


def query_range(prom, expr, start, end):
    q = urllib.parse.urlencode({"query": expr, "start": start, "end": end, "step": SCRAPE})
    with urllib.request.urlopen(f"{prom}/api/v1/query_range?{q}", timeout=30) as r:
        body = json.load(r)
    if body["status"] != "success":
        raise SystemExit(f"query {expr}: {body}")
    return body["data"]["result"]


def fmt(v):
    v = float(v)
    return repr(int(v)) if v.is_integer() and abs(v) < 1e15 else f"{v:.6g}"


def wait_return(port, target, patience=600):
    """Wait until the learner's mean return reaches `target`."""
    deadline = time.time() + patience
    while time.time() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as r:
                for line in r.read().decode().splitlines():
                    if line.startswith("volley_learner_episode_return_mean ") and float(line.split()[1]) >= target:
                        return
        except OSError:
            pass
        time.sleep(1)
    raise SystemExit(f"the learner's return never reached {target}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("scenario", choices=sorted(SCENARIOS))
    ap.add_argument("--secs", type=float, default=150)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    scenario = SCENARIOS[args.scenario]
    out = args.out or ROOT / "deploy/prometheus/rules/recorded" / f"{args.scenario}.series.yaml"
    volley = ROOT / "target/release/volley"
    if not volley.exists():
        raise SystemExit("build first: cargo build --release -p volley")
    work = Path(tempfile.mkdtemp(prefix="volley-record-"))
    procs = []

    def spawn(name, argv):
        log = open(work / f"{name}.log", "w")
        p = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=log, env={**os.environ, "RUST_LOG": "info"})
        procs.append(p)
        return p

    try:
        nats_port = free_port()
        spawn("nats", [nats_server(), "-js", "-a", "127.0.0.1", "-p", str(nats_port), "-sd", str(work / "js")])
        url = f"nats://127.0.0.1:{nats_port}"
        time.sleep(1)
        targets = {"learner": free_port()}
        learner_argv = [str(volley), "learner", "--nats", url, "--run", "rec", "--checkpoint-dir", str(work / "ck"),
                        "--metrics-addr", f"127.0.0.1:{targets['learner']}", "--target-return", "1e9",
                        "--max-env-steps", "10000000000", *scenario["learner"]]
        learner = spawn("learner", learner_argv)
        wait_http(f"http://127.0.0.1:{targets['learner']}/metrics")
        for i in range(scenario["actors"]):
            port = free_port()
            targets[f"actor-{i}"] = port
            spawn(f"actor-{i}", [str(volley), "actor", "--nats", url, "--run", "rec", "--actor-id",
                                                f"actor-{i}", "--envs", "8", "--metrics-addr", f"127.0.0.1:{port}"])
        prom_port = free_port()
        scrape = []
        for name, port in targets.items():
            job = "volley-learner" if name == "learner" else "volley-actors"
            scrape.append({"job_name": name, "scrape_interval": f"{SCRAPE}s",
                           "static_configs": [{"targets": [f"127.0.0.1:{port}"], "labels": {"pod": name, "job": job}}]})
        config = {"global": {"scrape_interval": f"{SCRAPE}s", "evaluation_interval": f"{SCRAPE}s"},
                  "rule_files": [str(ROOT / "deploy/prometheus/rules/volley.rules.yaml")], "scrape_configs": scrape}
        (work / "prometheus.yml").write_text(json.dumps(config))
        spawn("prometheus", ["prometheus", f"--config.file={work / 'prometheus.yml'}",
                             f"--storage.tsdb.path={work / 'tsdb'}", f"--web.listen-address=127.0.0.1:{prom_port}"])
        prom = f"http://127.0.0.1:{prom_port}"
        wait_http(f"{prom}/-/ready")
        time.sleep(2 * SCRAPE)
        start = time.time()
        if "then" in scenario:
            wait_return(targets["learner"], 400)
            learner.send_signal(signal.SIGTERM)
            learner.wait(timeout=60)
            spawn("learner-2", learner_argv + scenario["then"])
            print(f"learner restarted with {' '.join(scenario['then'])} after {time.time() - start:.0f} s")
        time.sleep(args.secs)
        end = time.time()
        time.sleep(SCRAPE + 1)
        lines = [f"# Recorded by bench/record-series.py {args.scenario} --secs {args.secs:g} on "
                 f"{time.strftime('%Y-%m-%d', time.gmtime())} ({os.cpu_count()} cores, Prometheus scrape every {SCRAPE} s).",
                 f"# {scenario['actors']} actors, learner flags: {' '.join(scenario['learner']) or '(defaults)'}",
                 f"# {int((end - start) // SCRAPE) + 1} samples per series at {SCRAPE} s; the instance label is the pod name.",
                 "input_series:"]
        n_series = 0
        for name in SERIES:
            for series in query_range(prom, name, start, end):
                labels = {k: v for k, v in series["metric"].items() if k not in ("instance",)}
                labels["instance"] = labels.pop("pod", "unknown")
                metric = labels.pop("__name__")
                label_text = ", ".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
                by_time = {round(float(t)): v for t, v in series["values"]}
                t0 = round(start)
                values = []
                last = None
                for k in range(int((end - start) // SCRAPE) + 1):
                    v = by_time.get(t0 + k * SCRAPE)
                    values.append("_" if v is None else fmt(v))
                    last = v if v is not None else last
                lines.append(f"  - series: '{metric}{{{label_text}}}'")
                lines.append(f"    values: '{' '.join(values)}'")
                n_series += 1
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text("\n".join(lines) + "\n")
        print(f"{args.scenario}: {n_series} series, {end - start:.0f} s -> {out}")
        summary = subprocess.run(["curl", "-s", f"http://127.0.0.1:{targets['learner']}/metrics"],
                                 capture_output=True, text=True).stdout
        for line in summary.splitlines():
            if line.startswith(("volley_learner_updates_total", "volley_learner_segments_total", "volley_learner_entropy ",
                                "volley_learner_episode_return_mean", "volley_learner_seconds_since_progress")):
                print("  ", line)
    finally:
        for p in reversed(procs):
            try:
                p.send_signal(signal.SIGCONT)
                p.terminate()
                p.wait(timeout=10)
            except Exception:
                p.kill()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
