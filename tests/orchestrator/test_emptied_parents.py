"""A failed or killed submission whose every run went on under a later one leaves no empty parent in the dashboard
(issue 52, item 14: each failed try stayed under "Additional runs"): the later submission's end deletes it (MLflow's
soft delete, restorable); a parent that still holds a run stays. The real SQLite store throughout."""

from __future__ import annotations

from orch_helpers import write_study

from reslab.experiments import expand, load_study
from reslab.orchestrator.attempt.envinfo import submission_code
from reslab.orchestrator.tasks import RunState
from reslab.orchestrator.tracking.writer import MlflowWriter


def _submission(workspace, name: str) -> MlflowWriter:
    writer = MlflowWriter(workspace.default_tracking_uri(), workspace)
    writer.begin("tiny", submission=name, code=submission_code(), plan={})
    return writer


def test_a_failed_parent_emptied_by_a_later_submission_is_deleted_and_one_holding_a_run_stays(tmp_path, workspace):
    first_run, second_run = expand(load_study(write_study(tmp_path)))[:2]
    holding = _submission(workspace, "s0")  # the second run fails, and nothing runs it again
    holding.child(second_run)
    holding.fail(second_run, "CUDA error: out of memory")
    holding.end(RunState.FAILED, {"failed": 1})
    emptied = _submission(workspace, "s1")  # the first run fails; a later submission runs it again
    emptied.child(first_run)
    emptied.fail(first_run, "CUDA error: out of memory")
    emptied.end(RunState.FAILED, {"failed": 1})
    killed = _submission(workspace, "s2")  # Ctrl-C before anything started: KILLED, holding nothing
    killed.end(RunState.INTERRUPTED, {})

    again = _submission(workspace, "s3")  # the first run, re-parented here, to its end
    again.child(first_run)
    again.finish(first_run, {"val_loss": 4.0, "val_loss_tail": 4.1})
    again.end(RunState.SUCCESS, {"succeeded": 1})

    client = again.client
    parents = (holding.parent_id, emptied.parent_id, killed.parent_id, again.parent_id)
    stage = [client.get_run(pid).info.lifecycle_stage for pid in parents]
    assert stage == ["active", "deleted", "deleted", "active"]
    assert client.get_run(emptied.parent_id).data.tags["state"].startswith("EMPTIED")
    shown = client.search_runs([again.experiment_id], "tags.reslab_kind = 'submission'")  # active runs only
    assert sorted(r.info.run_id for r in shown) == sorted([holding.parent_id, again.parent_id])
