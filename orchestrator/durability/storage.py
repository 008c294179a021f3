"""Run storage: where run directories live durably when a cluster shares no filesystem.

`--storage URI` (or `$RESLAB_STORAGE`) names any location `pyarrow.fs.FileSystem.from_uri` can open:
a local or NFS path, `file:///...`, `s3://bucket/prefix?endpoint_override=host:9000&scheme=http`,
`gs://bucket/prefix`. Credentials come from the usual environment (`AWS_*`, `GOOGLE_*`); any a URI
carries (`s3://key:secret@bucket/...`) are redacted in every message (`redact`). The layout under
it is the workspace's: `<storage>/runs/<study>/<run_id>/` with the file names of a local run
directory (`orchestrator.durability.workspace`).

Who moves what:

- a worker trains in a node-local scratch directory; before claiming a run it pulls every file
  (the checkpoint included) when storage is ahead of the scratch copy, and pushes every file after
  each checkpoint and at the end of every attempt (`orchestrator.attempt.worker`);
- the driver pulls the small records (`RECORDS`: never the checkpoint) into its local workspace
  before planning and after every completion, so planning, status, compare and MLflow see what
  every node did, failures included (`orchestrator.driving.submit`);
- `reslab convert` pulls the checkpoint;
- a finished run's work after training (`AFTER`: evaluations in `evals/`, interventions in `interventions/`)
  is pushed by the task that did it, beside the run's other files in every push, and by the driver's sync for
  those storage lacks; every pull of a finished run takes the ones the local copy lacks (`StoredRun.push_after`,
  `pull_after`).

Finished means one thing everywhere: the run's `summary.json` holds a whole summary
(`tasks.summary_complete`), whatever `status` says. With storage, a run is finished for every
workspace once storage holds that; until then it is "finished locally, not yet durable": counted
by the study, never failed and never trained again, and pushed whole once storage answers. Storage
after an outage holds what it holds without one: every file of every finished run, train.log,
diagnostics and the final checkpoint included. The whole copy is the one the run finished in, on
its node: the driver's copy carries the checkpoint only when the worker trained in it (no
`$RESLAB_SCRATCH`). So when a worker's end push failed, the driver, once storage answers, has that
node push its copy (`orchestrator.driving.loop`: a push task, `RunTask.push_from`, placed on the node
the outcome names); and before planning `sync_study` pushes the workspace's copy of each finished
run storage lacks (a bucket emptied under it, a damaged stored summary), then, for those whose copy
here has no checkpoint, the driver has their nodes push theirs. Only when that node or its copy is
gone does storage keep the driver's records alone, which the driver says in a line. A copy whose
summary is damaged everywhere is trained again: it resumes from its final checkpoint, which holds
the result, so nothing is recomputed (without that checkpoint it starts over). Storage that does
not answer is waited out (`orchestrator.durability.outage`, `--outage-timeout`).

"Ahead" (`progress`): copies are ordered by (training finished, attempts, checkpoint step, attempt
ended). `summary.json` marks a finished run; `attempts` counts every attempt that started, on any
node, because a worker pulls the newer copy before it claims and counts on from it; within one
attempt the checkpoint step only grows, and an attempt's final status comes after its last
checkpoint. Equal keys mean the same progress: nothing is copied. A scratch copy whose status
names a checkpoint but that lacks `checkpoint.pt` (the driver pulled records only) is behind a
storage copy that has one.

Every object is written whole: on a local or NFS path through a temporary sibling and a rename; on
an object store each PUT (or completed multipart upload) is atomic per object. A push writes the
checkpoint first and `status` last, so a reader never sees a status that names a checkpoint the
store does not have yet. A checkpoint's push runs beside training, from a snapshot of the run
directory taken at the checkpoint (`storage_sync.StorageSync`); the end-of-attempt push waits for it.

A run on N ranks (`orchestrator.attempt.distributed_run`) checkpoints into `checkpoint.dcp/step-NNNNNN/`
folders instead of `checkpoint.pt` (`models.checkpoint`), each complete once its `COMMITTED` marker
exists. A push copies the newest committed step, its files first and the marker last, then removes
the stored steps it replaces; a pull takes the newest stored step whose marker is stored, in place
of the local DCP checkpoint, and a stored step without a marker counts as no checkpoint. Such a run
is pushed at the end of each attempt only, not after every checkpoint (the uploader lives in the
attempt's own process, and rank 0, which sees each checkpoint, is another process), so a node lost
mid-attempt loses its checkpoints since the last attempt's end. `has_checkpoint` is the one test
of "this run directory has a checkpoint", in either layout.

Guarantees across nodes: leases and fencing tokens are per node (`lease`, `fence` and `.lock` are
never copied): they stop two processes on one node from writing one run directory, not two nodes.
The driver dispatches each run to one worker at a time and retries it elsewhere only after that
worker's task ended or its node was declared dead, so with one driver per study at a time a run
has one writer. That rule is held by the study's driver marker, `<storage>/runs/<study>/driver.json`
(`hold_study`): the driver's submission, host, pid and a heartbeat it renews; a driver finding a
live marker of another submission refuses to start (`StudyBusy`), one whose holder is gone (its
pid, on the same host) or silent past the lease timeout takes it over. Object stores offer no
compare-and-swap through pyarrow, so the marker is checked again after a settle interval once
written: two drivers started within the same second can still both pass, nothing slower can.

This module sits below `orchestrator.durability.workspace`, which opens its run storage here (`Workspace.at`,
`Workspace.run_storage`): it reads run directories and workspaces through `LocalRun` and
`LocalWorkspace`, which `RunDir` and `Workspace` satisfy, and judges a driver marker with the run
directories' lease rules (`orchestrator.durability.lease`).
"""

