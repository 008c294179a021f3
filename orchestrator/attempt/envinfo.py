"""What a run ran on: package versions, host, accelerator and the code version.

The code version is taken once per submission by the driver (workers on a cluster may not have
the repository) with read-only git commands (`--no-optional-locks`, so not even the index is
refreshed): the commit, a dirty flag and a hash of `git diff HEAD`, which tells two dirty trees
apart. It is recorded as a tag and in `env.json`, never hashed into run ids. A Ray job's driver
runs from an upload without `.git`: there `$RESLAB_CODE_VERSION`, which `reslab submit` sets to the
submitter's version, takes the place of git.

A git sha says nothing about the code a worker on another node imports, so the driver also takes
the code's fingerprint (`code_fingerprint`: a sha256 per `.py` file of the `reslab` package it
imports) and every worker recomputes it over its own import and refuses to train on a difference
(`check_code_fingerprint`, `StaleCode`). The git sha recorded for a run is therefore true of the
worker's code too; `env.json` records the worker's digest.

A variant from outside the package (issue 53: a `reslab.variants` entry point or a `pkg.module:Class` path)
is code of the run too: the driver hashes the source of every external variant it resolved
(`external_code`: per top-level module, a sha256 over its `.py` files), records it in the code version
(`external_code`, and `+ext.<hash>` in the short version, so a change to it shows as a change), and each
worker hashes the same modules where it would import them and refuses to train when one is missing or
differs (`check_code_fingerprint`, one line naming the module).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import platform
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

from reslab.common.errors import ConfigError, ReslabError

REPO_ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("torch", "numpy", "triton", "ray", "mlflow", "pandas", "pyarrow", "scipy", "reslab")
# The folders installed as `reslab.<name>` (pyproject's package-dir): the code a worker runs.
SUBPACKAGES = ("common", "models", "kernels", "experiments", "orchestrator", "results")
# The submitter's code version for a Ray job's driver (`reslab submit`), and the cap on its diff text.
CODE_VERSION_ENV = "RESLAB_CODE_VERSION"
MAX_DIFF_BYTES = 64 * 1024


class StaleCode(ReslabError, RuntimeError):
    """A worker imports different reslab code than the driver; retrying on it cannot help."""


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(
            ["git", "--no-optional-locks", "-C", str(REPO_ROOT), *args],
            capture_output=True, text=True, timeout=20, check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout


def _git_code_version() -> dict[str, Any]:
    """`code_version()` of this checkout plus "git_diff", the text of `git diff HEAD`."""
    if shutil.which("git") is None or _git("rev-parse", "--is-inside-work-tree") is None:
        return {"git_sha": None, "git_dirty": None, "git_diff_sha256": None, "git_diff": None}
    sha = _git("rev-parse", "--verify", "-q", "HEAD")
    porcelain = _git("status", "--porcelain", "--untracked-files=no") or ""
    diff = _git("diff", "HEAD") if sha else None
    return {
        "git_sha": sha.strip() if sha else None,
        # a repository without commits is dirty by definition: nothing identifies the code
        "git_dirty": bool(porcelain.strip()) or not sha,
        "git_diff_sha256": hashlib.sha256(diff.encode()).hexdigest() if diff else None,
        "git_diff": diff or None,
    }


def _submitted_code_version(text: str) -> dict[str, Any]:
    """The JSON of `$RESLAB_CODE_VERSION`, checked: a bad value is a one-line `ConfigError`."""
    expected = ("; expected the JSON object `reslab submit` sets, e.g. "
                '{"git_sha": "<40 hex>", "git_dirty": false, "git_diff_sha256": null}')
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise ConfigError(f"${CODE_VERSION_ENV}: not JSON ({exc}){expected}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"${CODE_VERSION_ENV}: got {type(data).__name__}{expected}")
    checks = {
        "git_sha": lambda v: v is None or (isinstance(v, str) and re.fullmatch(r"[0-9a-f]{40}|[0-9a-f]{64}", v)),
        "git_dirty": lambda v: v is None or isinstance(v, bool),
        "git_diff_sha256": lambda v: v is None or (isinstance(v, str) and re.fullmatch(r"[0-9a-f]{64}", v)),
        "git_diff": lambda v: v is None or isinstance(v, str),
        "git_diff_truncated": lambda v: isinstance(v, bool),
        "external_code": lambda v: isinstance(v, dict) and all(
            isinstance(k, str) and isinstance(h, str) and re.fullmatch(r"[0-9a-f]{64}", h) for k, h in v.items()),
    }
    for key, value in data.items():
        if key not in checks:
            raise ConfigError(f"${CODE_VERSION_ENV}: unknown key {key!r}; allowed: {', '.join(checks)}")
        if not checks[key](value):
            raise ConfigError(f"${CODE_VERSION_ENV}: {key}: bad value {str(value)[:80]!r}{expected}")
    return {"git_sha": None, "git_dirty": None, "git_diff_sha256": None, "git_diff": None, **data}


def code_version() -> dict[str, Any]:
    """{"git_sha": str | None, "git_dirty": bool | None, "git_diff_sha256": str | None}, and
    "external_code" ({module: sha256}, `external_code()`) when this process resolved a variant from
    outside the package.

    `$RESLAB_CODE_VERSION`, when set, overrides the checkout's: `reslab submit` puts the
    submitter's version there (`submitter_code_version`) for a Ray job, whose driver runs from an
    upload without `.git`.
    """
    submitted = os.environ.get(CODE_VERSION_ENV)
    code = _submitted_code_version(submitted) if submitted else _git_code_version()
    out = {key: code[key] for key in ("git_sha", "git_dirty", "git_diff_sha256")}
    external = external_code()
    if external:
        out["external_code"] = external
    return out


def external_sources() -> dict[str, Path]:
    """{top-level module: its source folder or file} of the variants from outside the package that this
    process resolved (`models.residual.external_sources`); {} when the variant registry is not loaded."""
    registry = sys.modules.get("reslab.models.residual")
    return dict(registry.external_sources()) if registry is not None else {}


def _source_digest(source: Path) -> str:
    """sha256 over the `.py` files of a package folder (or of one module file), each with its relative path."""
    files = sorted(source.rglob("*.py")) if source.is_dir() else [source]
    root = source if source.is_dir() else source.parent
    lines = "".join(f"{p.relative_to(root).as_posix()}\0{hashlib.sha256(p.read_bytes()).hexdigest()}\n"
                    for p in files if "__pycache__" not in p.parts)
    return hashlib.sha256(lines.encode()).hexdigest()


def external_code(sources: dict[str, Path] | None = None) -> dict[str, str]:
    """{top-level module: `_source_digest` of its source} of every external variant's module (of `sources`)."""
    return {top: _source_digest(path) for top, path in (external_sources() if sources is None else sources).items()}


