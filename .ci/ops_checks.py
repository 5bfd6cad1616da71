#!/usr/bin/env python3
"""Repository checks for the operations files that no off-the-shelf tool covers (stdlib only).

    ops_checks.py dashboard-rules OUT.yaml
        Reads every dashboards/*.json, checks the structure Grafana provisioning relies on, and
        writes each panel query and each variable query as a recording rule to OUT.yaml, so that
        `promtool check rules OUT.yaml` parses every expression as PromQL. Grafana variables are
        replaced by values PromQL accepts ($__rate_interval -> 5m, "$job" -> "x").
    ops_checks.py consistency
        Cross-file invariants: the KEDA ScaledObject's query is the recording rule
        namespace:volley_actors:desired with the namespace filled in; the PrometheusRule in
        k8s/ carries exactly the groups of deploy/prometheus/rules/volley.rules.yaml; every
        nats_* series in dashboards and rules is one prometheus-nats-exporter exports.

Exits 1 with one line per problem.
"""

import glob
import json
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Series of prometheus-nats-exporter 0.20 run with -prefix=nats -varz -connz -subz -routez -jsz=all
# (collector/jsz.go names; varz series are nats_varz_<field> for the numeric fields of /varz of
# nats-server 2.12). A dashboard or rule naming any other nats_* series would show nothing.
NATS_EXPORTER_SERIES = {
    "nats_server_jetstream_disabled", "nats_server_total_streams", "nats_server_total_consumers",
    "nats_server_total_messages", "nats_server_total_message_bytes", "nats_server_max_memory",
    "nats_server_max_storage",
    "nats_account_max_memory", "nats_account_max_storage", "nats_account_storage_used", "nats_account_memory_used",
    "nats_stream_total_messages", "nats_stream_limit_messages", "nats_stream_total_bytes", "nats_stream_limit_bytes",
    "nats_stream_first_seq", "nats_stream_last_seq", "nats_stream_consumer_count", "nats_stream_subject_count",
    "nats_consumer_delivered_consumer_seq", "nats_consumer_delivered_stream_seq",
    "nats_consumer_last_delivery_seconds", "nats_consumer_last_ack_seconds", "nats_consumer_num_ack_pending",
    "nats_consumer_num_redelivered", "nats_consumer_num_waiting", "nats_consumer_num_pending",
    "nats_consumer_ack_floor_stream_seq", "nats_consumer_ack_floor_consumer_seq",
} | {
    "nats_varz_" + field for field in (
        "cpu", "mem", "cores", "gomaxprocs", "connections", "total_connections", "subscriptions", "routes",
        "remotes", "leafnodes", "in_msgs", "out_msgs", "in_bytes", "out_bytes", "slow_consumers",
        "slow_consumer_stats_clients", "slow_consumer_stats_routes", "slow_consumer_stats_gateways",
        "slow_consumer_stats_leafs", "stale_connections", "stalled_clients", "max_connections", "max_payload",
        "max_pending", "jetstream_config_max_memory", "jetstream_config_max_storage", "jetstream_stats_memory",
        "jetstream_stats_storage", "jetstream_stats_reserved_memory", "jetstream_stats_reserved_storage",
        "jetstream_stats_accounts", "jetstream_stats_ha_assets", "jetstream_stats_api_total",
        "jetstream_stats_api_errors",
    )
}

GRAFANA_VALUES = {
    "$__rate_interval": "5m",
    "$__interval": "1m",
    "$__range": "1h",
}

problems = []


def problem(message):
    problems.append(message)


def grafana_to_promql(expr):
    """Replace Grafana's variables with values PromQL accepts."""
    for name, value in GRAFANA_VALUES.items():
        expr = expr.replace(name, value)
    # ${var}, ${var:fmt} and $var (only inside label matchers in our dashboards).
    return re.sub(r"\$\{[A-Za-z0-9_:]+\}|\$[A-Za-z_][A-Za-z0-9_]*", "x", expr)


def panels_of(dashboard):
    """Every panel, including those nested in rows."""
    for panel in dashboard.get("panels", []):
        yield panel
        for nested in panel.get("panels", []) or []:
            yield nested


