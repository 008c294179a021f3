"""What a run ran on: package versions, host, accelerator and the code version.

The code version is taken once per submission by the driver (workers on a cluster may not have
the repository) with read-only git commands (`--no-optional-locks`, so not even the index is
refreshed): the commit, a dirty flag and a hash of `git diff HEAD`, which tells two dirty trees
apart. It is recorded as a tag and in `env.json`, never hashed into run ids.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import platform
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("torch", "numpy", "triton", "ray", "mlflow", "pandas", "pyarrow", "scipy", "reslab")


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(
            ["git", "--no-optional-locks", "-C", str(REPO_ROOT), *args],
            capture_output=True, text=True, timeout=20, check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout


def code_version() -> dict[str, Any]:
    """{"git_sha": str | None, "git_dirty": bool | None, "git_diff_sha256": str | None}."""
    if shutil.which("git") is None or _git("rev-parse", "--is-inside-work-tree") is None:
        return {"git_sha": None, "git_dirty": None, "git_diff_sha256": None}
    sha = _git("rev-parse", "--verify", "-q", "HEAD")
    porcelain = _git("status", "--porcelain", "--untracked-files=no") or ""
    diff = _git("diff", "HEAD") if sha else None
    return {
        "git_sha": sha.strip() if sha else None,
        # a repository without commits is dirty by definition: nothing identifies the code
        "git_dirty": bool(porcelain.strip()) or not sha,
        "git_diff_sha256": hashlib.sha256(diff.encode()).hexdigest() if diff else None,
    }


def short_code_version(code: dict[str, Any]) -> str:
    """`abc123def456`, `abc123def456+dirty` or `uncommitted`: the MLflow `code_version` tag."""
    if not code.get("git_sha"):
        return "uncommitted"
    return code["git_sha"][:12] + ("+dirty" if code.get("git_dirty") else "")


def _versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for name in PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def _gpus() -> list[str]:
    if shutil.which("nvidia-smi") is None:
        return []
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=20, check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.strip() for line in out.stdout.splitlines() if line.strip()]


def environment(code: dict[str, Any]) -> dict[str, Any]:
    """The `env.json` of a run, taken in the worker (host and GPUs are the worker's)."""
    return {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "host": socket.gethostname(),
        "cpu_count": os.cpu_count(),
        "gpus": _gpus(),
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "versions": _versions(),
        **code,
    }
