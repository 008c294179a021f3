"""The driver's MLflow writes stay bounded as runs in flight grow (issue 39): the loop's flush each poll tick
writes the runs that waited longest first and stops once its time budget is spent (`children.FLUSH_BUDGET_S`; at
least one run each tick), and one run's end writes that run's rows only. What MLflow holds is read back through
MLflow's own client."""

from __future__ import annotations

from orch_helpers import write_study

from reslab.experiments import expand, load_study
from reslab.orchestrator.tracking import children as writer_module
from reslab.orchestrator.tracking.writer import MlflowWriter


def _history(w: MlflowWriter, run) -> list[int]:
    return sorted(m.step for m in w.client.get_metric_history(w.child(run).mlflow_id, "train_loss"))


def _train(w: MlflowWriter, run, step: int) -> None:
    w.on_event(run, {"type": "train", "step": step, "metrics": {"train_loss": 5.0 - step / 10}, "time": 1000.0 + step})


def _writer(tmp_path, workspace):
    runs = expand(load_study(write_study(tmp_path)))[:3]
    w = MlflowWriter(workspace.default_tracking_uri(), workspace)
    w.begin("tiny", submission="s1", code={}, plan={})
    for run in runs:
        w.on_event(run, {"type": "start", "attempt": 1, "start_step": 0})
    return w, runs


def test_a_spent_budget_leaves_the_other_runs_for_the_next_tick_oldest_first(tmp_path, workspace, monkeypatch):
    monkeypatch.setattr(writer_module, "FLUSH_BUDGET_S", 0.0)  # every tick writes one run: the least there is
    w, (a, b, c) = _writer(tmp_path, workspace)
    for run in (a, b, c):
        _train(w, run, 1)
    w.flush()
    w.flush()
    assert [_history(w, r) for r in (a, b, c)] == [[1], [1], []]  # two ticks, one run each, in order
    _train(w, a, 2)
    _train(w, b, 2)
    w.flush()  # c waited longest: it goes before the two written at the earlier ticks
    assert [_history(w, r) for r in (a, b, c)] == [[1], [1], [1]]
    assert {r.run_id for r in w.queued()} == {a.run_id, b.run_id}
    while w.queued():
        w.flush()
    assert [_history(w, r) for r in (a, b, c)] == [[1, 2], [1, 2], [1]]


def test_one_runs_end_writes_its_own_rows_only(tmp_path, workspace):
    w, (a, b, _) = _writer(tmp_path, workspace)
    _train(w, a, 1)
    _train(w, b, 1)
    w.fail(a, "boom")
    assert _history(w, a) == [1] and _history(w, b) == []
    assert [r.run_id for r in w.queued()] == [b.run_id]
    w.finish(b, {"val_loss": 1.0})
    assert _history(w, b) == [1] and not w.queued()
    child = w.client.get_run(w.child(b).mlflow_id)
    assert child.info.status == "FINISHED" and child.data.tags["summary/val_loss"] == "1.0"
    assert child.data.tags["reslab.logged_train_step"] == "1"


def test_a_discarded_parent_is_ended_before_it_is_deleted(tmp_path, workspace):
    """Issue 52, item 9: a no-op resubmission's parent was deleted while RUNNING, and MLflow's deleted view showed
    a submission still running."""
    w, _ = _writer(tmp_path, workspace)
    parent = w.parent_id
    w.discard_parent()
    run = w.client.get_run(parent)
    assert run.info.lifecycle_stage == "deleted" and run.info.status == "FINISHED"
