#!/usr/bin/env python3
"""Repository checks for the operations files that no off-the-shelf tool covers (stdlib only).

    ops_checks.py dashboard-rules OUT.yaml
        Reads every dashboards/*.json, checks the structure Grafana provisioning relies on, and
        writes each panel query and each variable query as a recording rule to OUT.yaml, so that
        `promtool check rules OUT.yaml` parses every expression as PromQL. Grafana variables are
        replaced by values PromQL accepts ($__rate_interval -> 5m, "$job" -> "x").
    ops_checks.py consistency
        Cross-file invariants: the KEDA ScaledObject's query is the recording rule
        namespace:volley_actors:desired restricted to the base's namespace; the PrometheusRule
        in k8s/ carries exactly the groups of deploy/prometheus/rules/volley.rules.yaml; the
        dashboards ConfigMap lists every dashboard and carries the label and folder annotation
        the Grafana sidecar is configured with (k8s/components/monitoring/
        kube-prometheus-stack.values.yaml); the gpu overlay pins both Volley images by digest;
        every nats_* series in dashboards and rules is one prometheus-nats-exporter exports.

    ops_checks.py split RENDERED.yaml OUTDIR
        Splits a rendered kustomization (`kubectl kustomize`): objects of built-in Kubernetes
        APIs go to OUTDIR/core.yaml (for kubernetes-validate), each custom resource to its own
        file OUTDIR/<kind>_<group>_<version>--<name>.yaml, whose prefix names its schema in
        k8s/schemas/ (check-jsonschema takes one object per file). A custom resource without a
        schema there is a problem.

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
    (base,) = load_yaml(os.path.join(ROOT, "k8s", "base", "kustomization.yaml"))
    namespace = base["namespace"]
    prometheus_triggers = [t for t in triggers if t.get("type") == "prometheus"]
    if not prometheus_triggers:
        problem("k8s/components/autoscaling/scaledobject.yaml: no prometheus trigger")
    for trigger in prometheus_triggers:
        query = " ".join(trigger["metadata"]["query"].split())
        # The query is the rule with namespace="<the base's namespace>" in every selector.
        selectors = re.findall(r"\b(volley_[a-z_]+)(\{[^}]*\})?", query)
        unscoped = [name for name, labels in selectors if f'namespace="{namespace}"' not in (labels or "")]
        if unscoped:
            problem(f"k8s/components/autoscaling/scaledobject.yaml: {', '.join(unscoped)} not restricted to "
                    f'namespace="{namespace}" (the namespace of k8s/base/kustomization.yaml)')
        unscoped_query = query.replace(f'{{namespace="{namespace}"}}', "").replace(f'namespace="{namespace}", ', "")
        if desired is not None and unscoped_query != " ".join(desired.split()):
            problem("k8s/components/autoscaling/scaledobject.yaml: the prometheus trigger's query is not the recording "
                    "rule namespace:volley_actors:desired restricted to the namespace:\n"
                    f"  query without the namespace: {unscoped_query}\n  rule: {' '.join(desired.split())}")

    # The dashboards ConfigMap must carry every dashboard.
    (dash_kustomization,) = load_yaml(os.path.join(ROOT, "dashboards", "kustomization.yaml"))
    listed = {f for g in dash_kustomization["configMapGenerator"] for f in g.get("files", [])}
    on_disk = {os.path.basename(p) for p in glob.glob(os.path.join(ROOT, "dashboards", "*.json"))}
    if listed != on_disk:
        problem(f"dashboards/kustomization.yaml lists {sorted(listed)} but dashboards/ holds {sorted(on_disk)}")

    # The dashboards ConfigMap carries the label and folder annotation the Grafana sidecar is
    # configured to read (k8s/components/monitoring/kube-prometheus-stack.values.yaml).
    values_path = os.path.join("k8s", "components", "monitoring", "kube-prometheus-stack.values.yaml")
    (values,) = load_yaml(os.path.join(ROOT, values_path))
    sidecar = values["grafana"]["sidecar"]["dashboards"]
    options = dash_kustomization.get("generatorOptions", {})
    if options.get("labels", {}).get(sidecar.get("label")) != sidecar.get("labelValue"):
        problem(f"dashboards/kustomization.yaml: the ConfigMap lacks the label {sidecar.get('label')}: "
                f"{sidecar.get('labelValue')!r} that {values_path} configures the sidecar with")
    folder_annotation = sidecar.get("folderAnnotation")
    if not folder_annotation or folder_annotation not in options.get("annotations", {}):
        problem(f"dashboards/kustomization.yaml: the ConfigMap lacks the annotation {folder_annotation!r} that "
                f"{values_path} sets as the sidecar's folderAnnotation")
    if not sidecar.get("provider", {}).get("foldersFromFilesStructure"):
        problem(f"{values_path}: folderAnnotation needs provider.foldersFromFilesStructure: true")

    # The gpu overlay runs images pinned by digest, so actors and learner cannot be different
    # builds (a node's cached image under a reused tag).
    (gpu,) = load_yaml(os.path.join(ROOT, "k8s", "overlays", "gpu", "kustomization.yaml"))
    pinned = {i["name"]: i for i in gpu.get("images", [])}
    for image in ("volley-learner", "volley-actor"):
        digest = pinned.get(image, {}).get("digest", "")
        if not re.fullmatch(r"sha256:[0-9a-f]{64}", digest) or "newTag" in pinned.get(image, {}):
            problem(f"k8s/overlays/gpu/kustomization.yaml: image {image} is not pinned by digest "
                    "(images: digest: sha256:<64 hex>, no newTag)")

    # Every password variable the accounts read reaches nats-server wherever it runs: the
    # compose stack, the cluster's StatefulSet (from the credentials Secret) and the example
    # Secret, and every NATS user a workload logs in as exists in the accounts.
    accounts = open(os.path.join(ROOT, "broker-config", "accounts.conf")).read()
    password_vars = set(re.findall(r"password:\s*\$(VOLLEY_[A-Z_]+)", accounts))
    # The actor identities' public keys (issue 46) reach it the same way.
    password_vars |= set(re.findall(r"nkey:\s*\$(VOLLEY_[A-Z0-9_]+)", accounts))
    users = set(re.findall(r"user:\s*([a-z0-9-]+)", accounts))
    compose_docs = load_yaml(os.path.join(ROOT, "deploy", "compose.yaml"))
    services = compose_docs[0]["services"]
    missing = password_vars - set(services["nats"].get("environment", {}))
    if missing:
        problem(f"deploy/compose.yaml: the nats service lacks {sorted(missing)} (read by broker-config/accounts.conf)")
    for name, service in services.items():
        user = service.get("environment", {}).get("VOLLEY_NATS_USER")
        if user is not None and user not in users:
            problem(f"deploy/compose.yaml: service {name} logs in as {user}, not a user in broker-config/accounts.conf")
    (statefulset,) = load_yaml(os.path.join(ROOT, "k8s", "base", "nats", "statefulset.yaml"))
    nats_env = {e["name"]: e for c in statefulset["spec"]["template"]["spec"]["containers"] for e in c.get("env", [])}
    (secret,) = load_yaml(os.path.join(ROOT, "k8s", "components", "example-credentials", "secret.yaml"))
    for var in sorted(password_vars):
        key = nats_env.get(var, {}).get("valueFrom", {}).get("secretKeyRef", {}).get("key")
        if key is None:
            problem(f"k8s/base/nats/statefulset.yaml: no {var} from the credentials Secret")
        elif key not in secret.get("stringData", {}):
            problem(f"k8s/components/example-credentials/secret.yaml: no key {key} (the NATS servers read it as {var})")
    for path in glob.glob(os.path.join(ROOT, "k8s", "**", "*.yaml"), recursive=True):
        for doc in load_yaml(path):
            if not isinstance(doc, dict) or doc.get("kind") not in ("Deployment", "Job", "StatefulSet"):
                continue
            for container in doc["spec"]["template"]["spec"]["containers"]:
                for env in container.get("env", []):
                    if env["name"] == "VOLLEY_NATS_USER" and env.get("value") not in users:
                        problem(f"{os.path.relpath(path, ROOT)}: logs in as {env.get('value')}, "
                                "not a user in broker-config/accounts.conf")
                    key = env.get("valueFrom", {}).get("secretKeyRef", {}).get("key")
                    if key is not None and key not in secret.get("stringData", {}):
                        problem(f"{os.path.relpath(path, ROOT)}: reads Secret key {key}, which the example Secret lacks")

    # Every nats_* series used anywhere must exist.
    sources = [(rules_path, r.get("expr", "")) for g in rules_doc["groups"] for r in g["rules"]]
    sources += [(r["_where"], r["expr"]) for r in dashboard_rules()]
    for where, expr in sources:
        for series in nats_series(str(expr)) - NATS_EXPORTER_SERIES:
            problem(f"{where}: {series} is not a prometheus-nats-exporter series")


# API groups served by Kubernetes itself; kubernetes-validate has their schemas.
CORE_GROUPS = {"", "apps", "batch", "policy", "autoscaling", "networking.k8s.io", "rbac.authorization.k8s.io",
               "storage.k8s.io", "scheduling.k8s.io", "coordination.k8s.io", "discovery.k8s.io"}


def split(rendered, outdir):
    import yaml  # noqa: PLC0415
    os.makedirs(outdir, exist_ok=True)
    with open(rendered, encoding="utf-8") as f:
        docs = [d for d in yaml.safe_load_all(f) if d]
    core = []
    for doc in docs:
        group, _, version = doc["apiVersion"].rpartition("/")
        if group in CORE_GROUPS:
            core.append(doc)
            continue
        schema = f"{doc['kind']}_{group}_{version}".lower()
        if not os.path.exists(os.path.join(ROOT, "k8s", "schemas", schema + ".json")):
            problem(f"{rendered}: {doc['kind']} {doc['metadata'].get('name')} ({doc['apiVersion']}) has no schema "
                    f"k8s/schemas/{schema}.json")
            continue
        with open(os.path.join(outdir, f"{schema}--{doc['metadata']['name']}.yaml"), "w", encoding="utf-8") as f:
            yaml.safe_dump(doc, f, sort_keys=False)
    with open(os.path.join(outdir, "core.yaml"), "w", encoding="utf-8") as f:
        yaml.safe_dump_all(core, f, sort_keys=False)
    print(f"{rendered}: {len(core)} built-in objects, {len(docs) - len(core)} custom resources")


def main(argv):
    if len(argv) == 3 and argv[1] == "dashboard-rules":
        rules = dashboard_rules()
        write_rules(rules, argv[2])
        print(f"{len(rules)} dashboard queries written to {argv[2]}")
    elif len(argv) == 2 and argv[1] == "consistency":
        consistency()
    elif len(argv) == 4 and argv[1] == "split":
        split(argv[2], argv[3])
    else:
        print(__doc__, file=sys.stderr)
        return 2
    for message in problems:
        print(message, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
