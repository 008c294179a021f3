"""The driver loop, run directories and MLflow tracking, through the in-process backend.

`LocalBackend` calls the same `execute_run` a Ray task calls (see its docstring for why it exists);
the Ray path itself is exercised in test_ray_dispatch.py and test_cli_interrupt.py.
"""

from __future__ import annotations

import functools
import io
import json
import math
import os
import shutil
import signal
from pathlib import Path

import pandas as pd
import pytest
from orch_helpers import write_study

from reslab.common.metrics import MECHANISM_METRICS, PIPELINE_METRICS, SUMMARY_METRICS
from reslab.experiments import RESULTS_VERSION, expand, load_study
from reslab.models.config import flatten
from reslab.models.optim import hashed_config
from reslab.models.training import StopRun, train
from reslab.orchestrator.cli import main
from reslab.orchestrator.dispatch.local_backend import LocalBackend
from reslab.orchestrator.driving.submit import ExecutionOptions, submit
from reslab.orchestrator.durability.workspace import Workspace
from reslab.orchestrator.tasks import FAILED, INTERRUPTED, SUCCESS, Completion
from reslab.orchestrator.tracking.guarded import GuardedTracker
from reslab.orchestrator.tracking.readers import fetch_study_runs
from reslab.orchestrator.tracking.store import import_mlflow
from reslab.results.collect import collect


def run_study(path, ws: Workspace, backend=None, overrides=(), uri=None, **options):
    study = load_study(path, overrides)
    runs = expand(study)
    tracker = GuardedTracker(uri or ws.default_tracking_uri(), ws)
    result = submit(study, runs, ws, backend or LocalBackend(), tracker, ExecutionOptions(**options),
                    stream=io.StringIO(), say=lambda *_: None)
    return study, runs, result


def client(ws: Workspace, uri=None):
    return import_mlflow()(tracking_uri=uri or ws.default_tracking_uri())


def children(ws: Workspace, study: str, uri=None):
    c = client(ws, uri)
    exp = c.get_experiment_by_name(study)
    return c.search_runs([exp.experiment_id], filter_string="tags.reslab_kind = 'run'")


def parents(ws: Workspace, study: str):
    c = client(ws)
    exp = c.get_experiment_by_name(study)
    return c.search_runs([exp.experiment_id], filter_string="tags.reslab_kind = 'submission'")


