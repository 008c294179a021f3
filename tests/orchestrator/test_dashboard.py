"""`reslab dashboard` serves the MLflow UI for the workspace store and lists the study's runs."""

from __future__ import annotations

import io
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from orch_helpers import write_study

from reslab.experiments import expand, load_study
from reslab.orchestrator.dispatch.local_backend import LocalBackend
from reslab.orchestrator.submit import submit
from reslab.orchestrator.tracking import Tracker

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def api(url: str, body: dict | None = None) -> dict:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        return json.loads(resp.read())


def test_dashboard_lists_the_study_runs_and_stops_cleanly(tmp_path, workspace):
    study = load_study(write_study(tmp_path))
    runs = expand(study)
    submit(study, runs, workspace, LocalBackend(), Tracker(workspace.default_tracking_uri(), workspace),
           stream=io.StringIO(), tty=False, say=lambda *_: None)

    port = free_port()
    log = tmp_path / "dashboard.out"
    proc = subprocess.Popen(
        [sys.executable, "-m", "reslab.orchestrator.cli", "dashboard", "--workspace", str(workspace.root), "--port", str(port)],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=open(log, "w"), stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 120
        while f"MLflow UI: {base}" not in log.read_text():
            assert proc.poll() is None, log.read_text()
            assert time.time() < deadline, f"no URL printed:\n{log.read_text()}"
            time.sleep(0.3)
        exp = api(f"{base}/api/2.0/mlflow/experiments/get-by-name?experiment_name=tiny")["experiment"]
        found = api(f"{base}/api/2.0/mlflow/runs/search",
                    {"experiment_ids": [exp["experiment_id"]], "filter": "tags.reslab_kind = 'run'",
                     "max_results": 100})["runs"]
        ids = sorted(next(t["value"] for t in r["data"]["tags"] if t["key"] == "run_id") for r in found)
        assert ids == sorted(r.run_id for r in runs)
        assert {r["info"]["status"] for r in found} == {"FINISHED"}
        with urllib.request.urlopen(f"{base}/", timeout=10) as resp:  # the UI itself
            assert resp.status == 200 and b"<html" in resp.read().lower()
    finally:
        os.kill(proc.pid, signal.SIGINT)
        rc = proc.wait(60)
    assert rc == 0 and "MLflow UI stopped" in log.read_text()
    with pytest.raises(OSError):
        urllib.request.urlopen(f"{base}/health", timeout=2)
