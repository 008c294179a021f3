"""`write_atomic`: the one way reslab writes a file that a reader, or a crash, must never see half-written;
`file_lock`: the one advisory lock between processes (drivers, workers, `data prepare`);
`cache_root`: this machine's cache (prepared corpora, the MLflow store template);
`collector_paused`: the cyclic garbage collector paused while a whole study's records are read.

A leaf module (standard library only) so every layer can use it: run directories, checkpoints,
the results cache and exports.
"""

from __future__ import annotations

import contextlib
import fcntl
import gc
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

FILE_MODE = 0o644


def write_atomic(path: str | os.PathLike[str], data: str | bytes, mode: int = FILE_MODE) -> Path:
    """Write `data` to a unique sibling temporary file, fsync it, give it `mode`, rename it onto `path`.

    Readers see the old file or the new one, never a mix; a failure leaves no temporary file behind.
    The temporary name is unique (mkstemp), so two processes writing the same path do not collide.
    Text is written as UTF-8. Returns the path.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode("utf-8") if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


@contextlib.contextmanager
def file_lock(path: str | os.PathLike[str]) -> Iterator[None]:
    """An exclusive `flock` on `path` (created if missing, kept afterwards), held for the `with` body.

    Not reentrant: a process that holds it and asks again waits for itself. Needs a filesystem with
    working flock (local disks; NFS mounted with locking, not `nolock`).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def cache_root() -> Path:
    """`$RESLAB_CACHE`, else `~/.cache/reslab`."""
    env = os.environ.get("RESLAB_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "reslab"


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """The cyclic garbage collector paused while a whole study's records are read (the commands that read one:
    compare, export, report, status, plan; a submission's final readouts). The records are millions of small
    acyclic objects (dicts, tuples, strings) that the collector scanned again at each growth of their count:
    4 s of a 31 s report of 10^5 runs (issue 39). Paused, that report's peak memory was the same. The
    collector is as it was after the block: a caller's own pause is left alone."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
