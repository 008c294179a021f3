"""The workspace and the run directories in it: the local source of truth for every run.

Layout (root: `--workspace`, else `$RESLAB_WORKSPACE`, else `./reslab-runs`):

    <root>/mlflow.db                       the embedded MLflow store (SQLite)
    <root>/mlartifacts/                    MLflow artifacts of the embedded store
    <root>/cache/<study>.parquet           results.collect's runs table
    <root>/runs/<study>/<run_id>/
        spec.json          the RunSpec: canonical resolved config, arm, grid point, seed, ids
        env.json           versions, host, GPU, git sha + dirty flag (+ diff hash)
        status             JSON {"state": RUNNING|SUCCESS|FAILED|INTERRUPTED, "error", ...}
        lease              JSON {host, pid, pid_start, submission, heartbeat}: who runs it now
        metrics.jsonl      one line per train log / eval, {"kind", "step", ...metrics, "time"}
        diagnostics.jsonl  one line per eval with routing diagnostics
        summary.json       the final summary and run info
        checkpoint.pt      written and resumed by models.training.train
        train.log          the training loop's log lines

The worker writes `SUCCESS` last, after metrics and summary are flushed to disk, so `SUCCESS`
means the record is complete (marin's rule). A run is claimed under an `flock` on `.lock`; the
lease says who holds it and is refreshed by a heartbeat thread. A lease is stale when its
holder's process is gone (checked directly when it ran on this host: pid plus process start time,
so a recycled pid does not look alive) or its heartbeat is older than the lease timeout (any
host). A stale `RUNNING` run is taken over and resumes from its checkpoint.

On a multi-node cluster the workspace belongs on a filesystem every node mounts at the same
path (NFS, a cloud file store): workers write their run directories and checkpoints there. Without
one, the driver still mirrors each finished run's record from the worker's result into its own
copy (so planning skips it next time), but a run interrupted on another node can only resume
from its checkpoint if it lands on that node again.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

DEFAULT_WORKSPACE = "reslab-runs"
RUNNING, SUCCESS, FAILED, INTERRUPTED = "RUNNING", "SUCCESS", "FAILED", "INTERRUPTED"
STATES = (RUNNING, SUCCESS, FAILED, INTERRUPTED)
DEFAULT_LEASE_TIMEOUT_S = 120.0
HEARTBEAT_S = 10.0


def resolve_workspace(arg: str | os.PathLike | None = None) -> Path:
    """`--workspace`, else `$RESLAB_WORKSPACE`, else `./reslab-runs`; always absolute."""
    root = arg or os.environ.get("RESLAB_WORKSPACE") or DEFAULT_WORKSPACE
    return Path(root).expanduser().resolve()


@dataclass(frozen=True)
class Workspace:
    root: Path

    @classmethod
    def at(cls, arg: str | os.PathLike | None = None) -> Workspace:
        return cls(resolve_workspace(arg))

    @property
    def mlflow_db(self) -> Path:
        return self.root / "mlflow.db"

    @property
    def artifacts(self) -> Path:
        return self.root / "mlartifacts"

    @property
    def cache(self) -> Path:
        return self.root / "cache"

    def default_tracking_uri(self) -> str:
        return f"sqlite:///{self.mlflow_db}"

    def tracking_uri(self, arg: str | None = None) -> str:
        """`--tracking-uri`, else `$MLFLOW_TRACKING_URI`, else the workspace's SQLite file."""
        return arg or os.environ.get("MLFLOW_TRACKING_URI") or self.default_tracking_uri()

    def study_dir(self, study: str) -> Path:
        return self.root / "runs" / study

    def run_dir(self, study: str, run_id: str) -> RunDir:
        return RunDir(self.study_dir(study) / run_id)


# ----------------------------------------------------------------------------- files


