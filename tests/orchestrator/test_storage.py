"""Run storage (`orchestrator.durability.storage`): a URI where run directories live durably.

The fast tests use a local path as storage and emulate separate nodes by pointing `$RESLAB_SCRATCH`
at different directories between submissions of the in-process backend (the worker code is the one a
Ray task runs). The slow ones go through a real S3-compatible server, moto's server mode, started as
a subprocess on 127.0.0.1, and the real Ray backend.
"""

from __future__ import annotations

import functools
import io
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from orch_helpers import ONE_RUN, TcpProxy, assert_same_storage, free_port, stored_tree, write_study

from reslab.common.errors import ConfigError
from reslab.experiments import expand, load_study
from reslab.models.checkpoint import CHECKPOINT_NAME
from reslab.models.training import StopRun, train
from reslab.orchestrator.cli import main
from reslab.orchestrator.dispatch.local_backend import LocalBackend
from reslab.orchestrator.driving.plan import SKIP, plan
from reslab.orchestrator.driving.submit import ExecutionOptions, submit
from reslab.orchestrator.durability.lease import lease_for
from reslab.orchestrator.durability.storage import (
    CHECKPOINT,
    DRIVER_MARKER,
    RECORDS,
    RunStorage,
    StorageError,
    StoredRun,
    StudyBusy,
    hold_study,
    progress,
    pull_if_ahead,
    pull_records,
    pull_study,
    redact,
    study_driver,
)
from reslab.orchestrator.durability.workspace import RunDir, Workspace, write_json
from reslab.orchestrator.tasks import FAILED, INTERRUPTED, SUCCESS
from reslab.orchestrator.tracking.guarded import GuardedTracker

# moto accepts any credentials; set before any Ray instance of this session starts, so its workers
# inherit them (pyarrow's S3 client reads AWS_* like every other one)
for _key, _value in (("AWS_ACCESS_KEY_ID", "testing"), ("AWS_SECRET_ACCESS_KEY", "testing"),
                     ("AWS_DEFAULT_REGION", "us-east-1"), ("AWS_EC2_METADATA_DISABLED", "true")):
    os.environ.setdefault(_key, _value)


def run_study(path: Path, ws: Workspace, backend=None, overrides=(), **options):
    study = load_study(path, overrides)
    runs = expand(study)
    result = submit(study, runs, ws, backend or LocalBackend(), GuardedTracker(ws.default_tracking_uri(), ws),
                    ExecutionOptions(**options), stream=io.StringIO(), say=lambda *_: None)
    return study, runs, result


def with_storage(ws: Workspace, uri: str) -> Workspace:
    return Workspace.at(ws.root, uri)


def test_the_checkpoint_name_is_the_training_loops():
    assert CHECKPOINT == CHECKPOINT_NAME


