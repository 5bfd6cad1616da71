#!/usr/bin/env python3
"""A real Prometheus against a short live run: every recording rule and every Volley dashboard
query returns data, and no alert fires on a healthy run.

Starts nats-server, `volley learner` and two `volley actor` processes (release build, CartPole,
bounded by --max-env-steps) and Debian's Prometheus with deploy/prometheus/prometheus.yml: its
rule files and jobs, with the compose service names replaced by the local processes' addresses
and 1-second scrape and evaluation intervals. Once Prometheus has scraped every target and
evaluated every rule for 30 s it asks, through the HTTP API:
  - each recording rule (deploy/prometheus/rules/volley.rules.yaml): some data;
  - each query of the Volley dashboards (dashboards/volley-overview.json, volley-actors.json;
    the NATS dashboard reads prometheus-nats-exporter, which does not run here), with the
    dashboard variables set to match everything and $__rate_interval to 1m: some data;
  - ALERTS{alertstate="firing"}: none (pending alerts are listed, not failed: their `for`
    windows are minutes long; the recorded-series rule tests cover those).
Usage: .ci/prometheus-live-check.py   (needs yaml: run it with .ci/venv/bin/python)
Environment: VOLLEY_NATS_SERVER (else the test kit's), VOLLEY_BIN (default target/release/volley).
"""

import json
import os
import re
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

import yaml

ROOT = Path(__file__).resolve().parent.parent
SETTLE_SECS = 30
PATIENCE_SECS = 180


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get_json(url):
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.load(r)


def query(prom, expr):
    body = get_json(f"{prom}/api/v1/query?" + urllib.parse.urlencode({"query": expr}))
    if body.get("status") != "success":
        raise RuntimeError(f"{expr}: {body}")
    return body["data"]["result"]


def wait(what, probe, patience=PATIENCE_SECS):
    deadline = time.time() + patience
    while time.time() < deadline:
        try:
            if probe():
                return
        except OSError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"FAILED: {what} (waited {patience} s)")


def dashboard_queries():
    """(dashboard, panel title, expression) of every Volley dashboard query."""
    for name in ["volley-overview.json", "volley-actors.json"]:
        dashboard = json.loads((ROOT / "dashboards" / name).read_text())
        panels = list(dashboard["panels"])
        panels += [p for row in dashboard["panels"] for p in row.get("panels", []) or []]
        for panel in panels:
            for target in panel.get("targets", []):
                expr = target["expr"]
                expr = expr.replace("$__rate_interval", "1m")
                expr = re.sub(r'=~"\$\w+"', '=~".*"', expr)
                yield name, panel["title"], expr


