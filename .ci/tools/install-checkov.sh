#!/usr/bin/env bash
# Installs checkov, the policy scanner run over the rendered Kubernetes manifests
# (tests/unit/test_k8s.py), into its own virtual environment .venv-tools/checkov:
# checkov pins dozens of packages that clash with the project's runtime pins.
# Idempotent: returns at once when this version is already installed.
set -euo pipefail
cd "$(dirname "$0")/../.."

CHECKOV_VERSION=3.3.30
VENV=.venv-tools/checkov
STAMP="${VENV}/.installed-${CHECKOV_VERSION}"

if [ -f "${STAMP}" ] && [ -x "${VENV}/bin/checkov" ]; then
    exit 0
fi

echo "install-checkov: installing checkov ${CHECKOV_VERSION} into ${VENV}" >&2
rm -rf "${VENV}"
python3 -m venv "${VENV}"
"${VENV}/bin/python" -m pip install --quiet --disable-pip-version-check "checkov==${CHECKOV_VERSION}"
"${VENV}/bin/checkov" --version >/dev/null
touch "${STAMP}"