from __future__ import annotations

import contextlib
import functools
import io
import json
import logging
import os
import re
import shutil
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Protocol
from urllib.parse import urlsplit, urlunsplit

from reslab.common.errors import ConfigError, ReslabError
from reslab.orchestrator.durability.lease import HEARTBEAT_S, lease_for, lease_state
from reslab.orchestrator.durability.outage import Outage
from reslab.orchestrator.tasks import RUNNING, summary_complete

# the checkpoint's name, as models.checkpoint.CHECKPOINT_NAME (not imported: it would load torch)
CHECKPOINT = "checkpoint.pt"
# a run on N ranks checkpoints into DCP step directories instead, as models.checkpoint lays them out
# (`DCP_DIR`, `COMMITTED`, `STEP_RE`; not imported, for the same reason):
# checkpoint.dcp/step-NNNNNN/{.metadata, __<rank>_<i>.distcp, progress.json, COMMITTED (written last)}
DCP_DIR = "checkpoint.dcp"
DCP_COMMITTED = "COMMITTED"
DCP_STEP_RE = re.compile(r"step-\d+")
# pushed in this order, status last
RECORDS = ("spec.json", "env.json", "metrics.jsonl", "diagnostics.jsonl", "train.log", "summary.json", "status")
# a finished run's work after training, one folder per kind: evaluations (`orchestrator.attempt.evaluation`:
# `<task>-<eval id>.parquet` and its `.json` marker) and interventions (`orchestrator.attempt.intervention`:
# `<id>.jsonl` and its `.json` marker), each written once under its content id, so a file either side lacks is
# copied and none is replaced
AFTER = ("evals", "interventions")
FLAG = "--storage"
ALLOWED = ("a local or NFS path, or a URI pyarrow can open: s3://bucket/prefix (an S3-compatible server: "
           "?endpoint_override=host:port&scheme=http), gs://bucket/prefix, file:///absolute/path; credentials come "
           "from the usual AWS_*/GOOGLE_* environment")
PUSH_TRIES = 3
_CHUNK = 8 << 20
log = logging.getLogger(__name__)


class StorageError(ReslabError):
    """The run storage cannot be read or written (a network error, a full disk, a permission)."""

    exit_code = 2


class LocalRun(Protocol):
    """What storage reads of a local run directory (`workspace.RunDir`): its path, status and completeness."""

    @property
    def path(self) -> Path: ...

    def status(self) -> dict[str, Any] | None: ...

    def complete(self) -> bool: ...


class LocalWorkspace(Protocol):
    """What storage reads of a workspace (`workspace.Workspace`, which opens its run storage here): the run
    storage and the local run directories."""

    def run_storage(self) -> RunStorage | None: ...

    def run_dir(self, study: str, run_id: str) -> LocalRun: ...

    def study_dir(self, study: str) -> Path: ...

    def recorded_ids(self, study: str) -> frozenset[str]: ...


def resolve_storage(arg: str | None = None) -> str | None:
    """`--storage`, else `$RESLAB_STORAGE`, else None (run directories only in the workspace)."""
    return arg or os.environ.get("RESLAB_STORAGE") or None


