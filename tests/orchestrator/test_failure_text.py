"""Ray's out-of-memory report in one line (issue 52, item 10): each OOM-killed run put Ray's ~45-line report into
the driver's lines twice and into `compare`/`status`. The report here is put together from the format strings of
ray 2.60's raylet (`strings .../ray/core/src/ray/raylet/raylet`: "%d worker(s) were killed due to the node running
low on memory. %s", "Memory on the node (IP: %s, ID: %s) was %sGB used / %sGB limit (%f)", "Top 10 memory users:
%s", ...), filled as a killed reslab run's was."""

from __future__ import annotations

import ray
from orch_helpers import write_study

from reslab.orchestrator.dispatch import failure_text

NODE = "4f1a7c2e9b0d41f5a3c8e6b7d2f9a1c0e5b8d3f7a6c9e2b1d4f8a7c3"
TOP = "\n".join(f"{2000 + i}\t{5.2 - 0.4 * i:.2f}\tray::_run_task" for i in range(10))
CONSIDERED = "".join(
    f"(Worker with lease granted: job ID=01000000, lease ID=0{i}00000000, task name=reslab:tiny:attnres/s{i}, "
    f"required resources={{CPU: 1}}, pid={2000 + i}, actual memory used=5.{i}0GB, worker ID=9a{i}f)\n"
    for i in range(2))
RAY_OOM = (
    f"2 worker(s) were killed due to the node running low on memory. Memory on the node (IP: 10.0.0.5, ID: {NODE}) "
    "was 21.70GB used / 23.50GB limit (0.923404)\n"
    "OOM kill reason: memory usage above the threshold 0.95\n"
    "Object store memory usage: [used 0.01GB of 0.27GB]\n"
    "Ray killed 2 worker(s) based on the killing policy\n"
    f"Considered workers: [\n{CONSIDERED}]\n"
    "Total non-selected idle workers: 1\n"
    "Total non-selected idle workers USS bytes: 0.31GB\n"
    "To see more information about memory usage on this node, use `ray logs raylet.out -ip 10.0.0.5`\n"
    f"Top 10 memory users: \nPID\tMEM(GB)\tCOMMAND\n{TOP}\n"
    "Refer to the documentation on how to address the out of memory issue: "
    "https://docs.ray.io/en/latest/ray-observability/user-guides/debug-apps/debug-memory.html. Consider provisioning "
    "more memory on this node or reducing task parallelism by requesting more CPUs per task. To adjust the kill "
    "threshold, set the environment variable `RAY_memory_usage_threshold` when starting Ray. To disable worker "
    "killing, set the environment variable `RAY_memory_monitor_refresh_ms` to zero.\n"
)


def test_rays_oom_report_is_one_line_with_what_was_decided(tmp_path):
    assert RAY_OOM.count("\n") > 20
    line = failure_text.one_line(RAY_OOM, tmp_path / "r.txt")
    assert line == f"out of memory: 2 workers killed by Ray on 10.0.0.5 (21.7/23.5 GB used); Ray's full report: " \
                   f"{tmp_path / 'r.txt'}"
    assert failure_text.one_line("short\n") == "short"
    assert failure_text.one_line("first\n" + "x\n" * 40, tmp_path / "r.txt").startswith("first; Ray's full report:")


def test_an_oom_killed_task_fails_with_one_line_and_its_report_in_the_run_folder(tmp_path):
    """What `RayBackend.poll` records for a task Ray killed: its `Completion.error`, which the status file, MLflow,
    the driver's lines and `compare`/`status` show."""
    from reslab.experiments import expand, load_study
    from reslab.orchestrator.dispatch.ray_backend import _failure
    from reslab.orchestrator.tasks import RunTask

    run = expand(load_study(write_study(tmp_path, steps=2)))[0]
    run_dir = tmp_path / run.run_id
    run_dir.mkdir()
    task = RunTask(run=run, run_dir=str(run_dir), submission="s", attempt=2)
    error = _failure(ray.exceptions.OutOfMemoryError(RAY_OOM), task)
    report = run_dir / "ray_error.attempt2.txt"
    assert error == f"out of memory: 2 workers killed by Ray on 10.0.0.5 (21.7/23.5 GB used); Ray's full report: " \
                    f"{report}"
    assert report.read_text() == f"out of memory: {RAY_OOM}"
    # no run folder on this machine (a cluster's node had it): the line alone
    elsewhere = RunTask(run=run, run_dir=str(tmp_path / "gone"), submission="s")
    assert _failure(ray.exceptions.OutOfMemoryError(RAY_OOM), elsewhere) == ("out of memory: 2 workers killed by "
                                                                              "Ray on 10.0.0.5 (21.7/23.5 GB used)")
