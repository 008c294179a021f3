"""An attempt's side of run storage (`orchestrator.durability.storage`): the pull before the claim, a push after
every checkpoint by an uploader thread beside training, and the push at the attempt's end.

A storage error is logged to train.log and the push is tried again at the next checkpoint: storage
never takes training down or holds it up. The end-of-attempt push is tried `storage.PUSH_TRIES` times;
its error text, when every try failed, is what the attempt reports as "finished, not yet durable",
with when its storage operations began to fail (`down_since`: the first failed checkpoint push may come
long before the attempt's end, and the driver's outage clock starts there).
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path

from reslab.orchestrator.durability import storage
from reslab.orchestrator.durability.lease import lease_state
from reslab.orchestrator.durability.storage import (
    CHECKPOINT,
    RECORDS,
    StorageError,
    StoredRun,
    local_progress,
    pull_if_ahead,
    push_with_retries,
)
from reslab.orchestrator.durability.workspace import RunDir

SNAPSHOT_DIR = ".push"  # in the scratch run directory: checkpoint snapshots waiting for their upload


class StorageSync:
    """The attempt's side of run storage (see the module docstring).

    Checkpoint pushes run beside training: `after_checkpoint` snapshots the files the checkpoint
    leaves into `<run dir>/.push/<n>/` (the checkpoint hard-linked: `train` renames each new one
    into place, so the linked file never changes; the small records copied, times kept) and hands
    the snapshot to one uploader thread, which pushes it checkpoint first and status last, as a
    synchronous push would. A snapshot still waiting when the next checkpoint comes is replaced by
    the newer one. At most two snapshots exist, so a slow store costs at most two checkpoints of
    scratch disk, never training time. `at_end` waits for the upload under way, drops a waiting
    one (its files are older than the run directory's) and pushes the run directory itself."""

    def __init__(self, stored: StoredRun, rd: RunDir) -> None:
        self.stored, self.rd = stored, rd
        self.pushed: dict[str, tuple[int, int]] = {}  # name -> (size, mtime_ns) last pushed
        self.pulled: tuple[int, ...] | None = None
        self.snapshots = rd.path / SNAPSHOT_DIR
        self._count = 0
        self._pending: Path | None = None  # the newest snapshot not yet taken by the uploader
        self._closing = False
        self._wake = threading.Condition()
        self._uploader: threading.Thread | None = None
        self._log: Callable[[str], None] = lambda line: None
        # when the storage operations of this attempt began to fail, None while the last one worked
        self.down_since: float | None = None

    def _note(self, began: float, failed: bool) -> None:
        """Keep `down_since` for an operation begun at `began` that failed or worked."""
        if not failed:
            self.down_since = None
        elif self.down_since is None:
            self.down_since = began

    def pull(self, lease_timeout_s: float) -> None:
        """Before the claim: pull when storage is ahead and no live holder on this node is writing."""
        self.rd.path.mkdir(parents=True, exist_ok=True)
        with self.rd.locked():
            if not lease_state(self.rd.lease(), lease_timeout_s)[0]:
                began = time.time()
                try:
                    self.pulled = pull_if_ahead(self.stored, self.rd)
                except StorageError:
                    self._note(began, failed=True)
                    raise
                self._note(began, failed=False)

    def after_checkpoint(self, log: Callable[[str], None]) -> None:
        if self._uploader is None:  # under this attempt's lease: snapshots left by a killed attempt go
            shutil.rmtree(self.snapshots, ignore_errors=True)
        try:
            snapshot = self._snapshot()
        except OSError as exc:
            log(f"run storage {self.stored}: snapshotting the run for its push failed ({exc}); training goes on, "
                "the push is tried again at the next checkpoint")
            return
        with self._wake:
            replaced, self._pending, self._log = self._pending, snapshot, log
            if self._uploader is None:
                self._uploader = threading.Thread(target=self._upload, name=f"reslab-push-{self.rd.run_id}",
                                                  daemon=True)
                self._uploader.start()
            self._wake.notify()
        if replaced is not None:
            shutil.rmtree(replaced, ignore_errors=True)

    def _snapshot(self) -> Path:
        self._count += 1
        snapshot = self.snapshots / str(self._count)
        snapshot.mkdir(parents=True)
        for name in (CHECKPOINT, *RECORDS):
            source = self.rd.path / name
            if not source.exists():
                continue
            if name == CHECKPOINT:
                try:
                    os.link(source, snapshot / name)
                    continue
                except OSError:  # a filesystem without hard links
                    pass
            shutil.copy2(source, snapshot / name)
        return snapshot

    def _upload(self) -> None:
        while True:
            with self._wake:
                while self._pending is None and not self._closing:
                    self._wake.wait()
                if self._closing:
                    return
                snapshot, self._pending = self._pending, None
            assert snapshot is not None
            began = time.time()
            try:
                self.stored.push(RunDir(snapshot), skip=self.pushed)
                self._note(began, failed=False)
            except (StorageError, OSError) as exc:  # OSError: a local file that cannot be read
                self._note(began, failed=isinstance(exc, StorageError))
                self._log(f"{exc}; training goes on, the push is tried again at the next checkpoint")
            finally:
                shutil.rmtree(snapshot, ignore_errors=True)

    def close(self) -> None:
        """Stop the uploader: the upload under way finishes, a waiting snapshot is dropped."""
        with self._wake:
            self._closing = True
            self._wake.notify()
        if self._uploader is not None:
            self._uploader.join()
        shutil.rmtree(self.snapshots, ignore_errors=True)

    def at_end(self, log: Callable[[str], None] | None = None) -> str | None:
        """The end-of-attempt push, after the checkpoint uploads; the error text when it failed every try."""
        self.close()
        began = time.time()
        try:
            push_with_retries(self.stored, self.rd, self.pushed)
        except StorageError as exc:
            self._note(began, failed=True)
            if log is not None:
                log(f"{exc}; gave up after {storage.PUSH_TRIES} tries; the driver has this node push it once "
                    "storage answers")
            return str(exc)
        self._note(began, failed=False)
        return None

    def settle(self) -> str | None:
        """A run this node had finished: push it when storage is behind."""
        began = time.time()
        try:
            if local_progress(self.rd) <= self.stored.progress():
                return None
        except StorageError as exc:
            self._note(began, failed=True)
            return str(exc)
        return self.at_end()