def redact(uri: str) -> str:
    """The URI without a password or secret in it, for messages and logs: `user:secret@host` keeps the user
    (an S3 access key id, a database role: identifiers), and query keys naming a secret, token, password or key
    lose their values."""
    parts = urlsplit(uri)
    netloc = parts.netloc
    if parts.password is not None:
        userinfo, host = netloc.rsplit("@", 1)
        netloc = f"{userinfo.split(':', 1)[0]}:***@{host}"
    query = "&".join(f"{k}=***" if any(s in k.lower() for s in ("secret", "token", "password", "key")) else f"{k}={v}"
                     for k, _, v in (q.partition("=") for q in parts.query.split("&") if q))
    if (netloc, query) == (parts.netloc, parts.query):
        return uri
    return urlunsplit(parts._replace(netloc=netloc, query=query))


def _why(exc: BaseException, uri: str) -> str:
    """An exception's text on one line, with the URI in it (pyarrow quotes it, password and all) redacted."""
    return " ".join(str(exc).replace(uri, redact(uri)).split())


def _join(uri: str, *names: str) -> str:
    """`uri` with `names` appended to its path, its query (endpoint, scheme, region) kept."""
    if "://" not in uri:
        return str(Path(uri).joinpath(*names))
    parts = urlsplit(uri)
    return urlunsplit(parts._replace(path=parts.path.rstrip("/") + "".join(f"/{n}" for n in names)))


def _open(uri: str) -> tuple[Any, str]:
    """(pyarrow filesystem, path inside it) for a storage URI; ConfigError naming `--storage` otherwise."""
    import pyarrow.fs as pafs

    if not uri or not uri.strip():
        raise ConfigError(f"{FLAG}: empty; allowed: {ALLOWED}")
    try:
        if "://" not in uri:
            path = Path(uri).expanduser().resolve()
            return pafs.LocalFileSystem(), str(path)
        fs, path = pafs.FileSystem.from_uri(uri)
    except (ValueError, OSError) as exc:  # ArrowInvalid is a ValueError
        raise ConfigError(f"{FLAG} {redact(uri)}: cannot be opened ({_why(exc, uri)}); "
                          f"allowed: {ALLOWED}") from None
    if fs.type_name != "local" and not path.strip("/"):
        raise ConfigError(f"{FLAG} {redact(uri)}: names no bucket; allowed: {ALLOWED}")
    return fs, path.rstrip("/") or "/"