def dashboard_rules():
    rules = []
    uids = {}
    files = sorted(glob.glob(os.path.join(ROOT, "dashboards", "*.json")))
    if not files:
        problem("no dashboards/*.json")
    for path in files:
        name = os.path.relpath(path, ROOT)
        try:
            with open(path, encoding="utf-8") as f:
                dashboard = json.load(f)
        except (OSError, json.JSONDecodeError) as err:
            problem(f"{name}: {err}")
            continue
        uid = dashboard.get("uid")
        if not isinstance(uid, str) or not re.fullmatch(r"[a-z0-9-]{8,40}", uid):
            problem(f"{name}: uid {uid!r} must be 8-40 characters of [a-z0-9-] and stable")
        elif uid in uids:
            problem(f"{name}: uid {uid} also used by {uids[uid]}")
        else:
            uids[uid] = name
        if dashboard.get("id") is not None:
            problem(f"{name}: id must be null in a provisioned dashboard")
        if "__inputs" in dashboard:
            problem(f"{name}: __inputs is for manual import; provisioned dashboards use a datasource variable")
        variables = dashboard.get("templating", {}).get("list", [])
        if not any(v.get("type") == "datasource" and v.get("name") == "datasource" for v in variables):
            problem(f"{name}: no datasource variable named 'datasource'")
        record_prefix = "dashboard:" + re.sub(r"[^a-zA-Z0-9_]", "_", str(uid))
        for var in variables:
            query = var.get("query")
            if var.get("type") != "query":
                continue
            text = query.get("query") if isinstance(query, dict) else query
            match = re.fullmatch(r"\s*label_values\((.*),\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*\)\s*", text or "")
            if not match:
                problem(f"{name}: variable {var.get('name')}: expected label_values(<selector>, <label>), got {text!r}")
                continue
            rules.append({"record": f"{record_prefix}:var_{var['name']}", "expr": grafana_to_promql(match.group(1)),
                          "_where": f"{name} variable {var['name']}"})
        ids = set()
        for panel in panels_of(dashboard):
            pid = panel.get("id")
            if pid in ids:
                problem(f"{name}: duplicate panel id {pid}")
            ids.add(pid)
            if panel.get("type") == "row":
                continue
            title = panel.get("title")
            if panel.get("datasource", {}).get("uid") != "${datasource}":
                problem(f"{name}: panel {title!r} does not use the datasource variable")
            if not panel.get("fieldConfig", {}).get("defaults", {}).get("unit"):
                problem(f"{name}: panel {title!r} has no unit")
            if not panel.get("description"):
                problem(f"{name}: panel {title!r} has no description")
            targets = panel.get("targets") or []
            if not targets:
                problem(f"{name}: panel {title!r} has no query")
            for target in targets:
                expr = target.get("expr", "")
                if "rate(" in expr and "$__rate_interval" not in expr:
                    problem(f"{name}: panel {title!r}: {expr} should use $__rate_interval")
                if target.get("datasource", {}).get("uid") != "${datasource}":
                    problem(f"{name}: panel {title!r} target {target.get('refId')} does not use the datasource variable")
                rules.append({"record": f"{record_prefix}:panel{pid}_{target.get('refId')}",
                              "expr": grafana_to_promql(expr), "_where": f"{name} panel {title!r}"})
    return rules


def nats_series(expr):
    return set(re.findall(r"\bnats_[a-z0-9_]+", expr))


def write_rules(rules, out):
    # JSON is YAML: promtool reads it, and no YAML library is needed here.
    groups = {"groups": [{"name": "dashboards", "rules": [{k: v for k, v in r.items() if not k.startswith("_")}
                                                            for r in rules]}]}
    with open(out, "w", encoding="utf-8") as f:
        json.dump(groups, f, indent=1)
        f.write("\n")


def load_yaml(path):
    # Imported lazily: only `consistency` needs PyYAML (installed with kubernetes-validate).
    import yaml  # noqa: PLC0415
    with open(path, encoding="utf-8") as f:
        return list(yaml.safe_load_all(f))


def consistency():
    rules_path = os.path.join(ROOT, "deploy", "prometheus", "rules", "volley.rules.yaml")
    (rules_doc,) = load_yaml(rules_path)
    recorded = {r["record"]: r["expr"] for g in rules_doc["groups"] for r in g["rules"] if "record" in r}

    # The PrometheusRule for the Prometheus operator must carry the same rules.
    (prom_rule,) = load_yaml(os.path.join(ROOT, "k8s", "components", "monitoring", "prometheusrule.yaml"))
    if prom_rule.get("spec", {}).get("groups") != rules_doc["groups"]:
        problem("k8s/components/monitoring/prometheusrule.yaml: spec.groups differ from "
                "deploy/prometheus/rules/volley.rules.yaml (copy the groups over)")

    # The autoscaler asks Prometheus for the recording rule's expression, restricted to its namespace.
    (scaled,) = load_yaml(os.path.join(ROOT, "k8s", "components", "autoscaling", "scaledobject.yaml"))
    triggers = scaled["spec"]["triggers"]
    desired = recorded.get("namespace:volley_actors:desired")
    if desired is None:
        problem(f"{rules_path}: no recording rule namespace:volley_actors:desired")
    for trigger in triggers:
        if trigger.get("type") != "prometheus":
            continue
        query = " ".join(trigger["metadata"]["query"].split())
        namespace = scaled["metadata"].get("namespace") or "volley"
        expected = " ".join(desired.replace("{", '{namespace="%s", ' % namespace).replace(", }", "}").split())
        if desired is not None and query != expected:
            problem("k8s/components/autoscaling/scaledobject.yaml: the prometheus trigger's query is not the recording "
                    f"rule namespace:volley_actors:desired with namespace=\"{namespace}\" added to every selector:\n"
                    f"  query:    {query}\n  expected: {expected}")

    # Every nats_* series used anywhere must exist.
    sources = [(rules_path, r.get("expr", "")) for g in rules_doc["groups"] for r in g["rules"]]
    sources += [(r["_where"], r["expr"]) for r in dashboard_rules()]
    for where, expr in sources:
        for series in nats_series(str(expr)) - NATS_EXPORTER_SERIES:
            problem(f"{where}: {series} is not a prometheus-nats-exporter series")


def main(argv):
    if len(argv) == 3 and argv[1] == "dashboard-rules":
        rules = dashboard_rules()
        write_rules(rules, argv[2])
        print(f"{len(rules)} dashboard queries written to {argv[2]}")
    elif len(argv) == 2 and argv[1] == "consistency":
        consistency()
    else:
        print(__doc__, file=sys.stderr)
        return 2
    for message in problems:
        print(message, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