def write_json(path: Path, data: Any) -> None:
    """Atomic: write a sibling, fsync, rename; a reader never sees half a file."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True, allow_nan=True, default=str)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_json(path: Path) -> Any | None:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Every complete line; a torn last line (a crash mid-write) is ignored."""
    rows = []
    try:
        text = path.read_text()
    except FileNotFoundError:
        return rows
    for line in text.splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def proc_start(pid: int) -> str | None:
    """The process start time in clock ticks since boot (Linux), to tell a pid from its reuse."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def process_alive(host: str | None, pid: int | None, pid_start: str | None = None) -> bool | None:
    """True/False for a process on this host; None when it ran elsewhere (cannot tell)."""
    if host != socket.gethostname() or pid is None:
        return None
    if not _pid_alive(int(pid)):
        return False
    return pid_start is None or proc_start(int(pid)) in (None, pid_start)


def lease_for(submission: str) -> dict[str, Any]:
    pid = os.getpid()
    return {
        "host": socket.gethostname(), "pid": pid, "pid_start": proc_start(pid),
        "submission": submission, "heartbeat": time.time(),
    }


def lease_state(lease: dict[str, Any] | None, timeout: float, now: float | None = None) -> tuple[bool, str]:
    """(live, why) for a lease file's content."""
    if not lease:
        return False, "no lease"
    now = time.time() if now is None else now
    age = now - float(lease.get("heartbeat", 0))
    holder = f"pid {lease.get('pid')} on {lease.get('host')}"
    if process_alive(lease.get("host"), lease.get("pid"), lease.get("pid_start")) is False:
        return False, f"{holder} is gone"
    if age > timeout:
        return False, f"{holder}: no heartbeat for {age:.0f}s (timeout {timeout:.0f}s)"
    return True, f"{holder}, heartbeat {age:.0f}s ago"


# ----------------------------------------------------------------------------- a run directory


@dataclass(frozen=True)
class RunDir:
    path: Path

    spec_file = property(lambda self: self.path / "spec.json")
    env_file = property(lambda self: self.path / "env.json")
    status_file = property(lambda self: self.path / "status")
    lease_file = property(lambda self: self.path / "lease")
    metrics_file = property(lambda self: self.path / "metrics.jsonl")
    diagnostics_file = property(lambda self: self.path / "diagnostics.jsonl")
    summary_file = property(lambda self: self.path / "summary.json")
    log_file = property(lambda self: self.path / "train.log")

    @property
    def run_id(self) -> str:
        return self.path.name

    def status(self) -> dict[str, Any] | None:
        return read_json(self.status_file)

    def state(self) -> str | None:
        status = self.status()
        return status.get("state") if status else None

    def lease(self) -> dict[str, Any] | None:
        return read_json(self.lease_file)

    def set_status(self, state: str, **fields: Any) -> dict[str, Any]:
        if state not in STATES:
            raise ValueError(f"unknown run state {state!r}; allowed: {', '.join(STATES)}")
        previous = self.status() or {}
        keep = {k: previous[k] for k in ("checkpoint_step", "attempts") if k in previous}
        status = {**keep, "state": state, "time": time.time(), **fields}
        if state in (SUCCESS, RUNNING):
            status.pop("error", None)
            status.pop("traceback", None)
        write_json(self.status_file, status)
        return status

    def update_status(self, **fields: Any) -> dict[str, Any]:
        """Merge fields into the current status, keeping its state."""
        status = {**(self.status() or {"state": RUNNING}), **fields, "time": time.time()}
        write_json(self.status_file, status)
        return status

    def metrics(self) -> list[dict[str, Any]]:
        return read_jsonl(self.metrics_file)

    def diagnostics(self) -> list[dict[str, Any]]:
        return read_jsonl(self.diagnostics_file)

    def summary(self) -> dict[str, Any] | None:
        return read_json(self.summary_file)

    def spec(self) -> dict[str, Any] | None:
        return read_json(self.spec_file)

    def env(self) -> dict[str, Any] | None:
        return read_json(self.env_file)

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """An exclusive `flock` on `<run dir>/.lock` for a claim's read-modify-write."""
        self.path.mkdir(parents=True, exist_ok=True)
        with open(self.path / ".lock", "a+") as f:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f.fileno(), fcntl.LOCK_UN)

    def claim(self, submission: str, timeout: float) -> tuple[str, str]:
        """Take the run for this process: ("run", why) or ("done" | "busy", why) to leave it.

        Done when `SUCCESS`; busy when another submission holds a live lease. A lease of our own
        submission is ours to take over: the driver resubmits only after the attempt ended.
        """
        with self.locked():
            status = self.status() or {}
            if status.get("state") == SUCCESS:
                return "done", "already succeeded"
            lease = self.lease()
            if lease and lease.get("submission") != submission:
                live, why = lease_state(lease, timeout)
                if live:
                    return "busy", f"held by submission {lease.get('submission')}: {why}"
            write_json(self.lease_file, lease_for(submission))
            return "run", "claimed"

    def heartbeat(self, submission: str) -> None:
        lease = self.lease()
        if lease and lease.get("submission") == submission and lease.get("pid") == os.getpid():
            write_json(self.lease_file, {**lease, "heartbeat": time.time()})

    def release(self, submission: str) -> None:
        lease = self.lease()
        if lease and lease.get("submission") == submission:
            self.lease_file.unlink(missing_ok=True)
