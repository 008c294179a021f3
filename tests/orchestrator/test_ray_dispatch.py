"""The Ray backend in this process, sharing one local Ray session across tests."""

from __future__ import annotations

import io
import json
import os
import signal
import threading
import time

import pytest
from orch_helpers import write_study

from reslab.experiments import expand, load_study
from reslab.orchestrator.dispatch import BackendError
from reslab.orchestrator.dispatch.ray_backend import RayBackend
from reslab.orchestrator.driving.submit import ExecutionOptions, submit
from reslab.orchestrator.tasks import SUCCESS, Resources
from reslab.orchestrator.tracking.guarded import GuardedTracker
from reslab.orchestrator.tracking.store import import_mlflow

pytestmark = pytest.mark.slow


def _submit(path, ws, **options):
    study = load_study(path)
    runs = expand(study)
    out = io.StringIO()
    result = submit(study, runs, ws, RayBackend(workspace=ws.root), GuardedTracker(ws.default_tracking_uri(), ws),
                    ExecutionOptions(**options), stream=out, say=lambda *_: None)
    return runs, result, out.getvalue()


def test_ray_runs_a_study_with_progress_and_tracking(tmp_path, workspace, ray_session):
    runs, result, progress = _submit(write_study(tmp_path), workspace)
    assert result.ok and result.count("succeeded") == 4
    assert result.cluster.address == "existing Ray session" and result.cluster.cpus == 2
    # Events travelled worker -> actor -> driver: progress lines and per-step MLflow metrics.
    for run in runs:
        assert f"start {run.label}" in progress and f"succeeded {run.label}" in progress
        assert f"{run.label} step 3/6" in progress
    client = import_mlflow()(tracking_uri=workspace.default_tracking_uri())
    exp = client.get_experiment_by_name("tiny")
    kids = client.search_runs([exp.experiment_id], filter_string="tags.reslab_kind = 'run'")
    assert len(kids) == 4 and {k.info.status for k in kids} == {"FINISHED"}
    for kid in kids:
        assert [m.step for m in client.get_metric_history(kid.info.run_id, "train_loss")] == [1, 2, 3, 4, 5, 6]
    # Each run trained with one torch thread per CPU it asked for.
    assert {workspace.run_dir("tiny", r.run_id).env()["torch_threads"] for r in runs} == {1}

    runs2, again, _ = _submit(write_study(tmp_path), workspace)
    assert again.count("skipped") == 4 and again.cluster is None  # nothing to run: Ray not even touched


def test_a_gpu_request_on_a_cpu_cluster_fails_up_front(tmp_path, workspace, ray_session):
    backend = RayBackend(workspace=workspace.root)
    backend.start()
    with pytest.raises(BackendError, match=r"asks for 1 GPU but the Ray cluster has no GPU.*pending forever"):
        backend.resources(Resources(cpus=1, gpus=1))
    with pytest.raises(BackendError, match=r"no Ray node can hold one run \(64 CPU"):
        backend.resources(Resources(cpus=64, gpus=0))
    backend.shutdown()
    with pytest.raises(BackendError, match="has no GPU"):
        _submit(write_study(tmp_path), workspace, gpus_per_run=1)
    runs = expand(load_study(tmp_path / "tiny.yaml"))
    assert not any(workspace.run_dir("tiny", r.run_id).path.exists() for r in runs)


def test_report_forks_no_copy_of_a_process_with_ray_in_it(ray_session):
    """`reslab report` reads and draws on forked copies of itself (`common.forks`), but not when its process
    has started Ray (a test calling `main`): a fork would copy Ray's threads mid-call."""
    import ray

    from reslab.orchestrator.cli.results import _fork_workers

    assert ray.is_initialized()  # the session's local Ray, started in this process
    assert _fork_workers() == 1


def test_a_killed_worker_is_retried_and_resumes(tmp_path, workspace, ray_session):
    path = write_study(tmp_path, name="killed", steps=300)
    text = path.read_text().replace("seeds: 2", "seeds: 1").replace("checkpoint_every: 3", "checkpoint_every: 20")
    comparison = "  - {name: main, control: control, treatments: [attnres], exploratory: true}\n"
    path.write_text(text.replace("  attnres: {residual: attnres}\n", "").replace(comparison, "")
                    .replace("comparisons:\n", ""))
    (run,) = expand(load_study(path))
    rd = workspace.run_dir("killed", run.run_id)
    killed = {}

    def kill_worker_after_first_checkpoint():
        deadline = time.time() + 120
        while time.time() < deadline:
            status = rd.status() or {}
            lease = rd.lease()
            if status.get("checkpoint_step") and lease:
                os.kill(lease["pid"], signal.SIGKILL)
                killed.update(pid=lease["pid"], step=status["checkpoint_step"])
                return
            time.sleep(0.01)

    killer = threading.Thread(target=kill_worker_after_first_checkpoint)
    killer.start()
    _, result, progress = _submit(path, workspace, retries=1)
    killer.join()
    assert killed, "the worker was never seen running"
    assert result.ok and result.states[run.run_id] == "succeeded", progress
    assert f"retry {run.label} (attempt 2) after: the worker process died" in progress
    assert rd.state() == SUCCESS and rd.status()["attempts"] == 2
    assert f"resumed from {rd.path / 'checkpoint.pt'} at step" in rd.log_file.read_text()
    steps = [r["step"] for r in rd.metrics() if r["kind"] == "train"]
    assert steps == list(range(1, 301)), "a step is missing or repeated after the resume"
    client = import_mlflow()(tracking_uri=workspace.default_tracking_uri())
    exp = client.get_experiment_by_name("killed")
    (kid,) = client.search_runs([exp.experiment_id], filter_string="tags.reslab_kind = 'run'")
    assert kid.info.status == "FINISHED" and kid.data.tags["attempt"] == "2"
    assert [m.step for m in client.get_metric_history(kid.info.run_id, "train_loss")] == list(range(1, 301))
    assert json.loads(json.dumps(rd.summary()))["summary"]["val_loss"] > 0


def test_the_local_instances_workers_run_at_the_drivers_priority(ray_session):
    """Issue 52: Ray runs its workers at nice 15, so beside any busy process on the machine a local study's runs
    got almost no CPU (a 2-step study over 900 s beside 8 CPU burners). The local instance reslab starts runs them
    at nice 0 (os.nice(0) reads a process's niceness without changing it)."""
    import ray

    @ray.remote(num_cpus=0)
    def niceness() -> int:
        return os.nice(0)

    assert ray.get(niceness.remote(), timeout=300) == os.nice(0) == 0