def _importable_source(top: str) -> Path | None:
    """Where this process would import the top-level module `top` from, without importing it."""
    try:
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    if spec.submodule_search_locations:
        return Path(next(iter(spec.submodule_search_locations)))
    return Path(spec.origin) if spec.origin and spec.origin.endswith(".py") else None


def _json_bytes(text: str) -> int:
    return len(json.dumps(text, ensure_ascii=False).encode())


def submitter_code_version(max_diff_bytes: int = MAX_DIFF_BYTES) -> dict[str, Any]:
    """`code_version()` plus "git_diff", the text of `git diff HEAD` (None when clean), cut so that
    it takes at most `max_diff_bytes` as JSON (`json.dumps(..., ensure_ascii=False)`) with
    "git_diff_truncated": True, for an environment variable (at most 128 KiB each on Linux);
    `git_diff_sha256` stays the hash of the whole diff."""
    submitted = os.environ.get(CODE_VERSION_ENV)
    code = _submitted_code_version(submitted) if submitted else _git_code_version()
    diff = code["git_diff"]
    if diff is not None and _json_bytes(diff) > max_diff_bytes:
        while diff and _json_bytes(diff) > max_diff_bytes:
            diff = diff[: len(diff) * max_diff_bytes // _json_bytes(diff) - 1]
        code["git_diff"], code["git_diff_truncated"] = diff, True
    return code


def short_code_version(code: dict[str, Any]) -> str:
    """`abc123def456`, `abc123def456+dirty` or `uncommitted`: the MLflow `code_version` tag."""
    external = code.get("external_code") or {}
    ext = ("+ext." + hashlib.sha256(json.dumps(external, sort_keys=True).encode()).hexdigest()[:8]) if external else ""
    if not code.get("git_sha"):
        return "uncommitted" + ext
    return code["git_sha"][:12] + ("+dirty" if code.get("git_dirty") else "") + ext


@functools.cache  # once per process: a worker runs many runs, and what it has imported does not change under it
def _versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for name in PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


@functools.cache  # once per process: `nvidia-smi` takes ~0.1 s, and a node's GPUs stay what they are
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


def package_dirs() -> dict[str, Path]:
    """{subpackage name: the directory this process imports `reslab.<name>` from}, without
    executing any of them (`find_spec` of an imported one is the imported one)."""
    out: dict[str, Path] = {}
    for name in SUBPACKAGES:
        spec = importlib.util.find_spec(f"reslab.{name}")
        if spec is None or not spec.submodule_search_locations:
            raise StaleCode(f"reslab.{name} cannot be imported on {socket.gethostname()}")
        out[name] = Path(next(iter(spec.submodule_search_locations)))
    return out


def code_fingerprint(dirs: dict[str, Path] | None = None) -> dict[str, Any]:
    """{"digest": sha256 hex over the per-file hashes, "files": {"models/training.py": sha256 hex,
    ...}} of every `.py` file of the `reslab` package this process imports (or of `dirs`, as
    `package_dirs()` gives them)."""
    files: dict[str, str] = {}
    for name, root in (package_dirs() if dirs is None else dirs).items():
        for path in sorted(root.rglob("*.py")):
            files[f"{name}/{path.relative_to(root).as_posix()}"] = hashlib.sha256(path.read_bytes()).hexdigest()
    digest = hashlib.sha256("".join(f"{rel}\0{h}\n" for rel, h in sorted(files.items())).encode()).hexdigest()
    return {"digest": digest, "files": files}


def submission_code() -> dict[str, Any]:
    """What the driver hands every worker of a submission: `code_version()` and, under
    "fingerprint", `code_fingerprint()` with the external variants' `external_code()` under "external"."""
    code = code_version()
    fingerprint = code_fingerprint()
    if code.get("external_code"):
        fingerprint["external"] = code["external_code"]
    return {**code, "fingerprint": fingerprint}


def check_external_code(expected: dict[str, str], host: str) -> None:
    """Raise `StaleCode` naming the module when this process cannot import an external variant's module the
    driver resolved, or imports other code for it."""
    for top, digest in sorted(expected.items()):
        source = _importable_source(top)
        if source is None:
            raise StaleCode(f"node {host} cannot import module {top!r} (an external residual variant of this "
                            "study); install its package on every node, put it on PYTHONPATH, or run with "
                            "--ship-code on")
        if _source_digest(source) != digest:
            raise StaleCode(f"node {host} imports module {top!r} (an external residual variant) from {source}, "
                            "whose code differs from the driver's; install the driver's version there or run "
                            "with --ship-code on")


def check_code_fingerprint(expected: dict[str, Any] | None, actual: dict[str, Any], host: str) -> None:
    """Raise `StaleCode` naming the host and the differing files when this process's code is not
    the driver's; `expected` None (a caller without a driver fingerprint) checks nothing."""
    if expected is None:
        return
    check_external_code(expected.get("external") or {}, host)
    if expected.get("digest") == actual["digest"]:
        return
    theirs, ours = expected.get("files", {}), actual["files"]
    differ = sorted(rel for rel in theirs.keys() | ours.keys() if theirs.get(rel) != ours.get(rel))
    shown = ", ".join(differ[:10]) + (f" and {len(differ) - 10} more" if len(differ) > 10 else "")
    where = os.path.commonpath([str(p) for p in package_dirs().values()])
    raise StaleCode(
        f"node {host} imports reslab code that differs from the driver's in {shown} (imported from {where}); "
        "run with --ship-code on, or install the driver's reslab on that node"
    )


def environment(code: dict[str, Any]) -> dict[str, Any]:
    """The `env.json` of a run, taken in the worker (host and GPUs are the worker's); the driver's
    fingerprint is left out (the worker records its own digest)."""
    code = {k: v for k, v in code.items() if k != "fingerprint"}
    return {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "host": socket.gethostname(),
        "cpu_count": os.cpu_count(),
        "gpus": list(_gpus()),
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "versions": dict(_versions()),
        **code,
    }