def main():
    volley = os.environ.get("VOLLEY_BIN", str(ROOT / "target/release/volley"))
    nats_server = os.environ.get("VOLLEY_NATS_SERVER") or subprocess.run(
        ["cargo", "run", "-q", "-p", "volley-testkit", "--bin", "volley-nats-server"],
        cwd=ROOT, check=True, capture_output=True, text=True).stdout.strip()
    prometheus = shutil.which("prometheus")
    if not prometheus:
        raise SystemExit("prometheus not found: apt-get install prometheus")
    work = Path(tempfile.mkdtemp(prefix="volley-prom-live-"))
    procs = []

    def spawn(name, argv):
        log = open(work / f"{name}.log", "w")
        procs.append((name, subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=log)))

    failures = []
    try:
        nats_port = free_port()
        # A fixed JetStream storage limit: unset, the server takes 75 % of the free disk, and the
        # run's default store limits reserve over 2 GiB at creation, so a nearly full CI disk
        # would fail the check for a reason it does not check.
        (work / "nats.conf").write_text("jetstream {\n  max_file_store: 1TB\n}\n")
        spawn("nats", [nats_server, "-js", "-a", "127.0.0.1", "-p", str(nats_port), "-sd", str(work / "js"),
                       "-c", str(work / "nats.conf")])
        url = f"nats://127.0.0.1:{nats_port}"
        time.sleep(1)
        learner_port = free_port()
        spawn("learner", [volley, "learner", "--nats", url, "--run", "live", "--checkpoint-dir", str(work / "ck"),
                          "--metrics-addr", f"127.0.0.1:{learner_port}", "--target-return", "1e9",
                          "--max-env-steps", "50000000"])
        actor_ports = [free_port(), free_port()]
        for i, port in enumerate(actor_ports):
            spawn(f"actor-{i}", [volley, "actor", "--nats", url, "--run", "live", "--actor-id", f"actor-{i}",
                                 "--envs", "8", "--metrics-addr", f"127.0.0.1:{port}"])

        # deploy/'s configuration, pointed at these processes.
        config = yaml.safe_load((ROOT / "deploy/prometheus/prometheus.yml").read_text())
        config["global"].update({"scrape_interval": "1s", "evaluation_interval": "1s"})
        config["rule_files"] = [str(ROOT / "deploy/prometheus" / f) for f in config["rule_files"]]
        addresses = {"volley-learner": [f"127.0.0.1:{learner_port}"],
                     "volley-actors": [f"127.0.0.1:{p}" for p in actor_ports]}
        jobs = []
        for job in config["scrape_configs"]:
            if job["job_name"] in addresses:
                jobs.append({"job_name": job["job_name"], "static_configs": [{"targets": addresses[job["job_name"]]}]})
            elif job["job_name"] == "prometheus":
                jobs.append(job)
        prom_port = free_port()
        jobs = [j if j["job_name"] != "prometheus" else
                {"job_name": "prometheus", "static_configs": [{"targets": [f"127.0.0.1:{prom_port}"]}]} for j in jobs]
        config["scrape_configs"] = jobs
        (work / "prometheus.yml").write_text(yaml.safe_dump(config))
        spawn("prometheus", [prometheus, f"--config.file={work / 'prometheus.yml'}",
                             f"--storage.tsdb.path={work / 'tsdb'}", f"--web.listen-address=127.0.0.1:{prom_port}"])
        prom = f"http://127.0.0.1:{prom_port}"
        wait("Prometheus ready", lambda: urllib.request.urlopen(f"{prom}/-/ready", timeout=2).status == 200)
        wait("every target up", lambda: len(query(prom, 'up{job=~"volley-.*"} == 1')) == 3)
        wait("the learner updates", lambda: bool(query(prom, "volley_learner_updates_total > 100")))
        time.sleep(SETTLE_SECS)
        for name, proc in procs:
            if proc.poll() is not None:
                failures.append(f"{name} exited early ({proc.returncode}); log:\n{(work / f'{name}.log').read_text()[-2000:]}")

        rules = yaml.safe_load((ROOT / "deploy/prometheus/rules/volley.rules.yaml").read_text())
        records = [r["record"] for g in rules["groups"] for r in g["rules"] if "record" in r]
        for record in records:
            result = query(prom, record)
            print(f"  rule {record}: {len(result)} series")
            if not result:
                failures.append(f"recording rule {record} returned no data")
        checked = 0
        for dashboard, title, expr in dashboard_queries():
            result = query(prom, expr)
            checked += 1
            if not result:
                failures.append(f"{dashboard} / {title}: no data for {expr}")
        print(f"  {checked} dashboard queries checked")
        alerts = query(prom, "ALERTS")
        for alert in alerts:
            labels = alert["metric"]
            line = f"{labels['alertname']} ({labels['alertstate']}) {labels}"
            print("  alert:", line)
            if labels["alertstate"] == "firing":
                failures.append(f"alert fires on a healthy run: {line}")
    finally:
        for _, proc in reversed(procs):
            proc.send_signal(signal.SIGTERM)
        for _, proc in reversed(procs):
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
        shutil.rmtree(work, ignore_errors=True)
    if failures:
        print("FAILED:\n  " + "\n  ".join(failures), file=sys.stderr)
        return 1
    print("live Prometheus check passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
