"""A real multi-node Ray cluster on this machine: stale code refused or replaced by shipped code,
and a node lost mid-run whose run resumes on another node from run storage. Also: a driver whose
progress actor is lost carries on (in this process's local Ray session).

Each node is its own `ray start` (own `--temp-dir`, own session so it can be killed whole, own
`$RESLAB_SCRATCH`), as separate hosts would be; they share the machine's IP and filesystem, so run
storage is a local path here and the scratch roots are kept apart by name. The head has no CPUs,
so runs land on the worker nodes only, and the driver (a `reslab run` subprocess) attaches to the
head (Ray prefers the head among nodes on the driver's host), which is where its progress actor
is pinned. Node death is detected fast through the GCS health-check settings below.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from orch_helpers import free_port, write_study

from reslab.experiments import expand, load_study
from reslab.orchestrator.attempt.envinfo import SUBPACKAGES, code_fingerprint
from reslab.orchestrator.dispatch.ray_backend import RayBackend, stage_code
from reslab.orchestrator.driving.submit import ExecutionOptions, submit
from reslab.orchestrator.durability.workspace import RunDir
from reslab.orchestrator.tasks import FAILED, SUCCESS
from reslab.orchestrator.tracking.guarded import GuardedTracker
from reslab.orchestrator.tracking.store import import_mlflow

pytestmark = pytest.mark.slow

BIN = Path(sys.executable).parent
# A node whose raylet misses 3 health checks 0.5 s apart is dead (with Ray's defaults it takes 15 s or more).
FAST_DEATH = {"RAY_health_check_initial_delay_ms": "0", "RAY_health_check_period_ms": "500",
              "RAY_health_check_timeout_ms": "500", "RAY_health_check_failure_threshold": "3"}
# The study of both tests: one arm; `seeds` runs of `steps` steps, an eval and a checkpoint every `every`.
STUDY = """
study: {name}
base:
  model: {{preset: tiny, d_model: 32, n_layers: 2, n_heads: 2, n_kv_heads: 2, ffn_hidden: 64, seq_len: 32}}
  optim: {{batch_size: 4, warmup_steps: 2, lr: 3.0e-3}}
  train: {{steps: {steps}, eval_every: {every}, log_every: 1, eval_windows: 8, tail_k: 2, checkpoint_every: {every}}}
  cost: {{measure: false}}
arms:
  control: prenorm
seeds: {seeds}
"""


def _session_pids(sid: int) -> list[int]:
    """Every process of session `sid` (a node: its raylet, agents and workers)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        if int(stat.rpartition(")")[2].split()[3]) == sid:
            pids.append(int(entry.name))
    return pids