def test_a_study_runs_and_every_run_describes_itself(tmp_path, workspace):
    study, runs, result = run_study(write_study(tmp_path), workspace)
    assert result.ok and result.count("succeeded") == 4

    for run in runs:
        rd = workspace.run_dir("tiny", run.run_id)
        assert rd.path == workspace.root / "runs" / "tiny" / run.run_id
        assert rd.state() == SUCCESS and rd.lease() is None
        assert rd.spec() == json.loads(json.dumps(run.to_dict()))
        env = rd.env()
        assert env["versions"]["torch"] and "git_sha" in env and "git_dirty" in env
        rows = rd.metrics()
        assert [r["step"] for r in rows if r["kind"] == "train"] == [1, 2, 3, 4, 5, 6]
        assert [r["step"] for r in rows if r["kind"] == "eval"] == [3, 6]
        summary = rd.summary()["summary"]
        assert summary["val_loss"] == rows[-1]["val_loss"]
        assert (rd.path / "checkpoint.pt").is_file() and "step      6/6" in rd.log_file.read_text()
        diagnostics = rd.diagnostics()
        assert [d["step"] for d in diagnostics] == [3, 6]
        assert bool(diagnostics[-1]["routing"]) == (run.arm == "attnres")  # only AttnRes routes

    kids = {r.data.tags["run_id"]: r for r in children(workspace, "tiny")}
    assert sorted(kids) == sorted(r.run_id for r in runs)
    (parent,) = parents(workspace, "tiny")
    assert parent.info.status == "FINISHED"
    c = client(workspace)
    for run in runs:
        kid = kids[run.run_id]
        tags = kid.data.tags
        assert kid.info.status == "FINISHED" and kid.info.run_name == run.label
        assert tags["mlflow.parentRunId"] == parent.info.run_id
        assert (tags["study"], tags["arm"], tags["seed"], tags["pair_key"], tags["grid_key"]) == \
            ("tiny", run.arm, str(run.seed), run.pair_key, run.grid_key)
        assert tags["results_version"] == RESULTS_VERSION and tags["code_version"]
        # the optim section as the run id hashes it: for AdamW and cosine, the flat `optim.muon_*` and
        # `optim.cooldown_*` params of before the registries (issue 50: the MLflow layout unchanged)
        expected = {k: ("null" if v is None else str(v).lower() if isinstance(v, bool) else str(v))
                    for k, v in flatten(hashed_config(run.config)).items()}
        assert kid.data.params == expected and "optim.muon_momentum" in expected
        assert [m.step for m in c.get_metric_history(kid.info.run_id, "val_loss")] == [3, 6]
        assert [m.step for m in c.get_metric_history(kid.info.run_id, "train_loss")] == [1, 2, 3, 4, 5, 6]
        record = workspace.run_dir("tiny", run.run_id).summary()
        summary = record["summary"]
        assert float(kid.data.tags["summary/val_loss_tail"]) == summary["val_loss_tail"]  # repr: exact
        assert float(kid.data.tags["summary/decode_tps"]) == summary["decode_tps"] > 0  # the serving cost too
        assert kid.data.tags["cost/machine"] == record["info"]["cost"]["machine"]["name"]  # and where it was taken
        assert not [k for k in kid.data.metrics if k.startswith("summary/")]  # no single-point summary charts
        artifacts = {a.path for a in c.list_artifacts(kid.info.run_id)}
        assert {"config.json", "env.json", "info.json"} <= artifacts
        diag = {a.path for a in c.list_artifacts(kid.info.run_id, "diagnostics")}
        heatmaps = {"diagnostics/routing_heatmap.png", "diagnostics/routing_entropy.png"}
        assert diag == {"diagnostics/step_000003.json", "diagnostics/step_000006.json"} | (
            heatmaps if run.arm == "attnres" else set())  # only routing variants get heatmaps
        local = c.download_artifacts(kid.info.run_id, "diagnostics/step_000006.json", str(workspace.root / "dl"))
        logged = json.loads(Path(local).read_text())
        assert logged == json.loads(json.dumps(workspace.run_dir("tiny", run.run_id).diagnostics()[-1]))
        if run.arm == "attnres":
            assert logged["routing"]["sites"] and "routing_entropy" in kid.data.metrics
    art_root = c.get_experiment_by_name("tiny").artifact_location
    assert art_root == (workspace.artifacts / "tiny").as_uri()

    # Resubmitting runs nothing and creates no child run, and no empty parent (issue 14).
    _, _, again = run_study(write_study(tmp_path), workspace)
    assert again.count("skipped") == 4 and again.count("succeeded") == 0
    assert len(children(workspace, "tiny")) == 4 and len(parents(workspace, "tiny")) == 1

    # The tidy table, from MLflow, matches the run directories; the cache is written.
    table = collect("tiny", fetch_study_runs(workspace.default_tracking_uri(), "tiny"), expected=runs,
                    cache_dir=workspace.cache)
    assert list(table["run_id"]) == [r.run_id for r in runs]
    assert set(table["status"]) == {"FINISHED"}
    assert table["mlflow_run_id"].tolist() == [kids[r.run_id].info.run_id for r in runs]
    for row, run in zip(table.to_dict("records"), runs, strict=True):
        summary = workspace.run_dir("tiny", run.run_id).summary()["summary"]
        for name in SUMMARY_METRICS:
            if name in summary:
                assert row[name] == pytest.approx(summary[name])
            else:  # a mechanism summary the run could not compute (prenorm routes nothing), or a pipeline one of
                # a run that was not split into stages: NaN in the table
                assert name in MECHANISM_METRICS + PIPELINE_METRICS and math.isnan(row[name]), name
        assert (row["arm"], row["seed"], row["grid_key"]) == (run.arm, run.seed, run.grid_key)
    assert pd.read_parquet(workspace.cache / "tiny.parquet")["run_id"].tolist() == table["run_id"].tolist()


def stop_at(step: int):
    """An `on_step` callback that stops every run after `step` optimizer steps."""
    def on_step(done: int) -> None:
        if done == step:
            raise StopRun(done)
    return on_step


