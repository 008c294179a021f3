"""The workspace and the run directories in it: the local source of truth for every run.

Layout (root: `--workspace`, else `$RESLAB_WORKSPACE`, else `./reslab-runs`):

    <root>/mlflow.db                       the embedded MLflow store (SQLite)
    <root>/mlartifacts/                    MLflow artifacts of the embedded store
    <root>/.tracking.lock                  flock: the store's creation and child-run creation, one driver at a time
    <root>/cache/<study>.parquet           results.collect's runs table
    <root>/runs/<study>/<run_id>/
        spec.json          the RunSpec: canonical resolved config, arm, grid point, seed, ids
        env.json           versions, host, GPU, git sha + dirty flag (+ diff hash)
        status             JSON {"state": RUNNING|SUCCESS|FAILED|INTERRUPTED, "error", "host", "node", ...}
        lease              JSON {host, pid, pid_start, submission, heartbeat, heartbeat_s, token}: who runs it now
        fence              the last fencing token handed out for this run (an integer, only grows)
        metrics.jsonl      one line per train log / eval, {"kind", "step", ...metrics, "time"}
        diagnostics.jsonl  one line per eval with routing diagnostics
        summary.json       the final summary and run info
        checkpoint.pt      written and resumed by models.training.train
        checkpoint.dcp/    instead, for a run on N ranks: step-NNNNNN/ folders, each a checkpoint once
                           its COMMITTED marker exists (models.checkpoint; `storage.has_checkpoint`)
        train.log          the training loop's log lines

The worker writes `SUCCESS` last, after metrics and summary are flushed to disk, so `SUCCESS`
means the record is complete (marin's rule). `summary.json` is written only after the final
checkpoint, so a run directory with a readable summary is complete even when its `status` file is
lost: it is never trained again (`RunDir.complete`).

Leases. A run is claimed under an `flock` on `<run dir>/.lock`; the claim hands out a fencing
token (one more than the last, kept in `fence`) and writes the lease, which the holder's heartbeat
thread renews. A lease is stale (`orchestrator.durability.lease`) when its holder's process is gone (checked
directly when it ran on this host: pid plus process start time, so a recycled pid does not look
alive) or its heartbeat is older than the lease timeout, and never sooner than three of the
holder's own heartbeat intervals (any host); lease timeouts below `MIN_LEASE_TIMEOUT_S` are
refused. A stale `RUNNING` run is taken over and resumes from its checkpoint. Every state change
of a holder (a checkpoint's rename, the summary and `SUCCESS`, a status update, a heartbeat)
happens under the lock after checking that the lease still carries its token (`RunDir.fenced`),
so a holder that was taken over, however slow, can no longer write: it gets `LeaseLost`.

The locks need a filesystem where `flock` works across every process that opens the workspace:
local disks do; on NFS, `flock` is emulated with POSIX locks on Linux >= 2.6.12 (NFSv4 or a
lockd), so it works between nodes only when the mount has locking enabled (not `nolock`).

On a multi-node cluster, either the workspace is on a filesystem every node mounts at the same
path (NFS, a cloud file store), and workers write their run directories there; or the workspace
has run storage (`--storage URI`, `orchestrator.durability.storage`): workers train in node-local scratch
directories (`$RESLAB_SCRATCH/<study>/<run_id>`), pull a run from storage before claiming it and
push it after every checkpoint and attempt, and the driver pulls the records into this workspace.
Leases and fencing then hold per node (on the scratch directory); across nodes, one driver per
study at a time dispatching each run to one worker at a time is what keeps one writer per run.
With neither, the driver mirrors each finished run's record from the worker's result into its own
copy (so planning skips it next time), but a run interrupted on another node can only resume
from its checkpoint if it lands on that node again.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from reslab.common.errors import ConfigError, ReslabError
from reslab.common.io import file_lock, write_atomic
from reslab.orchestrator.durability.fastjson import loads
from reslab.orchestrator.durability.lease import HEARTBEAT_S, is_number, lease_for, lease_state
from reslab.orchestrator.tasks import RECORDED, RUNNING, SUCCESS, Action, summary_complete

if TYPE_CHECKING:
    from reslab.orchestrator.durability.storage import RunStorage

DEFAULT_WORKSPACE = "reslab-runs"


DEFAULT_LEASE_TIMEOUT_S = 120.0
MIN_LEASE_TIMEOUT_S = 10.0
log = logging.getLogger(__name__)
T = TypeVar("T")


class LeaseLost(ReslabError):
    """This process's lease on a run was taken over; it must stop writing the run directory."""

    exit_code = 1


