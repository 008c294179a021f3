"""A run's MLflow child is looked up by id, not searched for by tag, once a submission has begun (issue 39: a search
per new child read every child of the experiment, O(N^2) for a study of N runs). Drivers sharing the workspace
still share children through the ledger beside the tracking lock; the real SQLite store throughout."""

from __future__ import annotations

import pytest
from orch_helpers import write_study

from reslab.experiments import expand, load_study
from reslab.orchestrator.attempt.envinfo import submission_code
from reslab.orchestrator.tracking import client as client_module
from reslab.orchestrator.tracking.writer import MlflowWriter


@pytest.fixture
def searches(monkeypatch):
    """Counts MLflow searches by tag (the real `search_all`, wrapped: every call still goes to the store)."""
    calls: list[str] = []
    real = client_module.search_all

    def counted(client, experiments, query, *args, **kwargs):
        calls.append(query)
        return real(client, experiments, query, *args, **kwargs)

    monkeypatch.setattr(client_module, "search_all", counted)
    return calls


def _writer(workspace, submission: str) -> MlflowWriter:
    writer = MlflowWriter(workspace.default_tracking_uri(), workspace)
    writer.begin("tiny", submission=submission, code=submission_code(), plan={})
    return writer


def _children(writer: MlflowWriter) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for run in writer.client.search_runs([writer.experiment_id], "tags.reslab_kind = 'run'"):
        out.setdefault(run.data.tags["run_id"], []).append(run.info.run_id)
    return out


def test_two_drivers_of_a_workspace_share_children_without_searching(tmp_path, workspace, searches):
    runs = expand(load_study(write_study(tmp_path)))
    first, second = _writer(workspace, "s1"), _writer(workspace, "s2")
    # `begin` reads the children already there from the store's tables, never through MLflow's search, which builds
    # each child's whole record (minutes at 10^4 children); it searches only for its abandoned submissions
    assert searches and not [q for q in searches if "'run'" in q]
    searches.clear()

    mine = first.child(runs[0]).mlflow_id
    assert second.child(runs[0]).mlflow_id == mine  # created by the other driver after this one began: reused
    theirs = second.child(runs[1]).mlflow_id
    assert first.child(runs[1]).mlflow_id == theirs
    assert searches == []
    assert _children(first) == {runs[0].run_id: [mine], runs[1].run_id: [theirs]}

    # a third submission finds both among the children there when it begins, and reuses them by id
    third = _writer(workspace, "s3")
    assert third._existing == {r.run_id: ("RUNNING", False) for r in runs[:2]}
    searches.clear()
    assert [third.child(r).mlflow_id for r in runs[:2]] == [mine, theirs]
    assert searches == []
    assert third.client.get_run(mine).data.tags["mlflow.parentRunId"] == third.parent_id  # re-parented


def test_a_ledger_child_deleted_since_is_searched_for_and_replaced(tmp_path, workspace, searches):
    runs = expand(load_study(write_study(tmp_path)))
    first, second = _writer(workspace, "s1"), _writer(workspace, "s2")
    gone = first.child(runs[0]).mlflow_id
    first.client.delete_run(gone)  # as another machine's driver reconciling a duplicate would
    searches.clear()
    fresh = second.child(runs[0]).mlflow_id
    assert fresh != gone and len(searches) == 1  # the ledger's id is deleted: MLflow is asked by tag, then created
    assert _children(second) == {runs[0].run_id: [fresh]}


def test_the_ledger_reads_only_complete_lines_and_keeps_the_first_child_of_a_run(tmp_path):
    path = tmp_path / ".tracking.children" / "key"
    path.parent.mkdir()
    path.write_bytes(b"before a1\n")  # there when the submission began: its snapshot has it, the file is skipped
    ledger = client_module.ChildLedger(path, {"r0": "m0"})
    assert ledger.lookup("before") is None and ledger.lookup("r0") == "m0"
    with open(path, "ab") as f:
        f.write(b"r1 m1\nr1 m1b\nr2 m2")  # r1 twice (the first kept); r2 being written
    assert (ledger.lookup("r1"), ledger.lookup("r2")) == ("m1", None)
    with open(path, "ab") as f:
        f.write(b"\n")
    assert ledger.lookup("r2") == "m2"
    ledger.add("r3", "m3")
    assert client_module.ChildLedger(path, {}).offset == path.stat().st_size
    assert path.read_bytes().endswith(b"r2 m2\nr3 m3\n") and ledger.offset == path.stat().st_size


def test_a_run_that_has_ended_is_let_go_and_a_late_row_still_lands_once(tmp_path, workspace, searches):
    """The writer holds the runs in flight only (a 10^5-run submission would otherwise keep every run's logged
    steps); a row that comes after the end reopens the child by id and is logged once."""
    run = expand(load_study(write_study(tmp_path)))[0]
    writer = _writer(workspace, "s1")
    rows = [{"kind": "train", "step": s, "train_loss": 5.0 - s / 10, "time": 1000.0 + s} for s in (1, 2)]
    for row in rows:
        writer.on_event(run, {"type": "train", "step": row["step"], "metrics": {"train_loss": row["train_loss"]},
                              "time": row["time"]})
    writer.flush()
    writer.finish(run, {"val_loss": 1.0}, metrics=rows)
    assert not writer.has_child(run.run_id)
    searches.clear()
    for step in (2, 3):  # step 2 again (MLflow has it), step 3 late
        writer.on_event(run, {"type": "train", "step": step, "metrics": {"train_loss": 1.0}, "time": 2000.0 + step})
    writer.flush()
    mlflow_id = writer.child(run).mlflow_id
    assert [m.step for m in writer.client.get_metric_history(mlflow_id, "train_loss")] == [1, 2, 3]
    assert searches == [] and writer.client.get_run(mlflow_id).info.status == "FINISHED"
