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
from orch_helpers import TINY_STUDY, free_port, write_study

from reslab.experiments import expand, load_study
from reslab.orchestrator.dispatch.local_backend import LocalBackend
from reslab.orchestrator.driving.submit import submit
from reslab.orchestrator.tracking.guarded import GuardedTracker

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


def api(url: str, body: dict | None = None) -> dict:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        return json.loads(resp.read())


def test_dashboard_lists_the_study_runs_and_stops_cleanly(tmp_path, workspace):
    # two runs of 3 steps (one seed of each arm): the dashboard is checked for listing them, not for their curves
    study = load_study(write_study(tmp_path, text=TINY_STUDY.format(name="tiny", steps=3).replace("seeds: 2",
                                                                                                 "seeds: 1")))
    runs = expand(study)
    submit(study, runs, workspace, LocalBackend(), GuardedTracker(workspace.default_tracking_uri(), workspace),
           stream=io.StringIO(), say=lambda *_: None)

    port = free_port()
    log = tmp_path / "dashboard.out"
    proc = serve_dashboard(workspace, port, log)
    base = f"http://127.0.0.1:{port}"
    try:
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


def serve_dashboard(workspace, port: int, log: Path) -> subprocess.Popen:
    """`reslab dashboard` in its own session, returned once it has printed its URL (stopped if it never does)."""
    with open(log, "w") as out:
        proc = subprocess.Popen(dashboard_cmd(workspace, port), cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True, preexec_fn=as_in_a_terminal)
    deadline = time.time() + 120
    try:
        while f"MLflow UI: http://127.0.0.1:{port}" not in log.read_text():
            assert proc.poll() is None, log.read_text()
            assert time.time() < deadline, f"no URL printed:\n{log.read_text()}"
            time.sleep(0.3)
    except AssertionError:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    return proc


def as_in_a_terminal() -> None:
    """SIGINT at its default, as in a terminal's foreground job: the suite may run as a background
    job (`bash .ci/run &`), whose children inherit SIGINT ignored, and Python then installs no
    KeyboardInterrupt, so the Ctrl-C these tests send would never arrive."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def dashboard_cmd(workspace, port: int, *extra: str) -> list[str]:
    return [sys.executable, "-c", "import sys; from reslab.orchestrator.cli import main; sys.exit(main())",
            "dashboard", "--workspace", str(workspace.root), "--port", str(port), *extra]


def test_a_busy_port_is_an_error_before_anything_starts(workspace):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        done = subprocess.run(dashboard_cmd(workspace, port), cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert f"--port {port}: 127.0.0.1:{port} is already in use" in done.stderr
    assert "Traceback" not in done.stderr and "MLflow UI:" not in done.stdout


def test_the_host_is_checked_and_a_non_loopback_one_is_flagged():
    from reslab.orchestrator.tracking.dashboard import check_bind
    from reslab.orchestrator.tracking.store import TrackingUnavailable

    assert check_bind("127.0.0.1", free_port()) is True
    assert check_bind("0.0.0.0", free_port()) is False  # the caller prints the no-authentication warning
    with pytest.raises(TrackingUnavailable, match=r"--host '192\.0\.2\.254': cannot listen"):
        check_bind("192.0.2.254", free_port())  # TEST-NET-1: never an address of this machine
    with pytest.raises(TrackingUnavailable, match=r"--host 'no-such-host\.invalid': not an address"):
        check_bind("no-such-host.invalid", free_port())


def test_a_sigkilled_dashboard_takes_its_server_with_it(workspace, tmp_path):
    from reslab.orchestrator.durability import reaper

    port = free_port()
    log = tmp_path / "dashboard.out"
    with open(log, "w") as out:
        proc = subprocess.Popen(dashboard_cmd(workspace, port), cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + 120
        while "MLflow UI:" not in log.read_text():
            assert proc.poll() is None and time.time() < deadline, log.read_text()
            time.sleep(0.3)
        below = reaper.descendants([proc.pid])[1:]
        assert any(reaper.start_time(pid) for pid in below), "the server should run below the dashboard"
    finally:
        proc.kill()
        proc.wait()
    deadline = time.time() + 5
    while (left := [pid for pid in below if _running(pid)]) and time.time() < deadline:
        time.sleep(0.2)
    for pid in left:  # clean up before failing
        os.kill(pid, signal.SIGKILL)
    assert not left, f"{len(left)} server processes outlived the SIGKILLed dashboard by 5 s"
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)


def _running(pid: int) -> bool:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return text[text.rindex(")") + 2] != "Z"