def check_lease_timeout(seconds: float) -> float:
    """`--lease-timeout` must leave a live holder time to renew its lease."""
    if not (math.isfinite(seconds) and seconds >= MIN_LEASE_TIMEOUT_S):
        raise ConfigError(f"--lease-timeout: {seconds:g} s is not allowed; allowed: a number of seconds >= "
                          f"{MIN_LEASE_TIMEOUT_S:g} (a live run renews its lease every "
                          f"min({HEARTBEAT_S:g} s, timeout/4))")
    return seconds


def heartbeat_interval(lease_timeout_s: float, heartbeat_s: float = HEARTBEAT_S) -> float:
    """At least four renewals per lease timeout."""
    return min(heartbeat_s, lease_timeout_s / 4)


def resolve_workspace(arg: str | os.PathLike | None = None) -> Path:
    """`--workspace`, else `$RESLAB_WORKSPACE`, else `./reslab-runs`; always absolute."""
    root = arg or os.environ.get("RESLAB_WORKSPACE") or DEFAULT_WORKSPACE
    return Path(root).expanduser().resolve()


@dataclass(frozen=True)
class Workspace:
    """The local workspace, and the run storage its run directories are kept in when one is set.

    `storage` (`--storage`, else `$RESLAB_STORAGE`; `orchestrator.durability.storage`) is a URI: with it, the
    run directories under `root` are the driver's copy of the records it pulls from storage; without
    it they are the only copy.
    """

    root: Path
    storage: str | None = None

    @classmethod
    def at(cls, arg: str | os.PathLike | None = None, storage: str | None = None) -> Workspace:
        """`storage` falls back to `$RESLAB_STORAGE`; a URI that cannot be opened is a ConfigError."""
        from reslab.orchestrator.durability.storage import RunStorage, resolve_storage

        uri = resolve_storage(storage)
        return cls(resolve_workspace(arg), RunStorage.at(uri).uri if uri else None)

    def run_storage(self) -> RunStorage | None:
        """The opened run storage, None when the workspace has none."""
        from reslab.orchestrator.durability.storage import RunStorage

        return RunStorage.at(self.storage) if self.storage else None

    @property
    def mlflow_db(self) -> Path:
        return self.root / "mlflow.db"

    @property
    def artifacts(self) -> Path:
        return self.root / "mlartifacts"

    @property
    def cache(self) -> Path:
        return self.root / "cache"

    @property
    def tracking_lock(self) -> Path:
        """Serialises the MLflow store's creation and child-run creation between drivers."""
        return self.root / ".tracking.lock"

    def default_tracking_uri(self) -> str:
        """The SQLite file's URI. SQLAlchemy reads a `?` in it as the start of the query and unquotes `%XX` in
        the path, so those two are percent-quoted (a workspace `ws_q?x=1` is not the file `ws_q`); a space, `#`
        or a non-ASCII letter it reads as written, and they stay readable."""
        return "sqlite:///" + str(self.mlflow_db).replace("%", "%25").replace("?", "%3F")

    def tracking_uri(self, arg: str | None = None) -> str:
        """`--tracking-uri`, else `$MLFLOW_TRACKING_URI`, else the workspace's SQLite file."""
        return arg or os.environ.get("MLFLOW_TRACKING_URI") or self.default_tracking_uri()

    def study_dir(self, study: str) -> Path:
        return self.root / "runs" / study

    def recorded_ids(self, study: str) -> frozenset[str]:
        """The run ids the study has a run directory for: one listing of the study's folder, whatever its size,
        so nothing looks for the run directory of each of a study's runs (a run without one is new)."""
        try:
            with os.scandir(self.study_dir(study)) as entries:
                return frozenset(e.name for e in entries if e.is_dir())
        except (FileNotFoundError, NotADirectoryError):
            return frozenset()

    def run_dir(self, study: str, run_id: str) -> RunDir:
        return RunDir(self.study_dir(study) / run_id)


