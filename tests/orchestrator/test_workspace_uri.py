"""A workspace path with URI syntax in it (issue 35, item 11): `?`, `#`, `%`, a space and non-ASCII letters are
parts of the file name, so the SQLite MLflow store is the workspace's own `mlflow.db`, not a sibling file the
unquoted URI named (`ws_q?x=1` sent it to `ws_q`; `%41` read as `A`), nothing else is created beside it (MLflow
makes a quoted path's folder as written: `store_uri`), and a study tracked there is read back from it."""

from __future__ import annotations

import io
import shutil
import sqlite3

import pytest
from orch_helpers import write_study

from reslab.experiments import expand, load_study
from reslab.orchestrator.cli import main
from reslab.orchestrator.dispatch.local_backend import LocalBackend
from reslab.orchestrator.driving.submit import ExecutionOptions, submit
from reslab.orchestrator.durability.workspace import Workspace
from reslab.orchestrator.tracking.guarded import GuardedTracker
from reslab.orchestrator.tracking.store import import_mlflow, sqlite_file, store_uri

NAMES = ["ws_q?x=1", "ws#frag", "ws%41pct", "ws with space", "ws_été_日本"]


@pytest.mark.parametrize("name", NAMES)
def test_the_store_is_the_workspace_file_whatever_its_name(tmp_path, mlflow_db_template, name):
    ws = Workspace(tmp_path / name)
    ws.root.mkdir()
    shutil.copy(mlflow_db_template, ws.mlflow_db)
    uri = ws.default_tracking_uri()
    assert sqlite_file(uri) == sqlite_file(store_uri(uri)) == ws.mlflow_db
    import_mlflow()(tracking_uri=store_uri(uri)).create_experiment("probe")
    assert [p.name for p in tmp_path.iterdir()] == [name]  # no sibling store
    with sqlite3.connect(ws.mlflow_db) as con:
        assert ("probe",) in con.execute("SELECT name FROM experiments").fetchall()


@pytest.mark.slow  # trains four tiny runs, creates a store and gathers: 15-45 s on 2 shared cores
def test_a_study_in_a_workspace_named_like_a_uri_is_tracked_and_read_back(tmp_path, capsys):
    """Every awkward character at once, end to end: the study trains and is tracked in the workspace's store
    (created fresh), then `compare` and `status` read it from there."""
    spec = write_study(tmp_path, steps=3)
    ws = Workspace(tmp_path / "ws_q?x=1 #%41 été")
    study = load_study(spec)
    runs = expand(study)
    ws.root.mkdir()
    tracker = GuardedTracker(ws.default_tracking_uri(), ws)
    result = submit(study, runs, ws, LocalBackend(), tracker, ExecutionOptions(retries=0), stream=io.StringIO(),
                    say=lambda line: None)
    assert result.ok and len(result.runs) == 4
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([spec.name, ws.root.name])
    assert ws.mlflow_db.is_file()

    assert main(["compare", str(spec), "--workspace", str(ws.root)]) == 0
    out = capsys.readouterr().out
    assert "main" in out and "no MLflow store" not in out
    assert main(["status", str(spec), "--workspace", str(ws.root)]) == 0
    assert "tiny: 4 runs: 4 succeeded" in capsys.readouterr().out