def test_a_bad_storage_uri_is_one_clear_error(tmp_path, capsys):
    with pytest.raises(ConfigError, match=r"^--storage bogus://x: cannot be opened .*allowed: a local or NFS path"):
        RunStorage.at("bogus://x")
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match=r"--storage .*/file: exists and is not a directory"):
        RunStorage.at(str(tmp_path / "file"))
    with pytest.raises(ConfigError, match=r"--storage s3://\?region=x: names no bucket"):
        RunStorage.at("s3://?region=x")
    # secrets never reach a message
    assert redact("s3://user:pw@bucket/p?region=r&secret_key=s") == "s3://user:***@bucket/p?region=r&secret_key=***"
    with pytest.raises(ConfigError) as bad:  # pyarrow quotes the URI it could not open: redacted there too
        RunStorage.at("postgresql://role:hunter2@db/mlflow")
    assert "hunter2" not in str(bad.value) and "postgresql://role:***@db/mlflow" in str(bad.value)

    path = write_study(tmp_path)
    code = main(["status", str(path), "--workspace", str(tmp_path / "ws"), "--storage", "bogus://nowhere/x"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1
    assert err.startswith("reslab: error: --storage bogus://nowhere/x: cannot be opened")
    assert not (tmp_path / "ws").exists()  # nothing written before the error


def test_which_copy_is_ahead():
    # (finished, attempts, checkpoint step, attempt ended): later attempts win over larger steps of
    # earlier ones; a status naming a checkpoint the copy lacks counts as no checkpoint
    running = {"state": "RUNNING", "attempts": 1, "checkpoint_step": 3}
    assert progress(None, False) == (0, 0, 0, 0)
    assert progress(running, False) == (0, 1, 3, 0)
    assert progress({**running, "state": FAILED}, False) > progress(running, False)
    assert progress({**running, "checkpoint_step": 6}, False) > progress({**running, "state": INTERRUPTED}, False)
    assert progress({**running, "attempts": 2, "checkpoint_step": 0}, False) > progress(running, False)
    assert progress({"state": SUCCESS, "attempts": 1}, True) > progress({**running, "attempts": 5}, False)
    assert progress(running, False, has_checkpoint=False) == (0, 1, 0, 0)


def _fake_run(rd: RunDir, step: int, attempts: int = 1, state: str = INTERRUPTED) -> None:
    """A run directory's files with recognisable bytes (no training needed to decide what to copy)."""
    rd.path.mkdir(parents=True, exist_ok=True)
    write_json(rd.spec_file, {"run_id": rd.run_id})
    rd.metrics_file.write_text(json.dumps({"kind": "train", "step": step, "train_loss": 1.0, "time": 0}) + "\n")
    (rd.path / CHECKPOINT).write_bytes(f"weights at step {step}".encode())
    write_json(rd.status_file, {"state": state, "attempts": attempts, "checkpoint_step": step})


def test_pull_and_push_follow_the_copy_that_is_ahead(tmp_path):
    storage = RunStorage.at(str(tmp_path / "store"))
    stored = storage.run("st", "r1")
    node_a, node_b = RunDir(tmp_path / "a" / "st" / "r1"), RunDir(tmp_path / "b" / "st" / "r1")

    _fake_run(node_a, step=6)
    assert stored.push(node_a) == [CHECKPOINT, "spec.json", "metrics.jsonl", "status"]
    assert storage.run_ids("st") == ["r1"] and storage.run_ids("other") == []
    # a node with nothing pulls everything, byte for byte
    assert pull_if_ahead(stored, node_b) == (0, 1, 6, 1)
    for name in (CHECKPOINT, "spec.json", "metrics.jsonl", "status"):
        assert (node_b.path / name).read_bytes() == (node_a.path / name).read_bytes()
    # a node that is ahead keeps its copy
    _fake_run(node_b, step=9)
    assert pull_if_ahead(stored, node_b) is None
    assert (node_b.path / CHECKPOINT).read_bytes() == b"weights at step 9"
    # unchanged files are not pushed again
    pushed: dict[str, tuple[int, int]] = {}
    stored.push(node_b, skip=pushed)
    assert stored.push(node_b, skip=pushed) == []
    # a node behind (an older attempt of its own) pulls the newer checkpoint
    assert pull_if_ahead(stored, node_a) == (0, 1, 9, 1)
    assert (node_a.path / CHECKPOINT).read_bytes() == b"weights at step 9"
    # a status that names a checkpoint the copy lacks is behind a copy that has it
    (node_a.path / CHECKPOINT).unlink()
    assert pull_if_ahead(stored, node_a) is not None and (node_a.path / CHECKPOINT).is_file()


def test_the_driver_pulls_records_never_the_checkpoint(tmp_path):
    storage = RunStorage.at(str(tmp_path / "store"))
    stored = storage.run("st", "r1")
    worker, driver = RunDir(tmp_path / "scratch" / "st" / "r1"), RunDir(tmp_path / "ws" / "runs" / "st" / "r1")
    _fake_run(worker, step=6, attempts=2)
    stored.push(worker)
    _fake_run(driver, step=3, attempts=1)  # the driver's copy of an older attempt, e.g. run on its own node
    assert pull_records(stored, driver)
    assert driver.status()["checkpoint_step"] == 6 and driver.metrics()[0]["step"] == 6
    # its older checkpoint is gone, so a worker training in this directory pulls the newer one
    assert not (driver.path / CHECKPOINT).exists()
    assert not pull_records(stored, driver)  # same progress: nothing copied
    assert pull_if_ahead(stored, driver) and (driver.path / CHECKPOINT).read_bytes() == b"weights at step 6"


def test_a_finished_runs_evaluations_travel_with_it(tmp_path):
    """`evals/` (issue 34): pushed with the run, each marker after its records, its lock and temporary files
    never; a copy at the same progress still gets the evaluations it lacks; a later evaluation is pushed alone."""
    storage = RunStorage.at(str(tmp_path / "store"))
    stored = storage.run("st", "r1")
    node, driver = RunDir(tmp_path / "node" / "st" / "r1"), RunDir(tmp_path / "ws" / "runs" / "st" / "r1")
    for rd in (node, driver):
        _fake_run(rd, step=6, state=SUCCESS)
        write_json(rd.summary_file, {"summary": {"val_loss": 2.0}})
    evals = node.path / "evals"
    evals.mkdir()
    for name, data in (("t-a.parquet", b"items a"), ("t-a.json", b"{}"), (".lock", b""), (".t-b.parquet.tmp", b"x")):
        (evals / name).write_bytes(data)
    pushed = stored.push(node)
    assert [n for n in pushed if n.startswith("evals/")] == ["evals/t-a.parquet", "evals/t-a.json"]
    assert not pull_records(stored, driver)  # the records are no further ahead ...
    assert sorted(p.name for p in (driver.path / "evals").iterdir()) == ["t-a.json", "t-a.parquet"]  # ... these are
    assert (driver.path / "evals" / "t-a.parquet").read_bytes() == b"items a"
    (evals / "u-b.parquet").write_bytes(b"items b")
    (evals / "u-b.json").write_bytes(b"{}")
    assert stored.push_after(node) == ["evals/u-b.parquet", "evals/u-b.json"] and stored.push_after(node) == []
    knockouts = node.path / "interventions"  # issue 36: the other kind of work after training travels the same way
    knockouts.mkdir()
    for name, data in (("k1.jsonl", b"rows"), ("k1.json", b"{}"), (".lock", b"")):
        (knockouts / name).write_bytes(data)
    assert stored.push_after(node) == ["interventions/k1.jsonl", "interventions/k1.json"]
    fresh = RunDir(tmp_path / "fresh" / "st" / "r1")
    assert pull_if_ahead(stored, fresh) is not None
    assert sorted(p.name for p in (fresh.path / "evals").iterdir()) == ["t-a.json", "t-a.parquet", "u-b.json",
                                                                        "u-b.parquet"]
    assert sorted(p.name for p in (fresh.path / "interventions").iterdir()) == ["k1.json", "k1.jsonl"]


def stop_at(step: int):
    def on_step(done: int) -> None:
        if done == step:
            raise StopRun(done)
    return on_step


def test_a_run_resumes_on_another_node_from_storage(tmp_path, workspace, monkeypatch, capsys):
    ws = with_storage(workspace, str(tmp_path / "store"))
    path = write_study(tmp_path, name="moving")
    monkeypatch.setenv("RESLAB_SCRATCH", str(tmp_path / "node-a"))
    _, runs, first = run_study(path, ws, LocalBackend(train_fn=functools.partial(train, on_step=stop_at(4))))
    assert first.count("interrupted") == 4, (first.states, first.errors)
    rid = runs[0].run_id
    # the attempt trained in node A's scratch; the driver's copy came from storage and has no checkpoint
    assert (tmp_path / "node-a" / "moving" / rid / CHECKPOINT).is_file()
    driver = ws.run_dir("moving", rid)
    assert driver.state() == INTERRUPTED and driver.status()["checkpoint_step"] == 4
    assert not (driver.path / CHECKPOINT).exists()

    monkeypatch.setenv("RESLAB_SCRATCH", str(tmp_path / "node-b"))
    _, _, second = run_study(path, ws)
    assert second.ok and second.count("succeeded") == 4, (second.states, second.errors)
    node_b = RunDir(tmp_path / "node-b" / "moving" / rid)
    assert node_b.status()["attempts"] == 2 and node_b.state() == SUCCESS
    assert [r["step"] for r in driver.metrics() if r["kind"] == "train"] == [1, 2, 3, 4, 5, 6]
    log = driver.log_file.read_text()  # both nodes' lines: node B pulled node A's log and appended to it
    assert "pulled from it (attempts 1, checkpoint step 4)" in log
    assert f"resumed from {node_b.path / CHECKPOINT} at step 4" in log
    assert driver.state() == SUCCESS and not (driver.path / CHECKPOINT).exists()
    # the local workspace is a cache: `reslab status` on another machine reads storage
    code = main(["status", str(path), "--workspace", str(tmp_path / "laptop"), "--storage", str(tmp_path / "store")])
    out = capsys.readouterr().out
    assert code == 0 and "pulled the records of 4 run(s)" in out and "moving: 4 runs: 4 succeeded" in out
    # and without its copy, storage alone says every run is done
    shutil.rmtree(ws.root / "runs")
    _, _, third = run_study(path, ws)
    assert third.count("skipped") == 4 and third.cluster is None


def test_a_failed_run_reaches_the_driver(tmp_path, workspace, monkeypatch):
    ws = with_storage(workspace, str(tmp_path / "store"))
    path = write_study(tmp_path, name="diverge")
    monkeypatch.setenv("RESLAB_SCRATCH", str(tmp_path / "node"))
    overrides = [("optim.lr", 1.0e6), ("optim.grad_clip", 0.0)]
    _, runs, result = run_study(path, ws, overrides=overrides, retries=0)
    failed = [rid for rid, state in result.states.items() if state == "failed"]
    assert failed, "lr=1e6 without clipping should diverge"
    for rid in failed:
        rd = ws.run_dir("diverge", rid)
        assert rd.state() == FAILED and rd.status()["error"].startswith("TrainingDiverged")
        assert "TrainingDiverged" in rd.log_file.read_text()  # the worker's log came along
    # a new driver with an empty workspace plans from storage: the failures are skipped, not rerun
    fresh = Workspace.at(tmp_path / "fresh", ws.storage)
    assert sorted(pull_study(fresh, "diverge", [r.run_id for r in runs])) == sorted(r.run_id for r in runs)
    entries = {e.run.run_id: e for e in plan(runs, fresh)}
    assert all(entries[rid].action == SKIP and entries[rid].state == FAILED for rid in failed)


def _down_while_it_trains(place: Path) -> LocalBackend:
    """An in-process backend whose run's place in a local store is a file (every write of the run fails; the
    study's driver marker, one level up, stays writable) from its first step until its attempt ended."""
    def break_storage(done: int) -> None:
        if done == 1 and not place.is_file():
            place.write_text("")

    class Repaired(LocalBackend):
        def execute(self, task):
            completion = super().execute(task)
            if place.is_file():
                place.unlink()  # storage is back once the attempt ended
            return completion

    return Repaired(train_fn=functools.partial(train, on_step=break_storage))


def test_storage_errors_never_stop_training_and_a_finished_run_is_never_failed_for_them(tmp_path, workspace,
                                                                                       monkeypatch):
    store = tmp_path / "store"
    ws = with_storage(workspace, str(store))
    path = write_study(tmp_path, name="flaky", text=ONE_RUN.format(name="flaky"))
    monkeypatch.setenv("RESLAB_SCRATCH", str(tmp_path / "node"))
    backend = _down_while_it_trains(store / "runs" / "flaky" / expand(load_study(path))[0].run_id)

    lines: list[str] = []
    study = load_study(path)
    result = submit(study, expand(study), ws, backend, GuardedTracker(ws.default_tracking_uri(), ws),
                    ExecutionOptions(retries=0), stream=io.StringIO(), say=lines.append)
    rid = expand(study)[0].run_id
    node = RunDir(tmp_path / "node" / "flaky" / rid)
    log = node.log_file.read_text()
    # the checkpoint push at step 3 failed, training went on to the end; the end push failed every try
    assert "writing checkpoint.pt failed" in log and "training goes on" in log and "gave up after 3 tries" in log
    assert node.state() == SUCCESS and node.status()["attempts"] == 1
    # finished, not failed (no retry was spent on it); its node pushed its copy once storage answered
    assert result.ok and result.states[rid] == "succeeded", result.states
    assert any("unreachable for" in line for line in lines) and any("answers again" in line for line in lines)
    copy = StoredRun.at(RunStorage.at(str(store)).run_uri("flaky", rid))
    assert copy.status()["state"] == SUCCESS and copy.progress()[0] == 1
    assert ws.run_dir("flaky", rid).state() == SUCCESS


@pytest.mark.parametrize("scratch", [True, False], ids=["node-scratch", "driver-workspace"])
def test_storage_after_an_outage_is_storage_without_one(tmp_path, monkeypatch, scratch):
    """A run that finishes while storage is down (its checkpoint push and its end push fail) is pushed whole
    once storage answers, by the node it finished on: storage then holds, file for file, what it holds after
    the same study without an outage, train.log, diagnostics and the final checkpoint included, whether the
    run trained in a node's scratch directory (a cluster without a shared filesystem: the driver's copy has
    no checkpoint) or in the driver's workspace. An emptied store is refilled the same way; a node whose
    copy is gone leaves storage the driver's copy, and a line says what it lacks."""
    monkeypatch.setattr("reslab.orchestrator.durability.storage.PUSH_TRIES", 1)
    path = write_study(tmp_path, name="whole", text=ONE_RUN.format(name="whole"))
    study = load_study(path)
    runs = expand(study)
    rid = runs[0].run_id

    def submit_on(node: str, store: str, backend: LocalBackend, say=lambda *_: None):
        if scratch:
            monkeypatch.setenv("RESLAB_SCRATCH", str(tmp_path / node))
        ws = Workspace.at(tmp_path / f"ws-{store}", str(tmp_path / store))
        return submit(study, runs, ws, backend, None, ExecutionOptions(retries=0), stream=io.StringIO(), say=say)

    submit_on("node-clean", "clean", LocalBackend())
    expected = stored_tree(tmp_path / "clean" / "runs" / "whole")
    assert f"{rid}/{CHECKPOINT}" in expected and f"{rid}/train.log" in expected

    stored = tmp_path / "down" / "runs" / "whole" / rid
    lines: list[str] = []
    result = submit_on("node-a", "down", _down_while_it_trains(stored), lines.append)
    assert result.ok and result.states[rid] == "succeeded", (result.states, result.errors)
    node = RunDir((tmp_path / "node-a" / "whole" / rid) if scratch else tmp_path / "ws-down" / "runs" / "whole" / rid)
    assert "gave up after 1 tries" in node.log_file.read_text() and node.status()["attempts"] == 1
    assert any("answers again" in line for line in lines), lines
    assert_same_storage(stored_tree(tmp_path / "down" / "runs" / "whole"), expected)
    if not scratch:  # the driver's copy is the node's: a refill pushes it whole (test_an_s3_outage_...)
        pytest.skip("driver-workspace: the outage half is checked; the refill half is a node scratch copy's only "
                    "(the driver's copy is the node's, pushed whole: test_an_s3_outage_...)")

    # the store emptied under the study (a server restarted empty): the next run refills it, whole
    shutil.rmtree(stored)
    again = submit_on("node-a", "down", LocalBackend())
    assert again.count("skipped") == 1 and again.count("succeeded") == 0
    assert_same_storage(stored_tree(tmp_path / "down" / "runs" / "whole"), expected)

    # emptied again, and the node's copy is gone too: storage gets the driver's copy, and the line says so
    shutil.rmtree(stored)
    shutil.rmtree(tmp_path / "node-a")
    lines.clear()
    submit_on("node-b", "down", LocalBackend(), lines.append)
    assert any(f"{runs[0].label}: its copy on " in line and "without its checkpoint" in line for line in lines), lines
    assert sorted(stored_tree(stored)) == sorted(RECORDS)


def test_the_outage_clock_starts_when_storage_stopped_answering(tmp_path, workspace, monkeypatch):
    """The worker's first failed push (its checkpoint's, at step 3) is when storage stopped answering, not the
    end of its attempt, when the driver hears of it: past --outage-timeout counted from there, the driver
    stops with one line at once, whose clock says how long storage has been down (the end push alone waits
    1 s between its two tries). The study marker's heartbeat, whose renewals would say storage answers (only
    the run's place in it is broken), is kept out of the way."""
    monkeypatch.setattr("reslab.orchestrator.durability.storage.PUSH_TRIES", 2)  # 1 s between the end push's tries
    store = tmp_path / "store"
    ws = with_storage(workspace, str(store))
    path = write_study(tmp_path, name="clock", text=ONE_RUN.format(name="clock"))
    monkeypatch.setenv("RESLAB_SCRATCH", str(tmp_path / "node"))
    study = load_study(path)
    runs = expand(study)
    backend = _down_while_it_trains(store / "runs" / "clock" / runs[0].run_id)
    with pytest.raises(StorageError, match=r"^run storage .* unreachable for [1-9]\d*s; runs in flight train on .*: "
                                           r"stopped\. Nothing is lost"):
        submit(study, runs, ws, backend, None, ExecutionOptions(retries=0, outage_timeout_s=0.5, heartbeat_s=1000),
               stream=io.StringIO(), say=lambda *_: None)


def test_the_study_markers_heartbeat_starts_the_outage_clock(tmp_path):
    """A driver whose runs are all training learns of an outage from its study marker's heartbeat: the
    failed renewal starts the clock (at the renewal's start), and a renewal that works again ends it."""
    from reslab.orchestrator.durability.storage import storage_outage

    storage = RunStorage.at(str(tmp_path / "store"))
    lines: list[str] = []
    outage = storage_outage(storage, 60, lines.append)
    study_dir = tmp_path / "store" / "runs" / "st"
    with hold_study(storage, "st", "sub-a", 120, heartbeat_s=0.1, settle_s=0, outage=outage):
        shutil.move(study_dir, tmp_path / "aside")
        study_dir.write_text("")  # the study's folder a file: every read and write of the marker fails
        down = time.time()
        deadline = time.time() + 30
        while not outage.down and time.time() < deadline:
            time.sleep(0.05)
        assert outage.down and down - 0.2 <= outage.since <= time.time(), (down, outage.since)
        outage.check()
        assert lines and "unreachable for 0s" in lines[0], lines
        study_dir.unlink()
        shutil.move(tmp_path / "aside", study_dir)
        while outage.down and time.time() < deadline:
            time.sleep(0.05)
        assert not outage.down and "answers again after" in lines[-1], lines


def test_one_driver_per_study_on_run_storage(tmp_path, workspace, capsys):
    """Run storage has no per-node leases, so a second driver of the same study (another laptop, a
    second `reslab submit`) would train the same runs and overwrite the first one's pushes: it is
    refused while the first one's marker is live, and takes over once that driver is gone."""
    store = tmp_path / "store"
    storage = RunStorage.at(str(store))
    path = write_study(tmp_path, name="st")
    with hold_study(storage, "st", "sub-a", 120, heartbeat_s=0.2, settle_s=0) as held:
        marker = json.loads((store / "runs" / "st" / DRIVER_MARKER).read_text())
        assert (marker["submission"], marker["pid"]) == ("sub-a", os.getpid())
        busy = rf"another driver holds it .*\(submission sub-a, pid {os.getpid()} on "
        with pytest.raises(StudyBusy, match=busy), hold_study(storage, "st", "sub-b", 120, settle_s=0):
            pytest.fail("a second driver got the study")
        time.sleep(0.7)
        renewed = study_driver(storage, "st")
        assert renewed["submission"] == "sub-a" and renewed["heartbeat"] > held["heartbeat"]  # renewed, not replaced

        # `reslab run` of the study from a second workspace: one line, exit 2, nothing trained or stored
        other = tmp_path / "second-laptop"
        code = main(["run", str(path), "--workspace", str(other), "--storage", str(store)])
        err = capsys.readouterr().err.strip()
        assert code == 2 and err.count("\n") == 0 and "another driver holds it" in err and "sub-a" in err, err
        assert not (other / "runs" / "st").exists()
        assert sorted(p.name for p in (store / "runs" / "st").iterdir()) == [DRIVER_MARKER]
        assert main(["status", str(path), "--workspace", str(other), "--storage", str(store)]) == 0
        assert f"driver: submission sub-a, pid {os.getpid()} on" in capsys.readouterr().out
    assert study_driver(storage, "st") is None  # released at the end

    # a holder that is gone: a dead pid on this host at once, another host after the lease timeout
    dead = {**lease_for("sub-dead"), "pid": _dead_pid()}
    stale = {**lease_for("sub-far"), "host": "elsewhere", "heartbeat": time.time() - 200}
    live_far = {**lease_for("sub-live"), "host": "elsewhere"}
    for marker, taken in ((dead, True), (stale, True), (live_far, False)):
        storage.study_dir("st").write(DRIVER_MARKER, json.dumps(marker).encode())
        if taken:
            with hold_study(storage, "st", "sub-c", 120, settle_s=0):
                assert study_driver(storage, "st")["submission"] == "sub-c"
        else:
            with pytest.raises(StudyBusy, match="sub-live"), hold_study(storage, "st", "sub-c", 120, settle_s=0):
                pass
            assert study_driver(storage, "st")["submission"] == "sub-live"  # refused: nothing written


def test_two_drivers_racing_for_a_study_one_backs_off(tmp_path):
    """Both read no marker and both write; each checks again after the settle interval, and the one
    whose marker was overwritten backs off without deleting the other's."""
    storage = RunStorage.at(str(tmp_path / "store"))
    rival = {**lease_for("sub-rival"), "host": "elsewhere"}
    timer = threading.Timer(0.1, lambda: storage.study_dir("st").write(DRIVER_MARKER, json.dumps(rival).encode()))
    timer.start()
    with pytest.raises(StudyBusy, match="sub-rival"), hold_study(storage, "st", "sub-a", 120, settle_s=0.5):
        pass
    timer.join()
    assert study_driver(storage, "st")["submission"] == "sub-rival"


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_checkpoint_uploads_run_beside_training(tmp_path, workspace, monkeypatch):
    """The first checkpoint's upload is held until training reaches its last step: training must get
    there meanwhile (a push in the training thread would wait forever), later snapshots replace the
    waiting one, and the end push still leaves storage with the finished run and no snapshot behind."""
    ws = with_storage(workspace, str(tmp_path / "store"))
    path = write_study(tmp_path, name="beside", text=ONE_RUN.format(name="beside").replace("checkpoint_every: 3",
                                                                                           "checkpoint_every: 1"))
    monkeypatch.setenv("RESLAB_SCRATCH", str(tmp_path / "node"))
    release, uploads = threading.Event(), []
    real_push = StoredRun.push

    def held_push(self, rd, **kwargs):
        if threading.current_thread().name.startswith("reslab-push"):
            uploads.append(json.loads((rd.path / "status").read_text())["checkpoint_step"])
            assert release.wait(30), "training never reached its last step while an upload was under way"
        return real_push(self, rd, **kwargs)

    def at_step(done: int) -> None:
        if done == 6:
            assert uploads == [1] and not release.is_set()  # steps 2-6 trained while step 1's upload waited
            release.set()

    monkeypatch.setattr(StoredRun, "push", held_push)
    _, runs, result = run_study(path, ws, LocalBackend(train_fn=functools.partial(train, on_step=at_step)))
    assert result.ok and release.is_set(), (result.states, result.errors)
    # snapshots 2-4 were replaced while step 1 uploaded, not queued: after it, only 5 (waiting at the
    # release) and 6 (the last checkpoint) may go up
    assert uploads[0] == 1 and set(uploads[1:]) <= {5, 6} and uploads == sorted(uploads), uploads
    rid = runs[0].run_id
    stored = RunStorage.at(str(tmp_path / "store")).run("beside", rid)
    assert stored.status()["state"] == SUCCESS and CHECKPOINT in stored.files()
    node = tmp_path / "node" / "beside" / rid
    assert not (node / ".push").exists() and "failed" not in (node / "train.log").read_text()


# ----------------------------------------------------------------------------- through S3 (moto)


@pytest.fixture(scope="module")
def s3_uri(tmp_path_factory):
    """A moto S3 server on 127.0.0.1 and a bucket in it; the storage URI of a prefix in that bucket."""
    import boto3  # comes with moto[server], the test extra
    port = free_port()
    logs = tmp_path_factory.mktemp("moto") / "moto.log"
    with open(logs, "wb") as out:
        server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                                  stdout=out, stderr=subprocess.STDOUT)
    endpoint = f"http://127.0.0.1:{port}"
    try:
        client = boto3.client("s3", endpoint_url=endpoint)
        deadline = time.time() + 30
        while True:
            try:
                client.create_bucket(Bucket="reslab")
                break
            except Exception:
                if time.time() > deadline or server.poll() is not None:
                    raise RuntimeError(f"moto server did not start: {logs.read_text()[-2000:]}") from None
                time.sleep(0.2)
        yield f"s3://reslab/team/runs-store?endpoint_override=127.0.0.1:{port}&scheme=http", client
    finally:
        server.terminate()
        server.wait(10)


@pytest.mark.slow
def test_round_trip_through_s3(tmp_path, workspace, s3_uri, capsys):
    uri, client = s3_uri
    ws = with_storage(workspace, uri)
    path = write_study(tmp_path, name="s3trip")
    _, runs, result = run_study(path, ws)
    assert result.ok and result.count("succeeded") == 4

    storage = RunStorage.at(uri)
    assert storage.run_ids("s3trip") == sorted(r.run_id for r in runs)
    keys = {o["Key"] for o in client.list_objects_v2(Bucket="reslab", Prefix="team/runs-store/runs/s3trip/")
            ["Contents"]}
    for run in runs:
        prefix = f"team/runs-store/runs/s3trip/{run.run_id}/"
        assert {f"{prefix}{n}" for n in (*RECORDS, CHECKPOINT)} <= keys
        local = ws.run_dir("s3trip", run.run_id)
        full, records = RunDir(tmp_path / "full" / run.run_id), RunDir(tmp_path / "records" / run.run_id)
        stored = StoredRun.at(storage.run_uri("s3trip", run.run_id))
        assert stored.pull(full, checkpoint=True) == ["status", *[n for n in RECORDS if n != "status"], CHECKPOINT]
        for name in (*RECORDS, CHECKPOINT):
            assert (full.path / name).read_bytes() == (local.path / name).read_bytes(), name
        stored.pull(records, checkpoint=False)
        assert not (records.path / CHECKPOINT).exists() and records.state() == SUCCESS

    # `reslab convert` pulls a prenorm run's checkpoint into another workspace
    control = next(r for r in runs if r.arm == "control")
    other = tmp_path / "laptop"
    code = main(["convert", f"s3trip/{control.run_id}", "--storage", uri, "--workspace", str(other),
                 "--residual", "delta_block", "--out", str(tmp_path / "converted")])
    out = capsys.readouterr().out
    assert code == 0, out
    pulled = other / "runs" / "s3trip" / control.run_id / CHECKPOINT
    assert pulled.read_bytes() == (ws.run_dir("s3trip", control.run_id).path / CHECKPOINT).read_bytes()
    assert "pulled run s3trip/" in out and (tmp_path / "converted" / "run_config.json").is_file()
    assert main(["convert", "s3trip/nosuchrun", "--storage", uri, "--workspace", str(other),
                 "--residual", "delta_block", "--out", str(tmp_path / "c2")]) == 2
    assert "has no checkpoint.pt in run storage" in capsys.readouterr().err


@pytest.mark.slow
def test_a_ray_study_lands_in_s3_and_is_skipped_from_s3_alone(tmp_path, workspace, s3_uri, ray_session):
    from reslab.orchestrator.dispatch.ray_backend import RayBackend

    uri, client = s3_uri
    ws = with_storage(workspace, uri)
    path = write_study(tmp_path, name="s3ray")
    _, runs, result = run_study(path, ws, RayBackend(workspace=ws.root))
    assert result.ok and result.count("succeeded") == 4
    for run in runs:
        body = client.get_object(Bucket="reslab", Key=f"team/runs-store/runs/s3ray/{run.run_id}/status")["Body"]
        assert json.loads(body.read())["state"] == SUCCESS

    shutil.rmtree(ws.root / "runs")  # the driver's machine lost its copy
    _, _, again = run_study(path, ws, RayBackend(workspace=ws.root))
    assert again.count("skipped") == 4 and again.cluster is None  # Ray not even started
    assert all(ws.run_dir("s3ray", r.run_id).state() == SUCCESS for r in runs)


def test_status_from_another_machine_shows_a_run_training_on_the_cluster_as_running(tmp_path):
    """Storage keeps no leases, so a laptop's `reslab status` cannot tell a live run from one whose driver
    stopped: it shows what the node last pushed (running, at its checkpoint step), and the plan's reason says both
    readings; a new submission would resume it."""
    from reslab.orchestrator.driving.progress import study_status

    runs = expand(load_study(write_study(tmp_path, name="st")))
    storage = RunStorage.at(str(tmp_path / "store"))
    node = RunDir(tmp_path / "scratch" / "st" / runs[0].run_id)
    _fake_run(node, step=3, state="RUNNING")
    node.metrics_file.write_text(json.dumps({"kind": "train", "step": 3, "train_loss": 2.5, "time": 1.0}) + "\n")
    storage.run("st", runs[0].run_id).push(node)

    laptop = Workspace.at(tmp_path / "laptop", str(tmp_path / "store"))
    assert pull_study(laptop, "st", [r.run_id for r in runs]) == [runs[0].run_id]
    status = study_status(runs, laptop, lease_timeout_s=120)
    first = next(s for s in status.runs if s.entry.run.run_id == runs[0].run_id)
    assert (first.state, first.step, first.train_loss) == ("running", 3, 2.5)
    assert "keeps no leases" in first.entry.reason and "resumes from step 3" in first.entry.reason, first.entry.reason
    assert status.counts() == {"succeeded": 0, "running": 1, "failed": 0, "to run": len(runs) - 1}


def _stored(uri: str, study: str, run_id: str) -> StoredRun:
    return StoredRun.at(RunStorage.at(uri).run_uri(study, run_id))


def _s3_tree(client, prefix: str) -> dict[str, bytes]:
    """Every object under `prefix` in the test bucket, by its key relative to `prefix` (`stored_tree`'s shape);
    pyarrow's empty directory markers (keys ending in /) left out."""
    listed = client.list_objects_v2(Bucket="reslab", Prefix=prefix).get("Contents", [])
    return {o["Key"][len(prefix):]: client.get_object(Bucket="reslab", Key=o["Key"])["Body"].read() for o in listed
            if not o["Key"].endswith("/")}


@pytest.mark.slow
def test_an_s3_outage_fails_nothing_trains_nothing_twice_and_storage_ends_complete(tmp_path, workspace, s3_uri,
                                                                                    monkeypatch):
    """Storage (moto, behind a proxy the test kills mid-run and restores once the next run could not start) is
    down while a run finishes and while the next one would start: the finished run is counted, never failed
    nor retrained, and once storage answers the node it finished on pushes its copy; the next waits. The runs
    train in node-local scratch directories (`$RESLAB_SCRATCH`, a cluster without a shared filesystem: the
    driver's copies have no checkpoint), and storage ends file for file as an uninterrupted submission of the
    same study leaves it, train.log, diagnostics and final checkpoints included. Then the outage run's stored
    summary is truncated: a workspace that has the run pushes it again; one that has only storage's copy
    resumes it from its final checkpoint, which holds the result, and writes the same summary back. Then the
    bucket is emptied (a server restarted empty): the next `run` refills it, whole, from the nodes."""
    uri, client = s3_uri
    port = re.search(r"endpoint_override=127\.0\.0\.1:(\d+)", uri).group(1)
    path = write_study(tmp_path, name="outage")
    study = load_study(path)
    runs = expand(study)
    # the same study without an outage, on its own prefix: what storage must hold after the outage
    monkeypatch.setenv("RESLAB_SCRATCH", str(tmp_path / "node-clean"))
    clean = Workspace.at(tmp_path / "clean", uri.replace("team/runs-store", "team/runs-clean"))
    assert submit(study, runs, clean, LocalBackend(), None, ExecutionOptions(), stream=io.StringIO(),
                  say=lambda *_: None).ok
    expected = _s3_tree(client, "team/runs-clean/runs/outage/")
    assert len(expected) == len(runs) * (len(RECORDS) + 1)  # the records and the final checkpoint of each run

    proxy = TcpProxy(int(port)).start()
    ws = with_storage(workspace, uri.replace(f"127.0.0.1:{port}", f"127.0.0.1:{proxy.port}"))
    monkeypatch.setenv("RESLAB_SCRATCH", str(tmp_path / "node"))

    def kill_storage(done: int) -> None:
        if done == 2 and not hasattr(kill_storage, "killed"):
            kill_storage.killed = proxy.stop()  # type: ignore[attr-defined,func-returns-value]

    class Restoring(LocalBackend):
        def execute(self, task):
            completion = super().execute(task)
            if completion.outcome.storage_unreachable:  # the next run could not start: storage comes back
                proxy.start()
            return completion

    # one end-of-attempt push per attempt (each try of a dead S3 endpoint costs pyarrow's own ~6 s of retries)
    monkeypatch.setattr("reslab.orchestrator.durability.storage.PUSH_TRIES", 1)
    lines: list[str] = []
    say = lines.append
    result = submit(study, runs, ws, Restoring(train_fn=functools.partial(train, on_step=kill_storage)),
                    GuardedTracker(ws.default_tracking_uri(), ws), ExecutionOptions(retries=0), stream=io.StringIO(),
                    say=say)
    assert result.ok and result.count("succeeded") == 4, (result.states, result.errors)
    logs = "\n".join(RunDir(tmp_path / "node" / "outage" / r.run_id).log_file.read_text() for r in runs)
    assert any("unreachable for" in line for line in lines) and any("answers again" in line for line in lines), \
        (lines, logs)
    assert "gave up after 1 tries" in logs  # a run finished during the outage
    for run in runs:
        node = RunDir(tmp_path / "node" / "outage" / run.run_id)
        assert node.status()["attempts"] == 1 and node.log_file.read_text().count("attempt 1 of submission") == 1
        assert ws.run_dir("outage", run.run_id).complete()  # the table counts every run
    assert_same_storage(_s3_tree(client, "team/runs-store/runs/outage/"), expected)

    # the run that finished during the outage: its stored summary truncated, pushed again from a workspace that
    # has the run...
    outage_run = next(r for r in runs if "gave up after" in RunDir(tmp_path / "node" / "outage" / r.run_id)
                      .log_file.read_text())
    key = f"team/runs-store/runs/outage/{outage_run.run_id}/summary.json"
    whole = client.get_object(Bucket="reslab", Key=key)["Body"].read()
    client.put_object(Bucket="reslab", Key=key, Body=whole[:25])
    lines.clear()
    submit(study, runs, ws, LocalBackend(), None, ExecutionOptions(), stream=io.StringIO(), say=say)
    assert any("pushed 1 finished run(s) it lacked" in line for line in lines), lines
    assert client.get_object(Bucket="reslab", Key=key)["Body"].read() == whole
    # ...and, from a workspace with only storage's copy, re-derived from the final checkpoint it pushed
    client.put_object(Bucket="reslab", Key=key, Body=whole[:25])
    monkeypatch.setenv("RESLAB_SCRATCH", str(tmp_path / "node2"))
    laptop, lines[:] = Workspace.at(tmp_path / "laptop", uri), []
    repaired = submit(study, runs, laptop, LocalBackend(), None, ExecutionOptions(), stream=io.StringIO(), say=say)
    assert repaired.states[outage_run.run_id] == "succeeded" and repaired.count("skipped") == 3
    assert any(line.startswith("  repairing ") for line in lines), lines
    node2 = RunDir(tmp_path / "node2" / "outage" / outage_run.run_id)
    assert "is the final checkpoint: nothing to train" in node2.log_file.read_text()
    assert json.loads(client.get_object(Bucket="reslab", Key=key)["Body"].read()) == json.loads(whole)

    # the server restarted empty: the next run pushes what storage lacks before planning (the checkpoints from
    # the node that trained the runs), and trains nothing
    monkeypatch.setenv("RESLAB_SCRATCH", str(tmp_path / "node"))
    objects = client.list_objects_v2(Bucket="reslab", Prefix="team/runs-store/runs/outage/")["Contents"]
    client.delete_objects(Bucket="reslab", Delete={"Objects": [{"Key": o["Key"]} for o in objects]})
    lines.clear()
    again = submit(study, runs, ws, LocalBackend(), GuardedTracker(ws.default_tracking_uri(), ws), ExecutionOptions(),
                   stream=io.StringIO(), say=say)
    assert again.count("skipped") == 4 and any("pushed 4 finished run(s) it lacked" in line for line in lines), lines
    assert_same_storage(_s3_tree(client, "team/runs-store/runs/outage/"), expected)