# ----------------------------------------------------------------------------- files


def write_json(path: Path, data: Any) -> None:
    """Atomic (`common.io.write_atomic`): a reader never sees half a file."""
    write_atomic(path, json.dumps(data, indent=1, sort_keys=True, allow_nan=True, default=str) + "\n")


_REPORTED: set[tuple[str, int, int]] = set()  # damaged files warned of, by (path, size, mtime): once a version


def read_json(path: Path, *, rewritten: bool = False) -> Any | None:
    """The file's JSON, or None when it is missing; a damaged file reads as None and is reported once per
    version of it. `rewritten`: a file the run's next attempt writes again (status, lease, summary, fence), so
    the warning says so rather than asking the user to repair it."""
    try:
        return loads(path.read_bytes())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        try:
            stat = path.stat()
            key = (str(path), stat.st_size, stat.st_mtime_ns)
        except OSError:
            key = (str(path), -1, -1)
        if key not in _REPORTED:
            _REPORTED.add(key)
            advice = "reslab writes it again at the run's next attempt" if rewritten else \
                "Delete it or restore it from a backup"
            log.warning("%s: unreadable (%s); ignored. %s", path, type(exc).__name__, advice)
        return None


def metrics_row_ok(row: Any) -> bool:
    """A metrics.jsonl row has the shape every reader relies on."""
    if not (isinstance(row, dict) and isinstance(row.get("step"), int) and is_number(row.get("time"))):
        return False
    kind = row.get("kind")
    return (kind == "train" and is_number(row.get("train_loss"))) or \
        (kind == "eval" and is_number(row.get("val_loss")))


def diagnostics_row_ok(row: Any) -> bool:
    return isinstance(row, dict) and isinstance(row.get("step"), int) and not isinstance(row.get("step"), bool)


def read_jsonl(path: str | Path, valid: Callable[[Any], bool] = diagnostics_row_ok,
               containing: bytes | None = None) -> list[dict[str, Any]]:
    """Every complete line that parses and has the expected shape (`valid`); with `containing`, only the lines
    whose text holds those bytes are parsed and checked (a report reads the eval rows of 10^5 runs' metrics,
    a few among many train rows).

    A torn last line (a crash mid-write) is dropped silently; any other bad line (a bad byte,
    broken JSON, a row of the wrong shape) is dropped with a warning naming the file and line,
    so one damaged line costs that line, never the run or the study.
    """
    try:
        with open(path, "rb") as file:
            data = file.read()
    except FileNotFoundError:
        return []
    except OSError as exc:
        log.warning("%s: unreadable (%s); its rows are left out", path, exc)
        return []
    lines = data.split(b"\n")
    if lines and not data.endswith(b"\n"):
        lines.pop()  # torn last line
    rows = []
    for number, raw in enumerate(lines, 1):
        if not raw.strip() or (containing is not None and containing not in raw):
            continue
        try:
            row = loads(raw)
        except ValueError as exc:
            why = f"not valid JSON text ({type(exc).__name__})"
        else:
            if valid(row):
                rows.append(row)
                continue
            why = "a row of the wrong shape"
        log.warning("%s: line %d is %s; skipped. Delete the line to silence this; the run's other rows are used",
                    path, number, why)
    return rows