@dataclass(frozen=True)
class StoredRun:
    """One run's directory in storage: `<storage>/runs/<study>/<run_id>/`."""

    uri: str
    fs: Any
    path: str

    @classmethod
    def at(cls, uri: str) -> StoredRun:
        """The run directory a `RunTask.storage` URI names."""
        fs, path = _open(uri)
        return cls(uri, fs, path)

    def __str__(self) -> str:
        return redact(self.uri)

    def _file(self, name: str) -> str:
        return f"{self.path}/{name}"

    def _guard(self, what: str, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except (OSError, ValueError) as exc:  # pyarrow's ArrowInvalid is a ValueError
            raise StorageError(f"run storage {self}: {what} failed ({_why(exc, self.uri)})") from None

    def _listing(self, sub: str = "") -> list[Any]:
        """pyarrow's FileInfo of every entry directly under this run's directory (or its `sub` folder)."""
        import pyarrow.fs as pafs

        where = f"{self.path}/{sub}" if sub else self.path
        return self._guard("listing", lambda: self.fs.get_file_info(pafs.FileSelector(where, allow_not_found=True)))

    def files(self, sub: str = "") -> dict[str, int]:
        """name -> size of the files stored for this run, or in its `sub` folder ({} when none)."""
        import pyarrow.fs as pafs

        return {i.base_name: i.size for i in self._listing(sub) if i.type == pafs.FileType.File}

    def dcp_step(self) -> str | None:
        """The newest stored DCP step folder (`step-NNNNNN`) whose `COMMITTED` marker is stored too; None
        when there is none: a step without its marker is not a checkpoint (its push did not finish)."""
        import pyarrow.fs as pafs

        steps = [i.base_name for i in self._listing(DCP_DIR)
                 if i.type == pafs.FileType.Directory and DCP_STEP_RE.fullmatch(i.base_name)]
        for name in sorted(steps, key=_step_number, reverse=True):
            if DCP_COMMITTED in self.files(f"{DCP_DIR}/{name}"):
                return name
        return None

    def read(self, name: str) -> bytes | None:
        def get() -> bytes | None:
            try:
                with self.fs.open_input_stream(self._file(name)) as f:
                    return f.read()
            except FileNotFoundError:
                return None

        return self._guard(f"reading {name}", get)

    def write(self, name: str, data: bytes) -> None:
        self._guard(f"writing {name}", functools.partial(self._put, io.BytesIO(data), name))

    def delete(self, name: str) -> None:
        def rm() -> None:
            with contextlib.suppress(FileNotFoundError):
                self.fs.delete_file(self._file(name))

        self._guard(f"deleting {name}", rm)

    def status(self) -> dict[str, Any] | None:
        return _loads(self.read("status"))

    def progress(self) -> tuple[int, ...]:
        stored = CHECKPOINT in self.files() or self.dcp_step() is not None
        return progress(self.status(), summary_complete(_loads(self.read("summary.json"))), stored)

    def _put(self, source: BinaryIO, name: str) -> None:
        """One file (`name` may name a sub-folder), written whole (see the module docstring)."""
        final = self._file(name)
        folder, _, base = final.rpartition("/")
        local_fs = self.fs.type_name == "local"
        target = f"{folder}/.{base}.{uuid.uuid4().hex[:8]}.tmp" if local_fs else final
        if local_fs:
            self.fs.create_dir(folder, recursive=True)
        try:
            with self.fs.open_output_stream(target) as dst:
                while chunk := source.read(_CHUNK):
                    dst.write(chunk)
            if local_fs:
                self.fs.move(target, final)
        except BaseException:
            if local_fs:
                with contextlib.suppress(OSError):
                    self.fs.delete_file(target)
            raise

    def _get(self, name: str, local: Path) -> None:
        tmp = local.with_name(f".{local.name}.{uuid.uuid4().hex[:8]}.pull")
        try:
            with self.fs.open_input_stream(self._file(name)) as src, open(tmp, "wb") as dst:
                while chunk := src.read(_CHUNK):
                    dst.write(chunk)
                dst.flush()
                os.fsync(dst.fileno())
            os.replace(tmp, local)
        finally:
            tmp.unlink(missing_ok=True)

    def push(self, rd: LocalRun, *, checkpoint: bool = True,
             skip: dict[str, tuple[int, int]] | None = None) -> list[str]:
        """Copy the run directory's files here, the checkpoints first (`checkpoint.pt`, the newest committed
        DCP step) and `status` last; the names copied.

        `skip` (name -> (size, mtime_ns) as last pushed) leaves out files unchanged since, and is
        updated: a checkpoint pushed after its step is not uploaded again at the end of the attempt.
        """
        pushed = [*self._push_files(rd, [CHECKPOINT], skip), *self._push_dcp(rd, skip)] if checkpoint else []
        return pushed + self.push_after(rd) + self._push_files(rd, list(RECORDS), skip)

    def push_after(self, rd: LocalRun) -> list[str]:
        """The files of work after training (`AFTER`) of `rd` that this copy lacks, each marker after its
        records; the names copied."""
        names: list[str] = []
        for kind in AFTER:
            there = self.files(kind)
            names += [f"{kind}/{name}" for name in _after_files(rd.path / kind) if name not in there]
        return self._push_files(rd, names, None)

    def pull_after(self, rd: LocalRun) -> list[str]:
        """The stored files of work after training `rd` lacks, each marker after its records; the names copied."""
        copied: list[str] = []
        for kind in AFTER:
            local = rd.path / kind
            names = [n for n in _after_names(self.files(kind)) if not (local / n).is_file()]
            if names:
                local.mkdir(parents=True, exist_ok=True)
            for name in names:
                self._guard(f"reading {kind}/{name}", functools.partial(self._get, f"{kind}/{name}", local / name))
            copied += [f"{kind}/{n}" for n in names]
        return copied

    def _push_files(self, rd: LocalRun, names: list[str], skip: dict[str, tuple[int, int]] | None) -> list[str]:
        """Copy the named files of `rd` (paths relative to it) in order; the names copied."""
        pushed = []
        for name in names:
            local = rd.path / name
            try:
                st = local.stat()
            except FileNotFoundError:
                continue
            stamp = (st.st_size, st.st_mtime_ns)
            if skip is not None and skip.get(name) == stamp:
                continue
            with open(local, "rb") as source:
                self._guard(f"writing {name}", functools.partial(self._put, source, name))
            if skip is not None:
                skip[name] = stamp
            pushed.append(name)
        return pushed

    def _push_dcp(self, rd: LocalRun, skip: dict[str, tuple[int, int]] | None) -> list[str]:
        """The newest committed DCP step of `rd`: its files, then its marker; once the marker is stored, the
        stored steps it replaces are removed."""
        step = latest_dcp_step(rd.path)
        if step is None:
            return []
        folder = f"{DCP_DIR}/{step.name}"
        names = sorted(f"{folder}/{p.name}" for p in step.iterdir() if p.is_file() and p.name != DCP_COMMITTED)
        pushed = self._push_files(rd, [*names, f"{folder}/{DCP_COMMITTED}"], skip)
        if f"{folder}/{DCP_COMMITTED}" in pushed:
            self._drop_dcp_but(step.name)
        return pushed

    def _drop_dcp_but(self, keep: str) -> None:
        """Remove every stored entry of the DCP checkpoint folder but the step `keep`."""
        import pyarrow.fs as pafs

        for info in self._listing(DCP_DIR):
            if info.base_name != keep:
                drop = self.fs.delete_dir if info.type == pafs.FileType.Directory else self.fs.delete_file
                self._guard(f"removing {DCP_DIR}/{info.base_name}", functools.partial(drop, info.path))

    def pull(self, rd: LocalRun, *, checkpoint: bool) -> list[str]:
        """Copy this run's stored files into `rd` (the checkpoints only when asked), `status` first; the
        names copied. Local files the stored copy lacks are left as they are, but a stored DCP checkpoint
        replaces the local one whole."""
        stored = self.files()
        names = ["status", *(n for n in RECORDS if n != "status")] + ([CHECKPOINT] if checkpoint else [])
        rd.path.mkdir(parents=True, exist_ok=True)
        pulled = []
        for name in names:
            if name in stored:
                self._guard(f"reading {name}", functools.partial(self._get, name, rd.path / name))
                pulled.append(name)
        return pulled + (self._pull_dcp(rd) if checkpoint else [])

    def _pull_dcp(self, rd: LocalRun) -> list[str]:
        """The newest stored committed DCP step into `rd`, in place of its DCP checkpoint: the files, the
        marker last, so a pull cut short leaves no checkpoint rather than half of one."""
        step = self.dcp_step()
        if step is None:
            return []
        folder = f"{DCP_DIR}/{step}"
        local = rd.path / folder
        shutil.rmtree(rd.path / DCP_DIR, ignore_errors=True)
        local.mkdir(parents=True)
        names = [n for n in sorted(self.files(folder)) if n != DCP_COMMITTED] + [DCP_COMMITTED]
        for name in names:
            self._guard(f"reading {folder}/{name}", functools.partial(self._get, f"{folder}/{name}", local / name))
        return [f"{folder}/{n}" for n in names]


@dataclass(frozen=True)
class RunStorage:
    """The storage root: `<storage>/runs/<study>/<run_id>/` for every run."""

    uri: str
    fs: Any
    path: str

    @classmethod
    def at(cls, uri: str) -> RunStorage:
        """Open and check a `--storage` URI: a ConfigError naming the flag, the URI and what is allowed when
        it cannot be opened or its bucket does not exist. Opened once per process and URI."""
        return _open_storage(uri)

    @classmethod
    def _check(cls, uri: str) -> RunStorage:
        import pyarrow.fs as pafs

        fs, path = _open(uri)
        if fs.type_name != "local":
            bucket = path.strip("/").split("/")[0]
            try:
                info = fs.get_file_info(bucket)
            except OSError as exc:
                raise ConfigError(f"{FLAG} {redact(uri)}: cannot be reached ({_why(exc, uri)}); "
                                  "check the endpoint and the AWS_*/GOOGLE_* credentials") from None
            if info.type == pafs.FileType.NotFound:
                raise ConfigError(f"{FLAG} {redact(uri)}: bucket {bucket!r} does not exist; create it first "
                                  f"(allowed: {ALLOWED})")
        elif Path(path).exists() and not Path(path).is_dir():
            raise ConfigError(f"{FLAG} {uri}: exists and is not a directory; allowed: {ALLOWED}")
        if "://" not in uri:
            uri = path
        return cls(uri, fs, path)

    def __str__(self) -> str:
        return redact(self.uri)

    def run_uri(self, study: str, run_id: str) -> str:
        return _join(self.uri, "runs", study, run_id)

    def run(self, study: str, run_id: str) -> StoredRun:
        return StoredRun(self.run_uri(study, run_id), self.fs, f"{self.path}/runs/{study}/{run_id}")

    def study_dir(self, study: str) -> StoredRun:
        """`<storage>/runs/<study>/` itself, where the study's driver marker lives."""
        return StoredRun(_join(self.uri, "runs", study), self.fs, f"{self.path}/runs/{study}")

    def probe(self) -> None:
        """One cheap call (its root's listing entry): a StorageError when storage does not answer."""
        try:
            self.fs.get_file_info(self.path)
        except OSError as exc:
            raise StorageError(f"run storage {self}: not answering ({_why(exc, self.uri)})") from None

    def run_ids(self, study: str) -> list[str]:
        """The run ids stored for a study, sorted ([] when none)."""
        import pyarrow.fs as pafs

        try:
            infos = self.fs.get_file_info(pafs.FileSelector(f"{self.path}/runs/{study}", allow_not_found=True))
        except OSError as exc:
            raise StorageError(f"run storage {self}: listing study {study!r} failed ({_why(exc, self.uri)})") from None
        return sorted(i.base_name for i in infos if i.type == pafs.FileType.Directory)

    def pull_records(self, study: str, rds: Mapping[str, LocalRun]) -> list[str]:
        """Pull the records (never the checkpoint) of the stored runs among `rds` (run id -> local run
        directory) that are ahead of their local copy; the run ids pulled."""
        pulled = []
        for run_id in self.run_ids(study):
            if run_id in rds and pull_records(self.run(study, run_id), rds[run_id]):
                pulled.append(run_id)
        return pulled


@functools.cache
def _open_storage(uri: str) -> RunStorage:
    return RunStorage._check(uri)


def _loads(data: bytes | None) -> dict[str, Any] | None:
    if data is None:
        return None
    try:
        value = json.loads(data.decode("utf-8"))
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def progress(status: dict[str, Any] | None, complete: bool, has_checkpoint: bool = True) -> tuple[int, ...]:
    """How far a copy of a run got (see the module docstring); a larger key is ahead.

    A status that names a checkpoint the copy lacks counts as no checkpoint: (…, 0, …).
    """
    s = status or {}
    attempts, step = s.get("attempts"), s.get("checkpoint_step")
    ended = status is not None and s.get("state") != RUNNING
    return (int(complete), attempts if isinstance(attempts, int) else 0,
            step if isinstance(step, int) and has_checkpoint else 0, int(ended))


def _after_names(names: Iterable[str]) -> list[str]:
    """The files of work after training among `names` (not the lock, nor a temporary file), records before
    markers: a copy that holds a marker holds its records."""
    return sorted((n for n in names if not n.startswith(".")), key=lambda n: (n.endswith(".json"), n))


def _after_files(folder: Path) -> list[str]:
    """The files of work after training in one of a run's `AFTER` folders (`_after_names`)."""
    return _after_names(p.name for p in folder.iterdir() if p.is_file()) if folder.is_dir() else []


def _step_number(name: str) -> int:
    return int(name.removeprefix("step-"))


def latest_dcp_step(run_path: Path) -> Path | None:
    """The newest committed step folder of a run directory's DCP checkpoint; None when there is none (a
    step folder without its `COMMITTED` marker is not a checkpoint: its writer died before committing)."""
    root = run_path / DCP_DIR
    if not root.is_dir():
        return None
    steps = [d for d in root.iterdir() if DCP_STEP_RE.fullmatch(d.name) and (d / DCP_COMMITTED).is_file()]
    return max(steps, key=lambda d: _step_number(d.name), default=None)


def has_checkpoint(run_path: Path) -> bool:
    """Whether a run directory holds a checkpoint to resume from: `checkpoint.pt` (one process) or a
    committed DCP step (a run on N ranks). The one test of it, for every caller."""
    return (run_path / CHECKPOINT).is_file() or latest_dcp_step(run_path) is not None


def local_progress(rd: LocalRun) -> tuple[int, ...]:
    return progress(rd.status(), rd.complete(), has_checkpoint(rd.path))


def pull_records(stored: StoredRun, rd: LocalRun) -> bool:
    """The driver's pull: the records when storage is ahead of `rd`; True when pulled.

    A local checkpoint older than the stored one is removed, so a worker whose scratch directory is
    this one (no `$RESLAB_SCRATCH`) pulls the newer checkpoint instead of resuming from it.
    """
    theirs = stored.progress()
    # the local checkpoint does not count here: the driver never pulls checkpoints
    ours = progress(rd.status(), rd.complete())
    if theirs[0]:  # a finished run's work after training, whatever else is ahead
        stored.pull_after(rd)
    if theirs <= ours:
        return False
    stored.pull(rd, checkpoint=False)
    if theirs[2] > ours[2]:
        (rd.path / CHECKPOINT).unlink(missing_ok=True)
        shutil.rmtree(rd.path / DCP_DIR, ignore_errors=True)
    return True


def pull_if_ahead(stored: StoredRun, rd: LocalRun) -> tuple[int, ...] | None:
    """The worker's pull before it claims: every file, the checkpoint included, when storage is ahead of
    the scratch copy; the stored progress key when pulled, else None."""
    theirs = stored.progress()
    if theirs[0]:  # a finished run's work after training, whatever else is ahead
        stored.pull_after(rd)
    if theirs <= local_progress(rd):
        return None
    stored.pull(rd, checkpoint=True)
    return theirs


def push_with_retries(stored: StoredRun, rd: LocalRun, skip: dict[str, tuple[int, int]] | None = None,
                      tries: int | None = None, wait_s: float = 1.0) -> None:
    """The end-of-attempt push, tried `tries` (default `PUSH_TRIES`) times with growing waits; the last
    StorageError propagates. Each try of an unreachable S3 endpoint costs ~6 s of the client's own retries."""
    tries = tries or PUSH_TRIES
    for attempt in range(1, tries + 1):
        try:
            stored.push(rd, skip=skip)
            return
        except StorageError:
            if attempt == tries:
                raise
            time.sleep(wait_s * attempt)


def push_finished(stored: StoredRun, rd: LocalRun) -> bool:
    """Push a finished run (`rd` complete) whose stored copy is not (no summary, or a damaged one); True
    when pushed. The driver's copy is pushed whole: the records, and the checkpoint when it has one."""
    if not rd.complete() or summary_complete(_loads(stored.read("summary.json"))):
        return False
    stored.push(rd)
    return True


@dataclass(frozen=True)
class StudySync:
    """What the driver's sync before planning did (`sync_study`): the run ids whose records it pulled, those
    it pushed from the workspace, and of these the ones pushed without their checkpoint, which the node
    that trained them still holds (the driver then has that node push its copy: `loop`)."""

    pulled: list[str]
    pushed: list[str]
    without_checkpoint: list[str]


def sync_study(workspace: LocalWorkspace, study: str, run_ids: Iterable[str]) -> StudySync:
    """The driver's sync before planning. The records of the stored runs ahead of the workspace's copy are
    pulled; the runs finished here that storage lacks (a push that failed while storage was down, a bucket
    emptied or restarted empty, a damaged stored summary) are pushed, so a run is finished for every
    workspace only once storage holds its record; the workspace's copy of a run trained in a node's scratch
    directory has no checkpoint, and those runs are named (`StudySync.without_checkpoint`). Nothing
    without storage. Storage and the study's folder are each listed once; only a run listed in either is
    looked at (`run_ids` may be a study's every run, drawn lazily)."""
    storage = workspace.run_storage()
    if storage is None:
        return StudySync([], [], [])
    stored_ids = set(storage.run_ids(study))
    present = workspace.recorded_ids(study)
    done = StudySync([], [], [])
    for run_id in run_ids:
        if run_id not in stored_ids and run_id not in present:
            continue  # neither stored nor recorded here: nothing to pull or push
        rd, stored = workspace.run_dir(study, run_id), storage.run(study, run_id)
        if run_id in stored_ids and pull_records(stored, rd):
            done.pulled.append(run_id)
        elif push_finished(stored, rd):
            done.pushed.append(run_id)
            if not has_checkpoint(rd.path):
                done.without_checkpoint.append(run_id)
        if rd.complete() and run_id in stored_ids:  # work after training done here that storage lacks
            stored.push_after(rd)
    return done


def storage_outage(storage: RunStorage, timeout_s: float, say: Callable[[str], Any], doing: str = "") -> Outage:
    """The driver's view of an outage of `storage` (`orchestrator.durability.outage`): past the timeout, a StorageError
    that says nothing is lost."""
    def give_up(line: str) -> StorageError:
        return StorageError(f"{line}: stopped. Nothing is lost: this workspace's run directories hold every run, "
                            "and the next `reslab run` pushes the finished ones to run storage before it plans")

    return Outage(f"run storage {storage}", timeout_s, say, give_up, doing)


def pull_study(workspace: LocalWorkspace, study: str, run_ids: list[str]) -> list[str]:
    """The driver's pull before planning or reading: the records of the study's stored runs among `run_ids`
    that are ahead of the workspace's copy; the run ids pulled ([] without storage)."""
    storage = workspace.run_storage()
    if storage is None:
        return []
    return storage.pull_records(study, {r: workspace.run_dir(study, r) for r in run_ids})


def pull_completed(workspace: LocalWorkspace, study: str, run_id: str, outage: Outage | None = None) -> bool:
    """The driver's pull after a completion: the run's records, success or failure alike; True when
    pulled. A storage error leaves the local copy as it is (the next pull tries again) and never
    stops the driver: it is logged, and noted on the driver's `outage` of storage."""
    storage = workspace.run_storage()
    if storage is None:
        return False
    began = time.time()
    try:
        return pull_records(storage.run(study, run_id), workspace.run_dir(study, run_id))
    except StorageError as exc:
        log.warning("%s; the workspace keeps its own copy of run %s until the next pull", exc, run_id)
        if outage is not None:
            outage.note(str(exc), began)
        return False


DRIVER_MARKER = "driver.json"
SETTLE_S = 1.0


class StudyBusy(StorageError):
    """Another live driver holds the study on this run storage."""


def study_driver(storage: RunStorage, study: str) -> dict[str, Any] | None:
    """The study's driver marker on `storage` (None when no driver holds it)."""
    return _loads(storage.study_dir(study).read(DRIVER_MARKER))


def describe_driver(marker: dict[str, Any], timeout_s: float) -> tuple[bool, str]:
    """(live, one line) for a driver marker."""
    live, why = lease_state(marker, timeout_s)
    return live, f"submission {marker.get('submission')}, {why}{'' if live else ' (stopped)'}"


def _refuse_other(place: StoredRun, study: str, submission: str, timeout_s: float) -> None:
    other = _loads(place.read(DRIVER_MARKER))
    if not other or other.get("submission") == submission:
        return
    live, why = describe_driver(other, timeout_s)
    if live:
        raise StudyBusy(f"study {study!r}: another driver holds it on run storage {place} ({why}); one driver per "
                        "study at a time, or both would train the same runs and overwrite each other's pushes. "
                        "Wait for it to end or stop it; a driver that died stops counting once its heartbeat is "
                        f"older than --lease-timeout ({timeout_s:g} s)")
    log.warning("study %r: taking over run storage %s from a driver that is gone (%s)", study, place, why)


@contextlib.contextmanager
def hold_study(storage: RunStorage, study: str, submission: str, timeout_s: float,
               heartbeat_s: float = HEARTBEAT_S, settle_s: float = SETTLE_S,
               outage: Outage | None = None) -> Iterator[dict[str, Any]]:
    """Hold the study's driver marker while the block runs: `StudyBusy` (nothing written) when another
    live driver holds it; renewed every `heartbeat_s` by a thread; removed at the end if still ours.
    A failed renewal is logged, not raised: training goes on, and another driver may take the study
    over only after `timeout_s` of silence. The renewals are the driver's steady probe of storage: each
    failed one is noted on `outage` (the driver's clock starts there, not at its next push), each that
    works ends it."""
    place = storage.study_dir(study)
    _refuse_other(place, study, submission, timeout_s)
    marker = {**lease_for(submission, heartbeat_s=heartbeat_s), "started": time.time()}
    place.write(DRIVER_MARKER, json.dumps(marker).encode())
    time.sleep(settle_s)  # a driver that read before our write and wrote after it shows up now
    _refuse_other(place, study, submission, timeout_s)
    stop = threading.Event()

    def renew() -> None:
        while not stop.wait(heartbeat_s):
            began = time.time()
            try:
                current = _loads(place.read(DRIVER_MARKER)) or {}
                if current.get("submission") not in (submission, None):
                    log.error("study %r: driver marker on %s now names submission %s; this driver (%s) had gone "
                              "silent past the lease timeout", study, place, current.get("submission"), submission)
                    return
                place.write(DRIVER_MARKER, json.dumps({**marker, "heartbeat": time.time()}).encode())
            except StorageError as exc:
                log.warning("study %r: driver heartbeat not renewed (%s); retrying in %gs", study, exc, heartbeat_s)
                if outage is not None:
                    outage.note(str(exc), began)
                continue
            if outage is not None:
                outage.ok()

    thread = threading.Thread(target=renew, name=f"reslab-driver-marker-{study}", daemon=True)
    thread.start()
    try:
        yield marker
    finally:
        stop.set()
        thread.join()
        with contextlib.suppress(StorageError):
            if (_loads(place.read(DRIVER_MARKER)) or {}).get("submission") == submission:
                place.delete(DRIVER_MARKER)


def hold_workspace_study(workspace: LocalWorkspace, study: str, submission: str, timeout_s: float,
                         heartbeat_s: float = HEARTBEAT_S,
                         outage: Outage | None = None) -> contextlib.AbstractContextManager[Any]:
    """`hold_study` on the workspace's run storage; nothing to hold without one (the per-run leases of
    one filesystem already keep two drivers apart)."""
    storage = workspace.run_storage()
    return hold_study(storage, study, submission, timeout_s, heartbeat_s, outage=outage) if storage \
        else contextlib.nullcontext()
