#!/usr/bin/env python3
"""Copy deploy/prometheus/rules/volley.rules.yaml's groups into the operator's PrometheusRule
(k8s/components/monitoring/prometheusrule.yaml), keeping its header; .ci/ops_checks.py fails
when the two differ. Usage: .ci/sync-prometheusrule.py (needs PyYAML: .ci/venv/bin/python)."""

from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
rules = yaml.safe_load((ROOT / "deploy/prometheus/rules/volley.rules.yaml").read_text())
target = ROOT / "k8s/components/monitoring/prometheusrule.yaml"
text = target.read_text()
header = "".join(line + "\n" for line in text.splitlines() if line.startswith("#"))
doc = yaml.safe_load(text)
doc["spec"]["groups"] = rules["groups"]


def folded(dumper, value):
    # Long expressions and annotations as folded blocks (`>-`), as written by hand.
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=">" if len(value) > 80 else None)


yaml.add_representer(str, folded, Dumper=yaml.SafeDumper)
target.write_text(header + yaml.safe_dump(doc, sort_keys=False, width=100))
print(f"wrote {target}")
