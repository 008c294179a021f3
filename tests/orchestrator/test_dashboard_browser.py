"""The dashboard shows the study: headless Chromium against `reslab dashboard` renders the study's runs page
and the parent run's result artifacts; one parent per submission that did something.

The MLflow UI nests child runs under their collapsed parent, so the DOM of the runs page shows the parent row
and the run count; the children's names, tags and params are read from the REST API the page itself calls."""

from __future__ import annotations

import io
import os
import signal
from pathlib import Path

import pytest
from orch_helpers import write_study
from test_dashboard import api, free_port, serve_dashboard
from test_report import CHROMIUM, chromium

from reslab.experiments import expand, load_study
from reslab.orchestrator.dispatch.local_backend import LocalBackend
from reslab.orchestrator.readout import compare_study
from reslab.orchestrator.report import publish_study_result
from reslab.orchestrator.submit import submit
from reslab.orchestrator.tracking import Tracker

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]

# The preset's sizes are left unset (only seq_len is shortened): params must show them resolved.
STUDY = """
study: dash
base:
  model: {preset: tiny, seq_len: 32}
  optim: {batch_size: 4, warmup_steps: 2, lr: 3.0e-3}
  train: {steps: 6, eval_every: 3, log_every: 1, eval_batches: 2, tail_k: 2, checkpoint_every: 3}
arms:
  control: prenorm
  attnres: {residual: attnres}
seeds: 2
comparisons:
  - {name: main, control: control, treatments: [attnres], exploratory: true}
"""


def submit_and_publish(study, runs, workspace) -> str | None:
    """What `reslab run` does after dispatch (cli/study.py cmd_run), with the in-process backend."""
    tracker = Tracker(workspace.default_tracking_uri(), workspace)
    result = submit(study, runs, workspace, LocalBackend(), tracker, stream=io.StringIO(), tty=False,
                    say=lambda *_: None)
    if result.parent_run_id is not None:
        publish_study_result(study, runs, workspace, tracker, compare_study(study, runs, workspace, tracker.uri))
    return result.parent_run_id


@pytest.mark.skipif(CHROMIUM is None, reason="headless Chromium is not installed (Debian: apt-get install chromium)")
def test_the_dashboard_lists_the_study_runs_and_the_parents_result(tmp_path, workspace):
    study = load_study(write_study(tmp_path, text=STUDY))
    runs = expand(study)
    parent = submit_and_publish(study, runs, workspace)
    assert parent is not None
    assert submit_and_publish(study, runs, workspace) is None  # a no-op re-run adds no empty parent

    port = free_port()
    log = tmp_path / "dashboard.out"
    proc = serve_dashboard(workspace, port, log)
    base = f"http://127.0.0.1:{port}"
    try:
        exp = api(f"{base}/api/2.0/mlflow/experiments/get-by-name?experiment_name=dash")["experiment"]
        found = api(f"{base}/api/2.0/mlflow/runs/search", {"experiment_ids": [exp["experiment_id"]],
                                                           "max_results": 100})["runs"]
        parents = [r for r in found if {"key": "reslab_kind", "value": "submission"} in r["data"]["tags"]]
        children = [r for r in found if r not in parents]
        assert [p["info"]["run_id"] for p in parents] == [parent]
        assert sorted(r["info"]["run_name"] for r in children) == ["attnres/s0", "attnres/s1", "control/s0",
                                                                   "control/s1"]
        for r in children:
            tags = {t["key"]: t["value"] for t in r["data"]["tags"]}
            params = {p["key"]: p["value"] for p in r["data"]["params"]}
            assert r["info"]["run_name"] == f"{tags['arm']}/s{tags['seed']}"
            assert (params["model.d_model"], params["model.n_layers"]) == ("64", "4")  # the tiny preset's

        runs_page = f"{base}/#/experiments/{exp['experiment_id']}/runs"
        dom = chromium(tmp_path, "--virtual-time-budget=30000", "--window-size=1400,900", "--dump-dom", runs_page)
        assert "submission " in dom and ">5<" in dom and "matching runs" in dom, dom[-3000:]
        artifacts = f"{base}/#/experiments/{exp['experiment_id']}/runs/{parent}/artifacts"
        dom = chromium(tmp_path, "--virtual-time-budget=30000", "--window-size=1400,900", "--dump-dom", artifacts)
        for name in ("paired_table.json", "paired_table.csv", "forest.png", "report.html"):
            assert name in dom, name
        shot = tmp_path / "dashboard.png"
        chromium(tmp_path, "--virtual-time-budget=30000", "--window-size=1400,900", f"--screenshot={shot}", runs_page)
        assert shot.stat().st_size > 0
    finally:
        os.kill(proc.pid, signal.SIGINT)
        proc.wait(60)