def _last_line(path: str | Path) -> bytes | None:
    """The file's last complete line, without its newline, read back from its end a block at a time (what
    follows the last newline is a torn line, never a row); None: the file has no complete line."""
    with open(path, "rb") as file:
        pos = file.seek(0, os.SEEK_END)
        tail = b""
        while pos > 0:
            block = min(pos, 1 << 16)
            pos -= block
            file.seek(pos)
            tail = file.read(block) + tail
            end = tail.rfind(b"\n")
            start = tail.rfind(b"\n", 0, end) if end >= 0 else -1
            if end >= 0 and (start >= 0 or pos == 0):
                return tail[start + 1:end]
    return None


def read_last_row(path: str | Path, valid: Callable[[Any], bool] = diagnostics_row_ok) -> dict[str, Any] | None:
    """The last row of a JSONL file as `read_jsonl` would return it (its last complete line that parses and has
    the expected shape), read from the file's end: a report needs each run's last diagnostics row, and every
    row of 10^5 runs' diagnostics was seconds of parsing (issue 39). When the last complete line is blank,
    broken or of the wrong shape, the whole file is read (`read_jsonl`, which names each bad line). None: no
    such row, or no file."""
    try:
        line = _last_line(path)
    except FileNotFoundError:
        return None
    except OSError as exc:
        log.warning("%s: unreadable (%s); its rows are left out", path, exc)
        return None
    if line is None:
        return None
    try:
        row = loads(line)
    except ValueError:
        row = None
    if valid(row):
        return row
    rows = read_jsonl(path, valid)
    return rows[-1] if rows else None


def read_metrics(path: str | Path, kind: str | None = None) -> list[dict[str, Any]]:
    """The rows of a run's `metrics.jsonl` at `path`; with `kind` (`train`, `eval`), that kind's rows only."""
    if kind is None:
        return read_jsonl(path, metrics_row_ok)
    # a row of that kind holds `"<kind>"` as JSON text (json.dumps escapes no letter): the others are not parsed
    return [row for row in read_jsonl(path, metrics_row_ok, f'"{kind}"'.encode()) if row.get("kind") == kind]


READ_AHEAD_CHUNK = 512  # runs read between two looks at the pace
COLD_S_PER_RUN = 3e-4  # slower than this a run: its files are not in the page cache (warm: ~1e-4 s for 3 files)
READ_AHEAD_THREADS = 4


def read_runs_in_order(study_dir: Path, run_ids: Sequence[str], files: Sequence[str],
                       read: Callable[[int], T]) -> Iterator[T]:
    """`read(i)` for each run `run_ids[i]`, in order, on this thread; `files` are the names `read` opens in each
    run's folder under `study_dir`.

    Parsing small files is Python work that threads only slow down (the GIL: 10^5 runs' status, summary and
    metrics read in 8.5 s on one thread, 30 s on eight, page cache warm). Reading them from a cold cache waits
    on the disk (73 s on one thread). So runs are read `READ_AHEAD_CHUNK` at a time on this thread, and once a
    chunk reads slower than `COLD_S_PER_RUN` a run, a few threads ask the kernel to fetch the next chunks' files
    into the page cache ahead of it (`posix_fadvise(WILLNEED)`: cold, 73 -> 28 s; issue 39)."""
    base = os.fspath(study_dir)

    def fetch_ahead(start: int) -> None:
        for run_id in run_ids[start:start + READ_AHEAD_CHUNK]:
            for name in files:
                try:
                    fd = os.open(os.path.join(base, run_id, name), os.O_RDONLY)
                except OSError:
                    continue
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
                finally:
                    os.close(fd)

    pool: ThreadPoolExecutor | None = None
    ahead: dict[int, Future[None]] = {}
    try:
        for start in range(0, len(run_ids), READ_AHEAD_CHUNK):
            if start in ahead:
                ahead.pop(start).result()
            began = time.perf_counter()
            yield from (read(i) for i in range(start, min(start + READ_AHEAD_CHUNK, len(run_ids))))
            cold = time.perf_counter() - began > COLD_S_PER_RUN * READ_AHEAD_CHUNK
            if cold and pool is None and hasattr(os, "posix_fadvise"):
                pool = ThreadPoolExecutor(max_workers=READ_AHEAD_THREADS, thread_name_prefix="read-ahead")
            if pool is not None:  # keep the next 2 x READ_AHEAD_THREADS chunks asked for
                horizon = min(start + (2 * READ_AHEAD_THREADS + 1) * READ_AHEAD_CHUNK, len(run_ids))
                for later in range(start + READ_AHEAD_CHUNK, horizon, READ_AHEAD_CHUNK):
                    if later not in ahead:
                        ahead[later] = pool.submit(fetch_ahead, later)
    finally:
        if pool is not None:
            pool.shutdown(cancel_futures=True)


