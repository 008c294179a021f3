"""Ray's own start-up failing under `reslab run`: one line saying what to do, exit 2, never Ray's traceback.

`ray.init` is made to fail the way it does on a loaded machine (its node start-up deadline passes: a bare
`Exception` with pages of log lines after it, or a `TimeoutError`); starting a real Ray under such load
cannot be staged on demand.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
import ray
from orch_helpers import free_port, write_study

from reslab.orchestrator.cli import main
from reslab.orchestrator.dispatch.ray_backend import START_ATTEMPTS, _first_line

RAY_TIMEOUT = Exception(
    "The current node timed out during startup. This could happen because some of the raylet failed to startup or "
    "the GCS has become overloaded.\n" + "\n".join(f"  raylet.err line {i}" for i in range(25)))


@pytest.mark.parametrize("error", [RAY_TIMEOUT, TimeoutError("Timed out after 30 seconds while waiting for node to "
                                                              "startup.")])
def test_ray_start_up_timing_out_is_one_line_and_exit_2(tmp_path, capsys, monkeypatch, error):
    calls = []

    def init(*args, **kwargs):
        calls.append(kwargs)
        raise error

    shutdowns = []
    monkeypatch.setattr(ray, "init", init)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)  # a Ray session of another test stays unused
    monkeypatch.setattr(ray, "shutdown", lambda: shutdowns.append(1))  # and is not shut down between the tries
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    spec = write_study(tmp_path, steps=2)
    code = main(["run", str(spec), "--workspace", str(tmp_path / "ws")])
    assert not shutdowns
    *retries, err = capsys.readouterr().err.splitlines()
    # issue 52, item 2: tried START_ATTEMPTS times, each retry said in one line
    assert len(calls) == START_ATTEMPTS and len(retries) == START_ATTEMPTS - 1, retries
    first = _first_line(error)
    assert retries == [f"reslab: the local Ray instance did not start ({first}); trying again ({n} of "
                       f"{START_ATTEMPTS})" for n in range(2, START_ATTEMPTS + 1)]
    assert code == 2 and err.startswith("reslab: error: could not start a local Ray instance: "), err
    assert "timed out" in err.lower() and "run the command again once the load is lower" in err, err
    assert "raylet.err" not in err and "Traceback" not in err and ".;" not in err
    # the raylet does not wait for the metrics export port's file, written late by a slow dashboard agent
    assert all(kw["include_dashboard"] is False and kw["_metrics_export_port"] > 0 for kw in calls)


def test_a_push_task_goes_to_the_node_that_holds_the_copy(tmp_path, monkeypatch):
    """The driver has the node a run finished on push its copy (`RunTask.push_from`): the Ray node the attempt
    ran on, else a live node on its host (restarted there, same disk); none alive: the task completes at once
    with an error naming the node, and the driver falls back to its own copy."""
    from reslab.experiments import expand, load_study
    from reslab.orchestrator.dispatch import ray_backend
    from reslab.orchestrator.tasks import Node, Resources, RunTask

    nodes = [{"NodeID": "n-old", "Alive": False, "NodeManagerHostname": "gpu-3"},
             {"NodeID": "n-new", "Alive": True, "NodeManagerHostname": "gpu-3"},
             {"NodeID": "n-other", "Alive": True, "NodeManagerHostname": "gpu-4"}]
    monkeypatch.setattr(ray, "nodes", lambda: nodes)
    assert ray_backend._node_of(Node("n-other", "gpu-4")) == "n-other"
    assert ray_backend._node_of(Node("n-old", "gpu-3")) == "n-new"  # restarted on its host
    assert ray_backend._node_of(Node("n-gone", "gpu-9")) is None

    run = expand(load_study(write_study(tmp_path, steps=2)))[0]
    task = RunTask(run=run, run_dir=str(tmp_path / run.run_id), submission="s", push_from=Node("n-gone", "gpu-9"))
    backend = ray_backend.RayBackend("local", workspace=tmp_path)
    backend.submit(task, Resources(cpus=1, gpus=1))
    _, done = backend.poll(0)
    assert [c.task for c in done] == [task] and done[0].error == "the node that holds its copy (gpu-9, Ray node " \
                                                                   "n-gone) is gone"


class _Hung(Exception):
    pass


@contextlib.contextmanager
def _hang_guard(seconds: int):
    """A command that never returns fails the test instead of hanging the suite: SIGALRM interrupts the wait
    (a safety deadline only, far above the seconds the command takes)."""
    def hung(signum, frame):
        raise _Hung(f"the command did not return within {seconds}s")

    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def test_a_start_thread_that_cannot_start_is_one_line_not_a_hang(tmp_path, capsys, monkeypatch):
    """Issue 52 item 1: on a machine out of threads `Thread.start` raises "can't start new thread"; the command
    used to wait for ever in its `finally: backend.shutdown()` for a start that never began, the error swallowed."""
    real_start = threading.Thread.start

    def start(self):
        if self.name == "reslab-ray-start":
            raise RuntimeError("can't start new thread")
        real_start(self)

    monkeypatch.setattr(threading.Thread, "start", start)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    spec = write_study(tmp_path, steps=2)
    with _hang_guard(120):
        code = main(["run", str(spec), "--workspace", str(tmp_path / "ws")])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith("reslab: error: could not start a local Ray instance: can't start new thread "), err


def test_a_ray_init_that_blocks_ends_at_the_start_deadline(tmp_path, capsys, monkeypatch):
    """Issue 52 item 1: a `ray.init` that blocks instead of raising (seen live for 17 minutes) ends the command at
    `START_TIMEOUT_S` with one line, instead of a driver waiting with no output for ever."""
    from reslab.orchestrator.dispatch import ray_backend

    release = threading.Event()

    def init(*args, **kwargs):
        release.wait(300)
        raise RuntimeError("released by the test")

    monkeypatch.setattr(ray, "init", init)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray_backend, "START_TIMEOUT_S", 1.0, raising=False)  # absent before issue 52
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    spec = write_study(tmp_path, steps=2)
    try:
        with _hang_guard(120):
            code = main(["run", str(spec), "--workspace", str(tmp_path / "ws")])
    finally:
        release.set()
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith("reslab: error: could not start a local Ray instance: ray.init did not return within 1s"), err


def _processes_naming(text: str) -> list[int]:
    pids = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            with contextlib.suppress(OSError), open(f"/proc/{name}/cmdline", "rb") as f:
                if text.encode() in f.read():
                    pids.append(int(name))
    return pids


@pytest.mark.slow
def test_the_advice_after_a_failed_start_works_as_written(tmp_path):
    """Issue 52, item 2: the refusal advised `ray start --head` then `--address 127.0.0.1:6379`, which bound *:6379
    and was refused with InvalidAuthToken lines. The commands the refusal gives now, run as written (a free port for
    6379, and Ray's temp dir, by which its processes are found and killed at the end), start a head listening on
    127.0.0.1 only, and `reslab run` joins it and trains."""
    from test_listening_ports import is_loopback, listening_sockets, socket_inodes

    from reslab.orchestrator.dispatch import ray_backend
    from reslab.orchestrator.durability import reaper

    hint = ray_backend._start_hint(TimeoutError())
    head = re.search(r"`(RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 RAY_worker_niceness=0 ray start --head[^`]*)`",
                     hint).group(1)
    assert "run the command with RAY_AUTH_MODE=token in its environment and --address 127.0.0.1:6379" in hint, hint
    port, root = free_port(), Path(tempfile.mkdtemp(prefix="rs", dir="/tmp"))  # short: Ray's socket paths
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "RESLAB_", "MLFLOW_"))}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    try:
        for _ in range(3):  # as the advice says: Ray's raylet has a fixed 30 s to register (ray/_private/node.py)
            started = subprocess.run(["sh", "-c", f"{head.replace('6379', str(port))} --temp-dir {root}/ray "
                                                  "--disable-usage-stats"], env=env, capture_output=True, text=True,
                                     timeout=600)  # a safety net only: the CPU a start takes does not depend on load
            if "timed out during startup" not in started.stderr:
                break
            _kill_naming(str(root))  # what the failed start left, and only it: other Ray instances may be running
        assert started.returncode == 0, started.stderr[-2000:]
        sockets = listening_sockets()
        bound = {sockets[i] for pid in reaper.descendants(_processes_naming(str(root)))
                 for i in socket_inodes(pid) if i in sockets}
        as_v4 = {(str(getattr(ipaddress.ip_address(a), "ipv4_mapped", None) or a), p) for a, p in bound}
        assert ("127.0.0.1", port) in as_v4, bound
        assert all(is_loopback(address) for address, _ in bound), bound
        spec = write_study(tmp_path, steps=2)
        run = subprocess.run(["sh", "-c", f"RAY_AUTH_MODE=token reslab run {spec} --workspace {tmp_path / 'ws'} "
                                          f"--address 127.0.0.1:{port}"], env=env, capture_output=True, text=True,
                             timeout=1800, cwd=tmp_path)  # a safety net: at load 30 it took over 900 s
        assert run.returncode == 0, run.stderr[-3000:]
        assert "InvalidAuthToken" not in run.stderr, run.stderr[-3000:]
    finally:
        _kill_naming(str(root))
        shutil.rmtree(root, ignore_errors=True)


def _kill_naming(root: str) -> None:
    """Ends the processes whose command line names `root` (a Ray instance's temp dir) and their children."""
    from reslab.orchestrator.durability import reaper

    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in reaper.descendants(_processes_naming(root)):
            with contextlib.suppress(OSError):
                os.kill(pid, sig)
        time.sleep(2)
