"""Readers that survive bad state, and divergence recorded where the user looks.

A damaged file costs its own run (or its own line), is named with what to do, never blocks the
study; read commands write nothing and serve a read-only workspace.
"""

from __future__ import annotations

import io
import logging
import os
import shlex
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from orch_helpers import TINY_STUDY

from reslab.experiments import expand, load_study
from reslab.models.checkpoint import CHECKPOINT_NAME
from reslab.orchestrator.cli import main
from reslab.orchestrator.dispatch.local_backend import LocalBackend
from reslab.orchestrator.driving.submit import ExecutionOptions, submit
from reslab.orchestrator.durability.workspace import Workspace
from reslab.orchestrator.tasks import FAILED, SUCCESS
from reslab.orchestrator.tracking.guarded import GuardedTracker

ROOT = Path(__file__).resolve().parents[2]
HOT_STUDY = TINY_STUDY.replace("  attnres: {{residual: attnres}}", "  hot: {{residual: prenorm, optim: {{lr: 5.0}}}}") \
    .replace("treatments: [attnres]", "treatments: [hot]")


def write(tmp_path: Path, name: str, text: str = TINY_STUDY, steps: int = 6) -> Path:
    path = tmp_path / f"{name}.yaml"
    path.write_text(textwrap.dedent(text.format(name=name, steps=steps)))
    return path


def run_study(path: Path, ws: Workspace, **options):
    study = load_study(path)
    runs = expand(study)
    result = submit(study, runs, ws, LocalBackend(), GuardedTracker(ws.default_tracking_uri(), ws),
                    ExecutionOptions(**options), stream=io.StringIO(), say=lambda *_: None)
    return runs, result


def test_lr_5_ends_failed_as_diverged_and_status_and_compare_say_why(tmp_path, workspace, capsys):
    path = write(tmp_path, "hot", HOT_STUDY)
    runs, result = run_study(path, workspace, retries=2)
    hot = [r for r in runs if r.arm == "hot"]
    assert {result.states[r.run_id] for r in hot} == {"failed"}
    assert {result.states[r.run_id] for r in runs if r.arm == "control"} == {"succeeded"}
    for r in hot:
        status = workspace.run_dir("hot", r.run_id).status()
        assert status["state"] == FAILED and status["retryable"] is False and status["attempts"] == 1
        assert status["error"].startswith("TrainingDiverged: val_loss") and "initial loss" in status["error"]

    capsys.readouterr()
    ws = ["--workspace", str(workspace.root)]
    assert main(["status", str(path), *ws]) == 0
    out = capsys.readouterr().out
    assert out.count("failed: TrainingDiverged: val_loss") == 2
    assert main(["compare", str(path), *ws]) == 0
    out = capsys.readouterr().out
    assert "2/4 runs finished" in out
    for r in hot:
        assert f"FAILED hot/-/s{r.seed} {r.run_id}: TrainingDiverged: val_loss" in out
    assert "incomplete: seeds" in out


def corrupt_metrics(ws: Workspace, study: str, run_id: str) -> Path:
    path = ws.run_dir(study, run_id).metrics_file
    lines = path.read_bytes().splitlines(keepends=True)
    lines[1] = b'{"kind": "train", "step": 2, "train_loss": 4.\xff}\n'  # a bad byte
    lines[2] = b'[1, 2, 3]\n'  # valid JSON, wrong shape
    lines[3] = b'{"kind": "train", "step": "x", "time": 1}\n'  # wrong types
    path.write_bytes(b"".join(lines))
    return path


def test_a_corrupt_metrics_line_costs_that_line_and_is_named(tmp_path, workspace, capsys, caplog):
    path = write(tmp_path, "tiny")
    runs, _ = run_study(path, workspace)
    bad = corrupt_metrics(workspace, "tiny", runs[0].run_id)
    capsys.readouterr()
    with caplog.at_level(logging.WARNING):
        assert main(["status", str(path), "--workspace", str(workspace.root)]) == 0
    assert capsys.readouterr().out.count("succeeded") >= 4
    named = [r.getMessage() for r in caplog.records if str(bad) in r.getMessage()]
    assert any("line 2 is not valid JSON text" in m for m in named)
    assert any("line 3 is a row of the wrong shape" in m for m in named)
    assert any("line 4 is a row of the wrong shape" in m for m in named)
    assert len(workspace.run_dir("tiny", runs[0].run_id).metrics()) == len(
        workspace.run_dir("tiny", runs[1].run_id).metrics()) - 3

    # a run resumed over a damaged file finishes; it keeps its good rows and drops the bad ones
    interrupted = workspace.run_dir("tiny", runs[1].run_id)
    corrupt_metrics(workspace, "tiny", runs[1].run_id)
    interrupted.set_status("INTERRUPTED", checkpoint_step=6)
    interrupted.summary_file.unlink()
    _, result = run_study(path, workspace)
    assert result.states[runs[1].run_id] == "succeeded" and not result.errors
    assert [r["step"] for r in interrupted.metrics() if r["kind"] == "train"] == [1, 4, 5, 6]
    assert b"\xff" not in interrupted.metrics_file.read_bytes()


