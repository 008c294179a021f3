"""`reslab run` for real: interrupted with SIGINT (a terminal's Ctrl-C) or killed with SIGKILL
part-way through a study, then run again; the second run finishes exactly the missing work."""

from __future__ import annotations

import collections
import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from orch_helpers import write_study

from reslab.experiments import expand, load_study
from reslab.orchestrator.tracking import _import_mlflow
from reslab.orchestrator.workspace import INTERRUPTED, RUNNING, SUCCESS, Workspace, process_alive

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]

# The tiny preset's own width (d=64, 128-token windows): ~5 s per run on one core, slow enough
# to be caught mid-run.
STUDY = """
study: {name}
base:
  model: {{preset: tiny}}
  optim: {{batch_size: 8, warmup_steps: 5}}
  train: {{steps: 100, eval_every: 25, log_every: 5, eval_batches: 2, checkpoint_every: 10}}
arms:
  control: prenorm
  attnres: {{residual: attnres}}
seeds: 2
comparisons:
  - {{name: main, control: control, exploratory: true}}
"""


def start(path: Path, ws: Workspace, log: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("RAY_ADDRESS", None)
    return subprocess.Popen(
        [sys.executable, "-m", "reslab.orchestrator.cli", "run", str(path), "--workspace", str(ws.root)],
        cwd=ROOT, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True,
    )


def wait_mid_study(proc, runs, ws, log: Path, timeout=300):
    """Until one run has succeeded and another is running past its first checkpoint."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        states = [ws.run_dir(r.study, r.run_id).status() or {} for r in runs]
        done = [s for s in states if s.get("state") == SUCCESS]
        busy = [s for s in states if s.get("state") == RUNNING and s.get("checkpoint_step")]
        if done and busy:
            return
        assert proc.poll() is None, f"reslab run ended early:\n{log.read_text()}"
        time.sleep(0.1)
    raise AssertionError(f"the study never got mid-way:\n{log.read_text()}")


def finish(proc, timeout=300) -> int:
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise


def kill_leftovers(pgid: int, runs, ws) -> None:
    """After a SIGKILL the driver's local Ray processes (same process group) outlive it; end
    them, and wait for the workers they ran (own process groups) to exit."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)
    deadline = time.time() + 60
    for r in runs:
        lease = ws.run_dir(r.study, r.run_id).lease()
        while lease and process_alive(lease["host"], lease["pid"], lease.get("pid_start")):
            if time.time() > deadline:
                os.kill(lease["pid"], signal.SIGKILL)
            time.sleep(0.2)


def mlflow_children(ws: Workspace, study: str):
    client = _import_mlflow()(tracking_uri=ws.default_tracking_uri())
    exp = client.get_experiment_by_name(study)
    kids = client.search_runs([exp.experiment_id], filter_string="tags.reslab_kind = 'run'")
    parents = client.search_runs([exp.experiment_id], filter_string="tags.reslab_kind = 'submission'")
    return client, kids, parents


def check_complete(ws: Workspace, runs, study: str) -> None:
    client, kids, parents = mlflow_children(ws, study)
    counts = collections.Counter(k.data.tags["run_id"] for k in kids)
    assert counts == collections.Counter(r.run_id for r in runs), "not exactly one MLflow child per run id"
    for kid in kids:
        assert kid.info.status == "FINISHED"
        steps = [m.step for m in client.get_metric_history(kid.info.run_id, "train_loss")]
        assert steps == list(range(5, 101, 5)), f"{kid.info.run_name}: {steps}"
        assert [m.step for m in client.get_metric_history(kid.info.run_id, "val_loss")] == [25, 50, 75, 100]
    for r in runs:
        rd = ws.run_dir(study, r.run_id)
        assert rd.state() == SUCCESS and rd.lease() is None
        assert [row["step"] for row in rd.metrics() if row["kind"] == "train"] == list(range(5, 101, 5))
    return parents


def test_ctrl_c_then_rerun_finishes_the_study(tmp_path, workspace):
    ws = workspace
    path = write_study(tmp_path, name="sigint", text=STUDY.format(name="sigint"))
    runs = expand(load_study(path))
    log = tmp_path / "first.log"
    proc = start(path, ws, log)
    wait_mid_study(proc, runs, ws, log)
    os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal does: the whole foreground group
    assert finish(proc) == 130, log.read_text()
    out = log.read_text()
    assert "interrupted; " in out and "Run the same command again" in out

    states = {r.run_id: ws.run_dir("sigint", r.run_id).status() for r in runs}
    assert all(s is None or s["state"] in (SUCCESS, INTERRUPTED) for s in states.values()), states
    assert all(ws.run_dir("sigint", r.run_id).lease() is None for r in runs)
    interrupted = [rid for rid, s in states.items() if s and s["state"] == INTERRUPTED]
    assert interrupted and any(states[rid].get("checkpoint_step") for rid in interrupted)
    _, kids, parents = mlflow_children(ws, "sigint")
    killed = {k.data.tags["run_id"] for k in kids if k.info.status == "KILLED"}
    # A run stopped before its first event has no MLflow child yet; every one that trained has.
    assert {rid for rid in interrupted if states[rid].get("checkpoint_step")} <= killed <= set(interrupted)
    assert [p.info.status for p in parents] == ["KILLED"]

    log2 = tmp_path / "second.log"
    rerun = start(path, ws, log2)
    assert finish(rerun) == 0, log2.read_text()
    out2 = log2.read_text()
    finished_before = sum(1 for s in states.values() if s and s["state"] == SUCCESS)
    assert f"{len(runs) - finished_before} succeeded, {finished_before} skipped" in out2
    for rid in interrupted:
        if states[rid].get("checkpoint_step"):
            assert "resumed from" in ws.run_dir("sigint", rid).log_file.read_text()
    parents = check_complete(ws, runs, "sigint")
    assert sorted(p.info.status for p in parents) == ["FINISHED", "KILLED"]
    assert "mean delta" in out2  # the comparison table closes the run


def test_sigkill_then_rerun_finishes_the_study(tmp_path, workspace):
    ws = workspace
    path = write_study(tmp_path, name="sigkill", text=STUDY.format(name="sigkill"))
    runs = expand(load_study(path))
    log = tmp_path / "first.log"
    proc = start(path, ws, log)
    wait_mid_study(proc, runs, ws, log)
    os.kill(proc.pid, signal.SIGKILL)  # no cleanup at all
    proc.wait(30)
    kill_leftovers(proc.pid, runs, ws)
    stranded = [r.run_id for r in runs if ws.run_dir("sigkill", r.run_id).state() == RUNNING]
    # a worker may finish training in the second before the driver's reaper ends it: its summary is
    # written but not its SUCCESS, and the rerun must take that result as it is, not train again
    trained = {rid for rid in stranded if ws.run_dir("sigkill", rid).complete()}

    log2 = tmp_path / "second.log"
    rerun = start(path, ws, log2)
    assert finish(rerun) == 0, log2.read_text()
    for rid in stranded:
        train_log = ws.run_dir("sigkill", rid).log_file.read_text()
        if rid in trained:
            assert train_log.count("done:") == 1 and "resumed from" not in train_log, train_log
        else:
            assert "stale lease" in log2.read_text() or "resumed from" in train_log
    parents = check_complete(ws, runs, "sigkill")
    # The killed driver's parent run is closed as abandoned by the next submission.
    assert sorted(p.info.status for p in parents) == ["FINISHED", "KILLED"]