class Cluster:
    """A head without CPUs and named worker nodes of one CPU each."""

    def __init__(self, root: Path) -> None:
        self.root = root
        token = root / "token"
        token.write_text(secrets.token_hex(32))
        token.chmod(0o600)
        self.env = {**os.environ, **FAST_DEATH, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token),
                    "RAY_USAGE_STATS_ENABLED": "0", "RAY_enable_metrics_collection": "0"}
        # RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 is set while this session's local Ray instance (the
        # `ray_session` fixture) is up, and would make every `ray start` of a worker node refuse
        for name in ("RAY_ADDRESS", "RESLAB_STORAGE", "RESLAB_SCRATCH", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"):
            self.env.pop(name, None)
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.sessions: dict[str, int] = {}
        self.code: Path = root  # the driver's reslab and node b's (set by the fixture)
        self.stale: Path = root

    def _start(self, name: str, args: list[str], env: dict[str, str]) -> None:
        # `ray start` daemonizes the node's processes; they stay in the session it leads (its pid)
        proc = subprocess.Popen(
            [str(BIN / "ray"), "start", "--temp-dir", str(self.root / name), "--node-ip-address", "127.0.0.1",
             "--dashboard-agent-listen-port", str(free_port()), *args],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
        )
        self.sessions[name] = proc.pid
        out, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0, f"ray start ({name}) failed:\n{out}"

    def head(self) -> None:
        self._start("head", ["--head", "--port", str(self.port), "--num-cpus", "0", "--include-dashboard", "false",
                             "--dashboard-port", str(free_port()), "--ray-client-server-port", str(free_port())],
                    self.env)

    def node(self, name: str, **env: str) -> None:
        self._start(name, ["--address", self.address, "--num-cpus", "1"],
                    {**self.env, "RESLAB_SCRATCH": str(self.root / f"scratch-{name}"), **env})

    def kill(self, name: str) -> None:
        """SIGKILL every process of a node, as a host losing power."""
        for pid in _session_pids(self.sessions.pop(name)):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def stop(self) -> None:
        for name in list(self.sessions):
            self.kill(name)

    def reslab_run(self, spec: Path, workspace: Path, *args: str, timeout: float = 180,
                   **env: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [str(BIN / "reslab"), "run", str(spec), "--workspace", str(workspace), "--address", self.address,
             "--max-concurrent", "2", *args],
            env={**self.env, **env}, capture_output=True, text=True, timeout=timeout,
        )


@pytest.fixture(scope="module")
def cluster():
    """Head, node `a` and node `b`. The driver and node `a` import a frozen copy of this reslab
    (their PYTHONPATH; a regular package there wins over the editable install), so the test does
    not depend on the working tree staying unedited while it runs; node `b` imports the same copy
    with a modified models/training.py, as a host with an old checkout would. Socket paths under a
    Ray temp dir must stay short, hence a temp dir under /tmp rather than pytest's."""
    root = Path(tempfile.mkdtemp(prefix="rl-mn-", dir="/tmp"))
    c = Cluster(root)
    c.code = stage_code(root / "code")
    c.stale = Path(shutil.copytree(c.code, root / "stale" / "reslab"))
    with (c.stale / "models" / "training.py").open("a") as f:
        f.write("\nSTALE_NODE = True  # this node's checkout differs from the driver's\n")
    c.env["PYTHONPATH"] = str(c.code.parent)
    try:
        c.head()
        c.node("a")
        c.node("b", PYTHONPATH=str(c.stale.parent))
        yield c
    finally:
        c.stop()
        shutil.rmtree(root, ignore_errors=True)


def _runs(spec: Path) -> list:
    return expand(load_study(spec))


def _workspace(path: Path, mlflow_db_template: Path) -> Path:
    path.mkdir()
    shutil.copy(mlflow_db_template, path / "mlflow.db")
    return path


def test_stale_code_is_refused_and_shipped_code_replaces_it(tmp_path, cluster, mlflow_db_template):
    driver = code_fingerprint({name: cluster.code / name for name in SUBPACKAGES})
    stale = code_fingerprint({name: cluster.stale / name for name in SUBPACKAGES})
    assert [f for f in driver["files"] if driver["files"][f] != stale["files"][f]] == ["models/training.py"]

    # Off: each node imports its own reslab; node b's differs, so its run fails at once, not retried.
    spec = write_study(tmp_path, name="stale", text=STUDY.format(name="stale", steps=12, every=6, seeds=2))
    ws = _workspace(tmp_path / "ws-off", mlflow_db_template)
    out = cluster.reslab_run(spec, ws, "--ship-code", "off", "--retries", "1")
    assert out.returncode == 1, out.stdout + out.stderr
    records = [RunDir(ws / "runs" / "stale" / r.run_id) for r in _runs(spec)]
    assert sorted(rd.state() for rd in records) == sorted([FAILED, SUCCESS]), out.stdout
    for rd in records:
        if rd.state() == SUCCESS:
            assert rd.env()["code_fingerprint"] == driver["digest"]
            continue
        status = rd.status()
        assert status["error"].startswith(f"StaleCode: node {socket.gethostname()} imports reslab code that differs "
                                          f"from the driver's in models/training.py (imported from {cluster.stale});")
        assert status["retryable"] is False and status["attempts"] == 1
        assert rd.env()["code_fingerprint"] == stale["digest"]  # the worker's own, recorded
        assert f"FAILED {rd.path.name}: StaleCode: node" in out.stdout

    # On: node b trains with the driver's code (both runs in flight at once: one per node).
    ws = _workspace(tmp_path / "ws-on", mlflow_db_template)
    out = cluster.reslab_run(spec, ws, "--ship-code", "on")
    assert out.returncode == 0, out.stdout + out.stderr
    records = [RunDir(ws / "runs" / "stale" / r.run_id) for r in _runs(spec)]
    assert [rd.state() for rd in records] == [SUCCESS, SUCCESS]
    # node b unpacked the shipped package; both runs imported it, and it is the driver's code
    shipped = list((cluster.root / "b").glob("session_latest/runtime_resources/py_modules_files/*/reslab"))
    assert len(shipped) == 1, shipped
    digest = code_fingerprint({name: shipped[0] / name for name in SUBPACKAGES})["digest"]
    assert {rd.env()["code_fingerprint"] for rd in records} == {digest}
    assert digest == driver["digest"]


def test_a_lost_node_s_run_resumes_on_the_other_node_from_its_checkpoint(tmp_path, cluster, mlflow_db_template):
    """Run storage on a path the nodes share (an object store in production), scratch per node:
    the node training the run is killed whole after its first checkpoint reached storage; the driver
    retries the run, the other node pulls it and resumes from that checkpoint. Runs last in this
    module: it leaves one worker node."""
    spec = write_study(tmp_path, name="loss", text=STUDY.format(name="loss", steps=400, every=40, seeds=1))
    (run,) = _runs(spec)
    ws = _workspace(tmp_path / "ws", mlflow_db_template)
    stored = tmp_path / "storage" / "runs" / "loss" / run.run_id
    env = {**cluster.env, "RESLAB_STORAGE": str(tmp_path / "storage")}
    driver = subprocess.Popen(
        [str(BIN / "reslab"), "run", str(spec), "--workspace", str(ws), "--address", cluster.address,
         "--ship-code", "on", "--retries", "1"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        deadline, status = time.time() + 120, {}
        while time.time() < deadline and driver.poll() is None:
            with contextlib.suppress(OSError, ValueError):
                status = json.loads((stored / "status").read_text())
            if status.get("checkpoint_step") and (stored / "checkpoint.pt").is_file():
                break
            time.sleep(0.02)
        assert status.get("state") == "RUNNING" and status.get("checkpoint_step"), f"no checkpoint in storage: {status}"
        (victim,) = [n for n in ("a", "b") if (cluster.root / f"scratch-{n}" / "loss" / run.run_id).is_dir()]
        cluster.kill(victim)
        out, _ = driver.communicate(timeout=240)
    finally:
        if driver.poll() is None:
            driver.kill()
    survivor = "b" if victim == "a" else "a"
    # the driver survived the node loss and retried the run elsewhere
    assert driver.returncode == 0, out
    assert f"retry {run.label} (attempt 2) after:" in out
    rd = RunDir(ws / "runs" / "loss" / run.run_id)  # the driver's records, pulled from storage
    assert rd.state() == SUCCESS and rd.status()["attempts"] == 2
    resumed = [line for line in rd.log_file.read_text().splitlines() if " resumed from " in line]
    assert len(resumed) == 1 and f"scratch-{survivor}/loss/{run.run_id}/checkpoint.pt" in resumed[0], resumed
    start_step = int(resumed[0].rpartition(" at step ")[2].split()[0])
    assert start_step >= status["checkpoint_step"] > 0 and start_step % 40 == 0
    assert [r["step"] for r in rd.metrics() if r["kind"] == "train"] == list(range(1, 401))
    assert [d["step"] for d in rd.diagnostics()] == list(range(40, 401, 40))
    # one MLflow child per run id, finished, with every metric step once and every eval's diagnostics
    client = import_mlflow()(tracking_uri=f"sqlite:///{ws / 'mlflow.db'}")
    exp = client.get_experiment_by_name("loss")
    kids = client.search_runs([exp.experiment_id], filter_string="tags.reslab_kind = 'run'")
    assert [(k.data.tags["run_id"], k.info.status) for k in kids] == [(run.run_id, "FINISHED")]
    assert kids[0].data.tags["attempt"] == "2"
    assert [m.step for m in client.get_metric_history(kids[0].info.run_id, "train_loss")] == list(range(1, 401))
    logged = {a.path for a in client.list_artifacts(kids[0].info.run_id, "diagnostics")}
    assert {f"diagnostics/step_{s:06d}.json" for s in range(40, 401, 40)} <= logged


class _SinkKiller(RayBackend):
    """The real backend, whose progress actor's process is killed once the first events arrived,
    for good (`no_restart`: what losing its node would do to an unpinned actor) or to be restarted
    by Ray (a crash), at a point the test picks."""

    killed = False
    no_restart = True

    def poll(self, timeout: float):
        events, done = super().poll(timeout)
        if events and not self.killed:
            import ray

            ray.kill(self.sink, no_restart=self.no_restart)
            self.killed = True
        return events, done


@pytest.mark.parametrize("no_restart", [True, False], ids=["replaced", "restarted"])
def test_the_driver_survives_losing_its_progress_actor(tmp_path, workspace, ray_session, no_restart):
    spec = write_study(tmp_path, name="sinkless", text=STUDY.format(name="sinkless", steps=30, every=6, seeds=4))
    study = load_study(spec)
    runs = expand(study)
    backend = _SinkKiller(workspace=workspace.root)
    backend.no_restart = no_restart
    out = io.StringIO()
    result = submit(study, runs, workspace, backend, GuardedTracker(workspace.default_tracking_uri(), workspace),
                    ExecutionOptions(max_concurrent=2), stream=out, say=lambda *_: None)
    assert backend.killed and result.ok and result.count("succeeded") == 4, out.getvalue()
    # runs submitted after the loss reported progress to the new actor (some eval of theirs: the last one's event
    # may still be on its way when the run's task returns, and the driver then reads its summary instead)
    assert re.search(rf"{re.escape(runs[-1].label)} step \d+/30 ", out.getvalue()), out.getvalue()
    # events lost with the old actor came back from the run records: every step and eval in MLflow
    client = import_mlflow()(tracking_uri=workspace.default_tracking_uri())
    exp = client.get_experiment_by_name("sinkless")
    kids = client.search_runs([exp.experiment_id], filter_string="tags.reslab_kind = 'run'")
    assert sorted(k.data.tags["run_id"] for k in kids) == sorted(r.run_id for r in runs)
    for kid in kids:
        assert kid.info.status == "FINISHED"
        assert [m.step for m in client.get_metric_history(kid.info.run_id, "train_loss")] == list(range(1, 31))
        assert [m.step for m in client.get_metric_history(kid.info.run_id, "val_loss")] == list(range(6, 31, 6))
        logged = {a.path for a in client.list_artifacts(kid.info.run_id, "diagnostics")}
        assert {f"diagnostics/step_{s:06d}.json" for s in range(6, 31, 6)} <= logged


class _BrokenDriver(RayBackend):
    """The real backend, made to fail in the driver's loop once runs reported progress: stands in
    for any driver bug or backend failure the loop does not handle."""

    reported = False

    def poll(self, timeout: float):
        if self.reported:
            raise RuntimeError("injected driver failure")
        events, done = super().poll(timeout)
        self.reported = bool(events)
        return events, done


def test_a_failing_driver_leaves_no_mlflow_child_running(tmp_path, workspace, ray_session):
    spec = write_study(tmp_path, name="broken", text=STUDY.format(name="broken", steps=200, every=50, seeds=2))
    study = load_study(spec)
    tracker = GuardedTracker(workspace.default_tracking_uri(), workspace)
    backend = _BrokenDriver(workspace=workspace.root)
    with pytest.raises(RuntimeError, match="injected driver failure"):
        submit(study, expand(study), workspace, backend, tracker, ExecutionOptions(max_concurrent=2),
               stream=io.StringIO(), say=lambda *_: None)
    backend.cancel()  # the shared Ray session outlives the driver: stop its runs for the next tests
    client = import_mlflow()(tracking_uri=workspace.default_tracking_uri())
    exp = client.get_experiment_by_name("broken")
    kids = client.search_runs([exp.experiment_id], filter_string="tags.reslab_kind = 'run'")
    assert kids and {k.info.status for k in kids} == {"KILLED"}
