"""Every way a claimed attempt ends goes through the worker's one `with` block (`worker._Attempt`):
a finished run, a stop, a training failure, a cancel and a lost lease each leave the heartbeat
stopped, no file of the run directory open, torch's threads as they were, and the lease released
(or, taken over, the new holder's); and each releases in the one order: the final status under the
fence with the lease dropped, then the driver's events (SUCCESS only after them; a cancel does not
wait for the driver), then the end-of-attempt push to run storage.

Real training (the tiny study's first run, 6 steps, a checkpoint at step 3) in a real scratch run
directory, with a local directory as run storage; an `on_step` callback ends the run the way each
case needs, as `test_faults` does. The reporter is a real `EventReporter` that notes, at its
`flush`, what the run directory and run storage say then.
"""

from __future__ import annotations

import functools
import io
import json
import os
import pickle
import threading
from pathlib import Path

import pytest
import torch
from orch_helpers import write_study

from reslab.experiments import expand, load_study
from reslab.models.training import StopRun, train
from reslab.orchestrator.attempt.worker import _Heartbeat, execute_run, scratch_dir
from reslab.orchestrator.durability.lease import lease_for
from reslab.orchestrator.durability.storage import RunStorage
from reslab.orchestrator.durability.workspace import RunDir, write_json
from reslab.orchestrator.tasks import FAILED, INTERRUPTED, RUNNING, SUCCESS, Action, RunTask


class Watching:
    """Collects the events; at each `flush`, notes (run state, lease held, state in run storage)."""

    def __init__(self, rd: RunDir, stored: Path) -> None:
        self.rd, self.stored = rd, stored
        self.events: list[dict] = []
        self.flushes: list[tuple] = []

    def stored_state(self) -> str | None:
        status = self.stored / "status"
        return json.loads(status.read_text())["state"] if status.exists() else None

    def emit(self, event: dict) -> None:
        self.events.append(event)

    def flush(self) -> None:
        self.flushes.append((self.rd.state(), self.rd.lease() is not None, self.stored_state()))


def classes_in(obj: object) -> set[str]:
    """The `module.name` of every class the pickle of `obj` refers to (none for plain data)."""

    class Noting(pickle.Unpickler):
        def find_class(self, module: str, name: str) -> type:
            seen.add(f"{module}.{name}")
            return super().find_class(module, name)

    seen: set[str] = set()
    Noting(io.BytesIO(pickle.dumps(obj))).load()
    return seen


def open_files_under(directory: Path) -> list[str]:
    """Paths under `directory` that this process holds open (from /proc/self/fd)."""
    held = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # closed between listdir and readlink
            continue
        if target.startswith(f"{directory}/"):
            held.append(target)
    return held


def ending(case: str, rd: RunDir):
    """The `on_step` callback that ends the run as `case` says, at step 4."""

    def on_step(done: int) -> None:
        if done != 4 or case == "finished":
            return
        if case == "stopped":
            raise StopRun(done)
        if case == "failed":
            raise RuntimeError("the training loop broke")
        if case == "cancelled":
            raise KeyboardInterrupt
        with rd.locked():  # "taken over": another submission's lease, as a takeover writes it
            write_json(rd.fence_file, rd.token() + 1)
            write_json(rd.lease_file, {**lease_for("thief", rd.token() + 1), "host": "elsewhere"})

    return on_step


@pytest.mark.parametrize("case", ["finished", "stopped", "failed", "cancelled", "taken over"])
def test_every_exit_releases_the_claim_in_one_order(tmp_path, monkeypatch, case):
    monkeypatch.setenv("RESLAB_SCRATCH", str(tmp_path / "scratch"))
    run = expand(load_study(write_study(tmp_path)))[0]
    storage = RunStorage.at(str(tmp_path / "store"))
    threads = torch.get_num_threads() % 2 + 1  # differs from the count now, so the restore shows
    task = RunTask(run=run, run_dir=str(tmp_path / "ws" / run.run_id), submission="s", threads=threads,
                   storage=storage.run_uri(run.study, run.run_id))
    rd = RunDir(scratch_dir(task))
    reporter = Watching(rd, tmp_path / "store" / "runs" / run.study / run.run_id)
    heartbeats: list[_Heartbeat] = []
    on_step = ending(case, rd)

    def watch_then_end(done: int) -> None:
        heartbeats.extend(t for t in threading.enumerate() if isinstance(t, _Heartbeat) and t.rd.path == rd.path)
        on_step(done)

    threads_before = torch.get_num_threads()
    if case == "cancelled":
        with pytest.raises(KeyboardInterrupt):
            execute_run(task, reporter, train_fn=functools.partial(train, on_step=watch_then_end))
        outcome = None
    else:
        outcome = execute_run(task, reporter, train_fn=functools.partial(train, on_step=watch_then_end))

    # the same on every path: heartbeat stopped, nothing of the run left open, threads restored
    assert heartbeats and all(hb.stopped.is_set() for hb in heartbeats)
    for hb in heartbeats:
        hb.join(timeout=10)
        assert not hb.is_alive()
    assert open_files_under(rd.path) == []
    assert torch.get_num_threads() == threads_before
    status = rd.status()
    if case == "taken over":  # nothing ended: the run, its lease and storage's copy are the new holder's
        assert outcome.state == Action.BUSY and "taken over" in outcome.error
        assert status["state"] == RUNNING and rd.lease()["submission"] == "thief"
        assert reporter.flushes == [] and reporter.stored_state() != INTERRUPTED
        assert "stopped: " in rd.log_file.read_text().splitlines()[-1]
        return
    final = {"finished": SUCCESS, "stopped": INTERRUPTED, "failed": FAILED, "cancelled": INTERRUPTED}[case]
    assert status["state"] == final and rd.lease() is None
    assert reporter.stored_state() == final  # the end-of-attempt push came after the final status
    if case == "finished":  # the events reached the driver before SUCCESS; the summary was written before both
        # plain data only: the driver's event sink unpickles them in a process without torch (a
        # torch.__version__ in the start event once cost the sink a 1 s torch import)
        assert [classes_in(e) for e in reporter.events] == [set()] * len(reporter.events)
        assert reporter.flushes == [(RUNNING, True, reporter.flushes[0][2])] and reporter.flushes[0][2] != SUCCESS
        assert outcome.state == SUCCESS and rd.summary()["summary"] == outcome.summary
    elif case == "cancelled":  # nobody waits for the driver; the status says why
        assert reporter.flushes == [] and status["error"] == "cancelled"
    else:  # the final status first, the lease dropped, then the flush, then the push
        assert len(reporter.flushes) == 1 and reporter.flushes[0][:2] == (final, False)
        assert reporter.flushes[0][2] != final
        if case == "stopped":
            assert outcome.state == INTERRUPTED and outcome.info["stopped_step"] == 4
        else:
            assert outcome.state == FAILED and outcome.retryable
            assert outcome.error == "RuntimeError: the training loop broke" == status["error"]
            assert "RuntimeError: the training loop broke" in outcome.traceback
