#!/usr/bin/env python3
"""Turn a CustomResourceDefinition into strict JSON schemas for check-jsonschema.

    python3 crd2jsonschema.py CRD.yaml [CRD.yaml ...]

writes `<kind>_<group>_<version>.json` (lowercase) beside this script for every served version.
The API server prunes unknown fields of a custom resource silently; these schemas reject them
instead (`additionalProperties: false` on every object that lists its properties and does not
preserve unknown fields), so a misspelt field fails CI rather than vanishing on apply.
Needs PyYAML. The files here were made from the CRDs named in README.md.
"""

import json
import os
import sys

import yaml


def strict(node):
    """Recursively close every object schema that lists its properties."""
    if isinstance(node, dict):
        # Go regular expressions may carry inline flags, which JSON Schema's ECMA-262 dialect
        # lacks (e.g. `^(?i)(abort|warn)?$`); such a pattern is dropped, the type check stays.
        if isinstance(node.get("pattern"), str) and "(?" in node["pattern"]:
            del node["pattern"]
        if node.get("type") == "object" and "properties" in node and "additionalProperties" not in node \
                and not node.get("x-kubernetes-preserve-unknown-fields"):
            node["additionalProperties"] = False
        for value in node.values():
            strict(value)
    elif isinstance(node, list):
        for value in node:
            strict(value)
    return node


def convert(crd):
    group = crd["spec"]["group"]
    kind = crd["spec"]["names"]["kind"]
    for version in crd["spec"]["versions"]:
        if not version.get("served", True):
            continue
        schema = strict(version["schema"]["openAPIV3Schema"])
        schema["properties"]["apiVersion"] = {"const": f"{group}/{version['name']}"}
        schema["properties"]["kind"] = {"const": kind}
        schema["properties"]["metadata"] = {"type": "object"}
        schema["required"] = sorted(set(schema.get("required", [])) | {"apiVersion", "kind", "metadata"})
        schema = {"$schema": "http://json-schema.org/draft-07/schema#",
                  "title": f"{kind} ({group}/{version['name']})", **schema}
        name = f"{kind}_{group}_{version['name']}.json".lower()
        with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), name), "w", encoding="utf-8") as f:
            json.dump(schema, f, indent=1, sort_keys=True)
            f.write("\n")
        print(name)


if __name__ == "__main__":
    for path in sys.argv[1:]:
        with open(path, encoding="utf-8") as f:
            for doc in yaml.safe_load_all(f):
                if doc and doc.get("kind") == "CustomResourceDefinition":
                    convert(doc)
