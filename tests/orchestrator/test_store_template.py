"""A new workspace's SQLite store comes from a cached copy of MLflow's empty schema
(`tracking.template`): the copy is the store MLflow builds, its Default experiment is the
workspace's, and a template that is damaged, or that MLflow refuses, never costs a store.

Real MLflow stores throughout (MLflow's own migrations build the reference); the cache is a
temporary `$RESLAB_CACHE`.
"""

from __future__ import annotations

import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from reslab.orchestrator.durability.workspace import Workspace
from reslab.orchestrator.tracking.guarded import GuardedTracker
from reslab.orchestrator.tracking.store import TrackingUnavailable
from reslab.orchestrator.tracking.template import template_path


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("RESLAB_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def open_workspace(root: Path) -> GuardedTracker:
    workspace = Workspace.at(root)
    workspace.root.mkdir(parents=True, exist_ok=True)
    return GuardedTracker(workspace.tracking_uri(), workspace)


def schema(db: Path) -> list[tuple]:
    with sqlite3.connect(db) as con:
        return sorted(con.execute("SELECT type, name, sql FROM sqlite_master"))


def rows(db: Path, sql: str) -> list[tuple]:
    with sqlite3.connect(db) as con:
        return con.execute(sql).fetchall()


def test_a_second_workspace_starts_from_the_first_ones_empty_store(tmp_path, cache):
    first = open_workspace(tmp_path / "a")
    first.writer.client.create_experiment("written-after-the-template")  # must not reach the template
    assert template_path().is_file()
    assert rows(template_path(), "SELECT name FROM experiments") == [("Default",)]

    before = int(time.time() * 1000)
    second = open_workspace(tmp_path / "b")
    db_a, db_b = tmp_path / "a" / "mlflow.db", tmp_path / "b" / "mlflow.db"
    assert schema(db_b) == schema(db_a)  # the schema MLflow's migrations built
    assert rows(db_b, "SELECT * FROM alembic_version") == rows(db_a, "SELECT * FROM alembic_version")
    (default,) = rows(db_b, "SELECT experiment_id, name, artifact_location, creation_time FROM experiments")
    assert default[:3] == (0, "Default", f"{(tmp_path / 'b' / 'mlartifacts').as_uri()}/Default")
    assert default[3] >= before
    # the first workspace's Default is its own too (made by MLflow, then owned the same way)
    assert rows(db_a, "SELECT artifact_location FROM experiments WHERE experiment_id = 0") == [
        (f"{(tmp_path / 'a' / 'mlartifacts').as_uri()}/Default",)]
    # and MLflow writes to the copy as to any store
    experiment = second.writer.client.create_experiment("study")
    run = second.writer.client.create_run(experiment)
    second.writer.client.log_metric(run.info.run_id, "val_loss", 1.5, step=3)
    assert [m.value for m in second.writer.client.get_metric_history(run.info.run_id, "val_loss")] == [1.5]


def test_a_damaged_template_is_rebuilt_and_costs_no_store(tmp_path, cache):
    template = template_path()
    template.parent.mkdir(parents=True)
    template.write_bytes(b"not a database" * 100)
    tracker = open_workspace(tmp_path / "ws")
    assert tracker.writer.client.search_experiments()[0].name == "Default"
    assert rows(template, "SELECT name FROM experiments") == [("Default",)]  # replaced by MLflow's


@pytest.mark.slow  # ~9 s: MLflow builds a fresh store from its migrations after the refused copy
def test_a_template_mlflow_refuses_is_removed_with_the_copy(tmp_path, cache):
    open_workspace(tmp_path / "first")
    template = template_path()
    with sqlite3.connect(template) as con:  # intact SQLite, MLflow's tables, a revision MLflow never had
        con.execute("UPDATE alembic_version SET version_num = 'feedfacecafe'")
    with pytest.raises(TrackingUnavailable, match="copied from the template") as err:
        open_workspace(tmp_path / "ws")
    assert "run the command again" in str(err.value)
    assert not (tmp_path / "ws" / "mlflow.db").exists() and not template.exists()
    # "again" is a new process, as the CLI's next command is (this one's MLflow keeps its engine)
    again = ("from reslab.orchestrator.durability.workspace import Workspace; "
             "from reslab.orchestrator.tracking.guarded import GuardedTracker; "
             f"w = Workspace.at({str(tmp_path / 'ws')!r}); "
             "print(GuardedTracker(w.tracking_uri(), w).writer.client.search_experiments()[0].name)")
    done = subprocess.run([sys.executable, "-c", again], capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "Default", done.stderr
    assert rows(template, "SELECT version_num FROM alembic_version") != [("feedfacecafe",)]