def test_a_corrupt_checkpoint_fails_only_its_run_naming_the_file_without_retries(tmp_path, workspace):
    path = write(tmp_path, "tiny")
    runs = expand(load_study(path))
    rd = workspace.run_dir("tiny", runs[0].run_id)
    rd.path.mkdir(parents=True)
    (rd.path / CHECKPOINT_NAME).write_bytes(b"PK\x03\x04 not really a zip")
    _, result = run_study(path, workspace, retries=3)
    assert result.count("succeeded") == 3
    error = result.errors[runs[0].run_id]
    assert error.startswith(f"CheckpointUnreadable: {rd.path / CHECKPOINT_NAME} cannot be loaded")
    assert "move it away" in error
    assert rd.status()["attempts"] == 1 and rd.status()["retryable"] is False


def test_a_corrupt_mlflow_db_or_cache_is_one_line_naming_the_file(tmp_path, workspace, capsys):
    path = write(tmp_path, "tiny")
    run_study(path, workspace)
    ws = ["--workspace", str(workspace.root)]
    assert main(["run", str(path), *ws]) == 0  # nothing to run; writes the comparison cache
    cache = workspace.cache / "tiny.parquet"
    assert cache.is_file()
    cache.write_bytes(b"PAR1 garbage")
    capsys.readouterr()
    assert main(["compare", str(path), *ws, "--cached"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and str(cache) in err and "delete it" in err

    workspace.mlflow_db.write_bytes(b"this is not a database" * 100)
    for command in (["compare", str(path), *ws], ["run", str(path), *ws]):
        assert main(command) == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0, err
        assert str(workspace.mlflow_db) in err and "move it away" in err


def snapshot(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_mtime_ns for p in sorted(root.rglob("*"))}


def test_read_commands_write_nothing(tmp_path, workspace, capsys):
    path = write(tmp_path, "tiny")
    run_study(path, workspace)
    ws = ["--workspace", str(workspace.root)]
    before = snapshot(workspace.root)
    for command in (["status", str(path)], ["plan", str(path)], ["compare", str(path)],
                    ["export", str(path), "--format", "csv", "-o", str(tmp_path / "out.csv")]):
        assert main([*command, *ws]) == 0, capsys.readouterr().err
    assert snapshot(workspace.root) == before
    empty = tmp_path / "never-ran"
    for command in (["status", str(path)], ["plan", str(path)]):
        assert main([*command, "--workspace", str(empty)]) == 0
    assert main(["compare", str(path), "--workspace", str(empty)]) == 2
    assert not empty.exists()


@pytest.mark.slow  # a Python subprocess in a mount namespace: torch and MLflow imported again, ~8 s
def test_a_read_only_workspace_still_serves_the_read_commands(tmp_path, workspace):
    """The workspace is mounted read-only in a private mount namespace (`unshare`), so the check
    holds even for root, who ignores file modes."""
    if shutil.which("unshare") is None or subprocess.run(["unshare", "-rm", "true"]).returncode != 0:
        pytest.skip("needs unshare with user namespaces to mount the workspace read-only")
    path = write(tmp_path, "tiny")
    run_study(path, workspace)
    out = tmp_path / "out"
    out.mkdir()
    ws = ["--workspace", str(workspace.root)]
    commands = [["status", str(path), *ws], ["plan", str(path), *ws], ["compare", str(path), *ws],
                ["export", str(path), *ws, "--format", "md", "-o", str(out / "table.md")]]
    code = ("import sys; from reslab.orchestrator.cli import main; "
            f"sys.exit(max(main(c) for c in {commands!r}))")
    script = " && ".join([
        f"mount --bind -o ro {workspace.root} {workspace.root}",
        f"! touch {workspace.root}/probe 2>/dev/null",
        f"{sys.executable} -c {shlex.quote(code)}",
    ])
    proc = subprocess.run(["unshare", "-rm", "sh", "-c", script], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    assert "4 succeeded" in proc.stdout and (out / "table.md").is_file()
    assert all(workspace.run_dir("tiny", r.run_id).state() == SUCCESS for r in expand(load_study(path)))