# ----------------------------------------------------------------------------- a run directory


class UnitFiles:
    """The two files of one unit of work after training (an evaluation, an intervention) in its folder of the
    run directory: its records, and its marker, written last, so the unit is done when both exist. A subclass
    (a frozen dataclass with a `directory`) names them: `stem` and the records' suffix."""

    directory: Path  # the subclass's field (this base is no dataclass: the subclass keeps its own field order)
    records_suffix: ClassVar[str] = ""

    @property
    def stem(self) -> str:
        raise NotImplementedError(f"{type(self).__name__} must name its files (stem)")

    @property
    def records(self) -> Path:
        return self.directory / f"{self.stem}{self.records_suffix}"

    @property
    def marker(self) -> Path:
        return self.directory / f"{self.stem}.json"

    def done(self) -> bool:
        return self.marker.is_file() and self.records.is_file()


METRICS_FILE = "metrics.jsonl"  # a run's training curve, one JSON row a line (`metrics_row_ok`)
DIAGNOSTICS_FILE = "diagnostics.jsonl"  # a run's diagnostics at each eval (routing, magnitudes, D_eff)


@dataclass(frozen=True)
class RunDir:
    path: Path

    spec_file = property(lambda self: self.path / "spec.json")
    env_file = property(lambda self: self.path / "env.json")
    status_file = property(lambda self: self.path / "status")
    lease_file = property(lambda self: self.path / "lease")
    metrics_file = property(lambda self: self.path / METRICS_FILE)
    diagnostics_file = property(lambda self: self.path / DIAGNOSTICS_FILE)
    summary_file = property(lambda self: self.path / "summary.json")
    log_file = property(lambda self: self.path / "train.log")
    fence_file = property(lambda self: self.path / "fence")

    @property
    def run_id(self) -> str:
        return self.path.name

    def status(self) -> dict[str, Any] | None:
        status = read_json(self.status_file, rewritten=True)
        return status if isinstance(status, dict) else None

    def state(self) -> str | None:
        status = self.status()
        return status.get("state") if status else None

    def lease(self) -> dict[str, Any] | None:
        lease = read_json(self.lease_file, rewritten=True)
        return lease if isinstance(lease, dict) else None

    def complete(self) -> bool:
        """Training finished: `summary.json` holds a whole summary (`tasks.summary_complete`; it is written
        after the final checkpoint), whatever the `status` file says or whether it exists. A `SUCCESS`
        beside a damaged summary is not finished: the run is trained again, which resumes from its final
        checkpoint and returns the result stored there."""
        return summary_complete(read_json(self.summary_file, rewritten=True))

    def set_status(self, state: str, **fields: Any) -> dict[str, Any]:
        if state not in RECORDED:
            raise ValueError(f"unknown run state {state!r}; allowed: {', '.join(RECORDED)}")
        previous = self.status() or {}
        # what the status keeps from one state to the next: the checkpoint, the attempts so far, and where the
        # last attempt ran (`host`, `node`: the copy its node holds, which the driver may have that node push)
        keep: dict[str, Any] = {k: previous[k] for k in ("checkpoint_step", "attempts", "host", "node")
                                if k in previous}
        status: dict[str, Any] = {**keep, "state": state, "time": time.time(), **fields}
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

    def metrics(self, kind: str | None = None) -> list[dict[str, Any]]:
        """The rows of `metrics.jsonl`; with `kind` (`train`, `eval`), that kind's rows only."""
        return read_metrics(self.metrics_file, kind)

    def diagnostics(self) -> list[dict[str, Any]]:
        return read_jsonl(self.diagnostics_file)

    def summary(self) -> dict[str, Any] | None:
        summary = read_json(self.summary_file, rewritten=True)
        return summary if isinstance(summary, dict) else None

    def spec(self) -> dict[str, Any] | None:
        spec = read_json(self.spec_file)
        return spec if isinstance(spec, dict) else None

    def env(self) -> dict[str, Any] | None:
        env = read_json(self.env_file)
        return env if isinstance(env, dict) else None

    def locked(self) -> contextlib.AbstractContextManager[None]:
        """An exclusive `flock` on `<run dir>/.lock` for a claim's read-modify-write."""
        return file_lock(self.path / ".lock")

    def token(self) -> int | None:
        """The fencing token of the current lease, None when there is none."""
        token = (self.lease() or {}).get("token")
        return token if isinstance(token, int) else None

    def claim(self, submission: str, timeout: float, heartbeat_s: float = HEARTBEAT_S) -> tuple[Action, str, int]:
        """Take the run for this process: (RUN, why, token) or (SKIP | BUSY, why, 0) to leave it.

        Skipped when complete (`SUCCESS` and a whole summary), or complete with its `status` lost (then
        `SUCCESS` is restored); busy when another submission holds a live lease. A `SUCCESS` whose
        summary is damaged is claimed: training resumes from the final checkpoint and rewrites it. A
        lease of our own submission is ours to take over: the driver resubmits only after the attempt
        ended. The token fences every later write (`fenced`).
        """
        with self.locked():
            status = self.status() or {}
            if status.get("state") == SUCCESS and self.complete():
                return Action.SKIP, "already succeeded", 0
            if self._restore_complete(timeout):
                return Action.SKIP, "already complete (summary.json); status restored", 0
            lease = self.lease()
            if lease and lease.get("submission") != submission:
                live, why = lease_state(lease, timeout)
                if live:
                    return Action.BUSY, f"held by submission {lease.get('submission')}: {why}", 0
            last = read_json(self.fence_file, rewritten=True)
            token = max(last if isinstance(last, int) else 0, self.token() or 0) + 1
            write_json(self.fence_file, token)
            write_json(self.lease_file, lease_for(submission, token, heartbeat_s))
            return Action.RUN, "claimed", token

    def _restore_complete(self, timeout: float) -> bool:
        """Under the lock: a complete run whose status is not `SUCCESS` and whose lease holder is
        gone gets `SUCCESS` back (a live holder is about to write it itself)."""
        status = self.status() or {}
        if status.get("state") == SUCCESS or not self.complete() or lease_state(self.lease(), timeout)[0]:
            return False
        write_json(self.status_file, {**status, "state": SUCCESS, "time": time.time(),
                                       "restored": "from summary.json: training had finished"})
        self.lease_file.unlink(missing_ok=True)
        return True

    def restore_complete(self, timeout: float) -> bool:
        """`SUCCESS` for a complete run whose status was lost or left behind; True when restored."""
        with self.locked():
            return self._restore_complete(timeout)

    @contextlib.contextmanager
    def fenced(self, token: int) -> Iterator[None]:
        """Hold the run's lock while the lease still carries `token`; `LeaseLost` otherwise."""
        with self.locked():
            lease = self.lease()
            if lease is None or lease.get("token") != token:
                holder = f"submission {lease.get('submission')} (token {lease.get('token')})" if lease else "nobody"
                raise LeaseLost(f"{self.path}: the lease with token {token} was taken over; now held by {holder}")
            yield

    def heartbeat(self, token: int) -> None:
        with self.fenced(token):
            write_json(self.lease_file, {**(self.lease() or {}), "heartbeat": time.time()})

    def release(self, submission: str, token: int | None = None) -> None:
        """Drop the lease if this submission (and, given, this token) still holds it."""
        with self.locked():
            lease = self.lease()
            if lease and lease.get("submission") == submission and token in (None, lease.get("token")):
                self.lease_file.unlink(missing_ok=True)
