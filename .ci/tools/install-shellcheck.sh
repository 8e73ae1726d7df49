#!/usr/bin/env bash
# Installs shellcheck (used by tests/unit/test_lint.py) from the Debian archive.
# Idempotent and fast when it is already installed: it only checks `command -v`.
# Needs root (or passwordless sudo) the first time; `apt-get update` runs only
# when the package index does not know the package yet.
set -euo pipefail

if command -v shellcheck >/dev/null 2>&1; then
    exit 0
fi

SUDO=()
if [ "$(id -u)" -ne 0 ]; then
    if command -v sudo >/dev/null 2>&1; then
        SUDO=(sudo)
    else
        echo "install-shellcheck: not root and no sudo; install shellcheck yourself" >&2
        exit 1
    fi
fi

if ! apt-cache show shellcheck >/dev/null 2>&1; then
    "${SUDO[@]}" apt-get update -qq
fi
DEBIAN_FRONTEND=noninteractive "${SUDO[@]}" apt-get install -y -qq --no-install-recommends shellcheck >/dev/null
shellcheck --version | head -n 2