def test_an_interrupted_run_resumes_to_the_uninterrupted_result(tmp_path, workspace, mlflow_db_template):
    path = write_study(tmp_path)
    stopping = LocalBackend(train_fn=functools.partial(train, on_step=stop_at(4)))
    _, runs, first = run_study(path, workspace, stopping)
    assert first.count("interrupted") == 4, (first.states, first.errors)
    rd = workspace.run_dir("tiny", runs[1].run_id)
    assert rd.state() == INTERRUPTED and rd.status()["checkpoint_step"] == 4
    assert max(r["step"] for r in rd.metrics()) == 4
    assert {k.info.status for k in children(workspace, "tiny")} == {"KILLED"}

    _, _, second = run_study(path, workspace)
    assert second.count("succeeded") == 4
    assert "resumed from" in rd.log_file.read_text()
    assert [r["step"] for r in rd.metrics() if r["kind"] == "train"] == [1, 2, 3, 4, 5, 6]

    # Identical to a run that was never interrupted, in a fresh workspace.
    fresh = Workspace(tmp_path / "fresh")
    fresh.root.mkdir()
    shutil.copy(mlflow_db_template, fresh.mlflow_db)
    run_study(path, fresh)
    for run in runs:
        a = workspace.run_dir("tiny", run.run_id).summary()["summary"]
        b = fresh.run_dir("tiny", run.run_id).summary()["summary"]
        assert (a["val_loss"], a["val_loss_tail"], a["train_loss"]) == (b["val_loss"], b["val_loss_tail"],
                                                                          b["train_loss"])

    # One child per run id, reused, with every step exactly once.
    kids = children(workspace, "tiny")
    assert sorted(k.data.tags["run_id"] for k in kids) == sorted(r.run_id for r in runs)
    c = client(workspace)
    for kid in kids:
        assert kid.info.status == "FINISHED"
        assert [m.step for m in c.get_metric_history(kid.info.run_id, "train_loss")] == [1, 2, 3, 4, 5, 6]
        assert [m.step for m in c.get_metric_history(kid.info.run_id, "val_loss")] == [3, 6]


class CrashingBackend(LocalBackend):
    """Test double: the first `crashes` attempts of each run die as a killed worker process would
    (no outcome, an error from the backend), then runs go through normally."""

    def __init__(self, crashes: int) -> None:
        super().__init__()
        self.crashes = crashes
        self.attempts: dict[str, int] = {}

    def execute(self, task):
        n = self.attempts[task.run_id] = self.attempts.get(task.run_id, 0) + 1
        if n <= self.crashes:
            rd = Workspace(Path(task.run_dir).parents[2]).run_dir(task.run.study, task.run_id)
            rd.claim(task.submission, 60)  # the worker got as far as claiming the run
            rd.set_status("RUNNING", attempt=task.attempt)
            return Completion(task, error="the worker process died (killed, or out of memory)")
        return super().execute(task)


def test_a_crash_is_retried_and_then_reported(tmp_path, workspace):
    path = write_study(tmp_path)
    backend = CrashingBackend(crashes=1)
    _, runs, result = run_study(path, workspace, backend, retries=1)
    assert result.ok and result.count("succeeded") == 4
    assert set(backend.attempts.values()) == {2}
    assert {k.info.status for k in children(workspace, "tiny")} == {"FINISHED"}
    assert len(children(workspace, "tiny")) == 4

    path2 = write_study(tmp_path, name="crashy")
    backend = CrashingBackend(crashes=5)
    _, runs, result = run_study(path2, workspace, backend, retries=2)
    assert not result.ok and result.count("failed") == 4 and set(backend.attempts.values()) == {3}
    assert all("worker process died" in e for e in result.errors.values())
    rd = workspace.run_dir("crashy", runs[0].run_id)
    assert rd.state() == FAILED and rd.lease() is None and "worker process died" in rd.status()["error"]
    kids = children(workspace, "crashy")
    assert {k.info.status for k in kids} == {"FAILED"}
    assert all("worker process died" in k.data.tags["error"] for k in kids)

    # Failed runs stay failed until asked: skipped, then rerun (and reusing their child runs).
    _, _, skipped = run_study(path2, workspace)
    assert skipped.count("skipped") == 4
    _, _, rerun = run_study(path2, workspace, rerun_failed=True)
    assert rerun.count("succeeded") == 4
    assert len(children(workspace, "crashy")) == 4
    assert {k.info.status for k in children(workspace, "crashy")} == {"FINISHED"}


def test_divergence_is_reported_once_not_retried(tmp_path, workspace):
    path = write_study(tmp_path, name="diverge")
    _, runs, result = run_study(path, workspace, overrides=[("optim.lr", 1.0e6), ("optim.grad_clip", 0.0)],
                                retries=3)
    failed = [rid for rid, state in result.states.items() if state == "failed"]
    assert failed, "lr=1e6 without clipping should diverge"
    for rid in failed:
        status = workspace.run_dir("diverge", rid).status()
        assert status["attempts"] == 1 and status["retryable"] is False
        assert result.errors[rid].startswith(("TrainingDiverged: loss is", "TrainingDiverged: gradient norm is"))


