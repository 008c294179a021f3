"""What the user reads in small places (issue 52, item 9): a rank's resources on CPU ranks, why runs were not
evaluated, and a damaged run file's warning, said once and without advice reslab does not need."""

from __future__ import annotations

import logging

from reslab.orchestrator.attempt.distributed_run import ranks_words
from reslab.orchestrator.cli.evals import unfinished_words
from reslab.orchestrator.durability.workspace import Workspace
from reslab.orchestrator.tasks import Ranks


def test_cpu_ranks_are_not_said_to_hold_a_gpu():
    ranks = Ranks(world=2, cpus=1.5)
    assert ranks_words(ranks, on_cpus=True) == "ddp; CPU ranks of 1.5 CPU each, gloo"
    assert ranks_words(ranks, on_cpus=False) == "ddp; 1 GPU and 1.5 CPU each"


def test_failed_runs_are_not_said_to_be_unfinished():
    assert unfinished_words(["FAILED", None, "RUNNING", "FAILED"]) == \
        "2 run(s) failed, 2 run(s) have not finished training"
    assert unfinished_words(["FAILED"]) == "1 run(s) failed"
    assert unfinished_words([None]) == "1 run(s) have not finished training"


def test_a_damaged_status_file_is_warned_of_once_as_a_file_reslab_rewrites(tmp_path, caplog):
    rd = Workspace.at(tmp_path / "ws").run_dir("study", "run-000000000000")
    rd.path.mkdir(parents=True)
    rd.status_file.write_text('{"state": "RUNN')
    with caplog.at_level(logging.WARNING):
        assert [rd.state() for _ in range(3)] == [None, None, None]
    warnings = [r.getMessage() for r in caplog.records if "unreadable" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert "writes it again at the run's next attempt" in warnings[0] and "Delete it" not in warnings[0]