def test_a_new_tracking_store_is_filled_from_the_run_directories(tmp_path, workspace, mlflow_db_template):
    path = write_study(tmp_path)
    _, runs, _ = run_study(path, workspace)

    other = workspace.root / "other.db"  # e.g. moving to a new tracking server
    shutil.copy(mlflow_db_template, other)
    uri = f"sqlite:///{other}"
    _, _, result = run_study(path, workspace, uri=uri)
    assert result.count("skipped") == 4
    kids = children(workspace, "tiny", uri)
    assert sorted(k.data.tags["run_id"] for k in kids) == sorted(r.run_id for r in runs)
    c = client(workspace, uri)
    for kid in kids:
        assert kid.info.status == "FINISHED" and "summary/val_loss" in kid.data.tags
        assert [m.step for m in c.get_metric_history(kid.info.run_id, "val_loss")] == [3, 6]
        routes = kid.data.tags["arm"] == "attnres"  # json per eval, plus two heatmaps when routing
        assert len(c.list_artifacts(kid.info.run_id, "diagnostics")) == (4 if routes else 2)
    # and a second pass finds nothing left to mirror
    _, _, again = run_study(path, workspace, uri=uri)
    assert again.count("skipped") == 4 and len(children(workspace, "tiny", uri)) == 4


def test_compare_and_export_commands(tmp_path, workspace, capsys):
    path = write_study(tmp_path)
    _, runs, _ = run_study(path, workspace)
    capsys.readouterr()
    assert main(["compare", str(path), "--workspace", str(workspace.root)]) == 0
    out = capsys.readouterr().out
    assert "tiny: 4/4 runs finished" in out and "control" in out and "attnres" in out and "mean delta" in out

    by = {(r.arm, r.seed): r.run_id for r in runs}
    for fmt in ("md", "csv", "parquet", "latex"):
        target = tmp_path / f"table.{fmt}"
        assert main(["export", str(path), "--workspace", str(workspace.root), "--format", fmt, "-o", str(target)]) == 0
        if fmt == "parquet":
            table = pd.read_parquet(target)
            text = " ".join(table["control_run_ids"].tolist() + table["treatment_run_ids"].tolist())
        else:
            text = target.read_text()
        for seed in (0, 1):
            assert by[("control", seed)] in text.replace("\\_", "_")
            assert by[("attnres", seed)] in text.replace("\\_", "_")
    row = pd.read_csv(tmp_path / "table.csv").iloc[0]
    assert row["seeds"] == "0,1" and row["n"] == 2
    assert row["control_run_ids"] == f"{by[('control', 0)]};{by[('control', 1)]}"
    md = (tmp_path / "table.md").read_text()
    assert "Per-seed pairs" in md and f"| control | {by[('control', 1)]} |" in md

    # Runs the plan expects but MLflow lacks are MISSING, and the comparison flags them.
    capsys.readouterr()
    assert main(["compare", str(path), "--workspace", str(workspace.root), "--set", "train.steps=5"]) == 0
    assert "0/4 runs finished" in capsys.readouterr().out


def test_status_command_reports_without_running(tmp_path, workspace, capsys):
    path = write_study(tmp_path)
    run_study(path, workspace, LocalBackend(train_fn=functools.partial(train, on_step=stop_at(4))))
    capsys.readouterr()
    assert main(["status", str(path), "--workspace", str(workspace.root)]) == 0
    out = capsys.readouterr().out
    assert "tiny: 4 runs: 0 succeeded, 0 running, 0 failed, 4 to run" in out
    assert out.count("step      4/6") == 4 and "interrupted; resumes from step 4" in out


def test_sigterm_stops_at_a_safe_point_and_the_next_submission_finishes(tmp_path, workspace):
    path = write_study(tmp_path)
    calls = []

    def train_then_sigterm(*args, **kwargs):
        result = train(*args, **kwargs)
        if not calls:  # a scheduler's SIGTERM arrives while the first run trains
            os.kill(os.getpid(), signal.SIGTERM)
        calls.append(1)
        return result

    before = signal.getsignal(signal.SIGTERM)
    _, runs, first = run_study(path, workspace, LocalBackend(train_fn=train_then_sigterm))
    assert signal.getsignal(signal.SIGTERM) is before  # handlers restored
    assert first.interrupted and len(calls) == 1
    assert first.count("succeeded") == 1 and first.count("interrupted") + first.count("to run") == 3
    (parent,) = parents(workspace, "tiny")
    assert parent.info.status == "KILLED"
    _, _, second = run_study(path, workspace)
    assert second.count("succeeded") == 3 and second.count("skipped") == 1
    assert {k.info.status for k in children(workspace, "tiny")} == {"FINISHED"}
