"""Evaluations as units of work (issue 34), end to end on a trained tiny study: `submit` (what `reslab run` runs)
trains each run and then dispatches its evaluation as a task of the dispatch loop, on the study's backend (here
the in-process one, which runs the worker's code without Ray's process boundary); each finished run is evaluated
on the local task once, its records whole in the run directory and pushed to run storage, its metrics on its
MLflow child; a second submission evaluates nothing; a driver killed during evaluation leaves the run it was
evaluating without records, and the rerun evaluates only what was not done; an evaluation killed for memory, or
that ran out of it, is retried as a run is; the study's readouts then carry the task rows, also in a fresh
workspace on the same run storage. Slow tier: it trains four runs and runs the harness."""

from __future__ import annotations

import io
import json

import mlflow
import pandas as pd
import pytest
import torch

pytest.importorskip("lm_eval")

from orch_helpers import (  # noqa: E402
    KilledDriver,
    forget_work_after_training,
    kill_at_second_call,
    submit_quietly,
    train_stored_study,
)

from reslab.experiments.evals import eval_id  # noqa: E402
from reslab.models.data.prepare import corpus_dir  # noqa: E402
from reslab.models.evals import run_model  # noqa: E402
from reslab.models.evals.harness import harness_version, task_data_digest  # noqa: E402
from reslab.models.evals.next_line import ITEMS_FILE, NextLineOptions, task_dir  # noqa: E402
from reslab.orchestrator.attempt.evaluation import EVALS_DIR, evaluate, pending  # noqa: E402
from reslab.orchestrator.cli import main  # noqa: E402
from reslab.orchestrator.dispatch.local_backend import LocalBackend  # noqa: E402
from reslab.orchestrator.driving.evaluations import check_evals  # noqa: E402
from reslab.orchestrator.driving.loop import ExecutionOptions  # noqa: E402
from reslab.orchestrator.driving.submit import submit  # noqa: E402
from reslab.orchestrator.durability.storage import pull_study  # noqa: E402
from reslab.orchestrator.durability.workspace import Workspace  # noqa: E402
from reslab.orchestrator.gathering.gather import gather  # noqa: E402
from reslab.orchestrator.tasks import Completion, EvalJob  # noqa: E402
from reslab.orchestrator.tracking.guarded import GuardedTracker  # noqa: E402

pytestmark = pytest.mark.slow

STUDY = """\
study: evals_small
base:
  model: {preset: tiny, d_model: 32, n_layers: 2}
  optim: {batch_size: 4, warmup_steps: 2}
  train: {steps: 8, eval_every: 4, eval_windows: 8, tail_k: 1, log_every: 4}
arms:
  control: prenorm
  attnres: {residual: attnres}
seeds: 2
evals: {tasks: [reslab_next_line], limit: 24}
comparisons:
  - {name: main, control: control, treatments: [attnres], exploratory: true}
"""



@pytest.fixture(autouse=True)
def hub_off(monkeypatch, tmp_path):
    """Offline, and the harness's `datasets` cache (the local task's JSON as Arrow) in a temporary folder."""
    import datasets

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-datasets", raising=False)



@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The study trained and evaluated by one submission, with run storage (a local folder)."""
    root = tmp_path_factory.mktemp("evals")
    study, runs, ws, lines, result = train_stored_study(root, "evals_small", STUDY)
    assert result.ok and result.evaluated == len(runs)
    return study, runs, ws, lines


def _records(ws, study, run):
    return sorted((ws.run_dir(study.name, run.run_id).path / EVALS_DIR).glob("*.parquet"))


def test_a_submission_evaluates_each_run_after_training_and_logs_its_metrics(trained):
    study, runs, ws, lines = trained
    assert sum("eval " in line and "reslab_next_line: acc" in line for line in lines) == len(runs)
    client = mlflow.MlflowClient(ws.default_tracking_uri())
    exp = client.get_experiment_by_name(study.name)
    children = client.search_runs([exp.experiment_id], filter_string="tags.reslab_kind = 'run'")
    assert len(children) == len(runs)
    for child in children:
        run = next(r for r in runs if r.run_id == child.data.tags["run_id"])
        (records,) = _records(ws, study, run)
        marker = json.loads(records.with_suffix(".json").read_text())
        assert child.data.metrics["eval/reslab_next_line/acc"] == pytest.approx(marker["metrics"]["acc"])
        assert child.info.status == "FINISHED"
    again: list[str] = []
    result = submit_quietly(study, runs, ws, again)  # nothing to train, nothing to evaluate
    assert result.ok and result.evaluated == 0 and not any(line.startswith("  eval ") for line in again)


def test_records_are_on_run_storage_and_a_fresh_workspace_reads_them(trained, tmp_path):
    study, runs, ws, _ = trained
    fresh = Workspace.at(tmp_path / "fresh", storage=ws.storage)
    assert sorted(pull_study(fresh, study.name, [r.run_id for r in runs])) == sorted(r.run_id for r in runs)
    for run in runs:
        mine, theirs = _records(ws, study, run), _records(fresh, study, run)
        assert [p.name for p in theirs] == [p.name for p in mine] and len(mine) == 1
        assert pd.read_parquet(theirs[0]).equals(pd.read_parquet(mine[0]))
        assert theirs[0].with_suffix(".json").read_text() == mine[0].with_suffix(".json").read_text()
    text = "".join(t for t in gather(study, runs, fresh, ws.default_tracking_uri()).text() if isinstance(t, str))
    assert "reslab_next_line" in text and "downstream tasks:" in text


def test_a_driver_killed_while_evaluating_redoes_only_the_unfinished(trained, monkeypatch):
    study, runs, ws, _ = trained
    check_evals(study.evals)
    forget_work_after_training(study, runs, ws, EVALS_DIR)  # start over: no unit done
    calls = kill_at_second_call(monkeypatch, run_model, "evaluate_run")
    with pytest.raises(KilledDriver):
        submit_quietly(study, runs, ws, [], evaluate=EvalJob(study.evals, only=True))
    first, second = calls
    assert len(_records(ws, study, next(r for r in runs if r.run_id == first))) == 1
    assert _records(ws, study, next(r for r in runs if r.run_id == second)) == []
    calls.clear()
    result = submit_quietly(study, runs, ws, [], evaluate=EvalJob(study.evals, only=True))
    assert result.ok and result.evaluated == 3 and first not in calls and sorted(calls) == sorted(
        r.run_id for r in runs if r.run_id != first)
    calls.clear()
    assert submit_quietly(study, runs, ws, [], evaluate=EvalJob(study.evals, only=True)).evaluated == 0 and calls == []
    # the worker checks the markers again under the run's lock: a unit done is skipped, not evaluated
    done = evaluate(runs[0], ws.run_dir(study.name, runs[0].run_id), study.evals)
    assert [(u.task, metrics) for u, metrics in done] == [("reslab_next_line", None)] and calls == []
    for run in runs:
        (records,) = _records(ws, study, run)
        frame = pd.read_parquet(records)
        assert len(frame) == 24 and set(frame["run_id"]) == {run.run_id}
        items = task_data_digest("reslab_next_line", corpus_dir(run.config.data))  # issue 52, item 7
        content_id = eval_id(run.run_id, "reslab_next_line", study.evals, harness_version(), items)
        assert records.name == f"reslab_next_line-{content_id}.parquet"
        assert {"doc_id", "doc_hash", "acc", "acc_norm", "loglikelihoods"} <= set(frame.columns)
        marker = json.loads(records.with_suffix(".json").read_text())
        assert marker["settings"]["limit"] == 24 and marker["metrics"]["acc"] == pytest.approx(frame["acc"].mean())


class OomKilledOnce(LocalBackend):
    """The in-process backend, except that the first attempt of the first task of work after training never
    returns, as Ray reports a worker its memory monitor killed (`ray.exceptions.OutOfMemoryError`). Faked because
    the in-process backend has no worker process for a memory monitor to kill, and starving this machine of
    memory would take the other tests down; the loop's handling of it is the real one."""

    def __init__(self) -> None:
        super().__init__()
        self.killed: list[str] = []

    def execute(self, task):
        if task.work is not None and not self.killed:
            self.killed.append(task.run_id)
            return Completion(task, error="OutOfMemoryError: Task was killed due to the node running low on memory. "
                                          "Memory on the node was 21.7GB / 23.5GB (0.92)")
        return super().execute(task)


def test_an_evaluation_killed_for_memory_is_retried_as_a_run_is(trained):
    """Issue 52, item 11: an evaluation whose worker was killed for memory runs again (its retry counted as a run's,
    `ExecutionOptions.retries`), so `reslab eval` ends with every run evaluated instead of rc 1."""
    study, runs, ws, _ = trained
    forget_work_after_training(study, runs, ws, EVALS_DIR)
    backend, lines, shown = OomKilledOnce(), [], io.StringIO()
    result = submit(study, runs, ws, backend, GuardedTracker(ws.default_tracking_uri(), ws),
                    ExecutionOptions(evaluate=EvalJob(study.evals, only=True)), stream=shown, say=lines.append)
    assert result.ok and result.evaluated == len(runs) and len(backend.killed) == 1, (result.errors, lines)
    (retried,) = [line for line in shown.getvalue().splitlines() if " retry " in line]
    assert "retry evaluations" in retried and "(attempt 2) after: OutOfMemoryError" in retried, retried
    # issue 52, item 12: the evaluations counted as units of work, not as the runs skipped
    last = shown.getvalue().splitlines()[-1]
    assert f"skipped {len(runs)}, to run 0; evaluations: {len(runs)} succeeded, 0 running, 0 failed, 0 to run" in last
    assert all(len(_records(ws, study, run)) == 1 for run in runs)


def test_an_evaluation_that_ran_out_of_memory_is_retried(trained, monkeypatch):
    """The same when the evaluation itself raises torch's out-of-memory error (a GPU's, or a CPU allocation the
    allocator refused): a failure a retry can fix, retried once, and the retry evaluates the run."""
    study, runs, ws, _ = trained
    forget_work_after_training(study, runs, ws, EVALS_DIR)
    calls: list[str] = []
    real = run_model.evaluate_run

    def out_of_memory_once(cfg, run_dir, *args, **kwargs):
        calls.append(run_dir.name)
        if len(calls) == 1:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(cfg, run_dir, *args, **kwargs)

    monkeypatch.setattr(run_model, "evaluate_run", out_of_memory_once)
    lines: list[str] = []
    result = submit_quietly(study, runs, ws, lines, evaluate=EvalJob(study.evals, only=True))
    assert result.ok and result.evaluated == len(runs), (result.errors, lines)
    assert calls.count(calls[0]) == 2 and len(calls) == len(runs) + 1
    assert all(len(_records(ws, study, run)) == 1 for run in runs)


def test_reslab_eval_on_a_study_that_declared_none(trained, capsys, ray_session):
    """`reslab eval --tasks` on the same runs under other settings (`limit`): a new evaluation id, evaluated
    once; the second call evaluates nothing. Both calls on the session's Ray (`ray_session`: the command uses the
    instance this process is connected to, as from a notebook), not a local instance started and stopped by each
    (~15 s apiece on two cores); `reslab run`'s own local instance is test_cli_interrupt.py's."""
    study, runs, ws, _ = trained
    spec_file = ws.root.parent / "no_evals.yaml"
    spec_file.write_text(STUDY.replace("evals: {tasks: [reslab_next_line], limit: 24}\n", ""))
    args = ["eval", str(spec_file), "--workspace", str(ws.root), "--storage", ws.storage, "--tasks",
            "reslab_next_line", "--limit", "8"]
    assert main(args) == 0
    assert f"evals_small: {len(runs)} evaluation(s)" in capsys.readouterr().out
    for run in runs:
        assert len(_records(ws, study, run)) == 2
    assert main(args) == 0
    assert "evals_small: 0 evaluation(s)" in capsys.readouterr().out


def test_the_readouts_carry_the_task_rows(trained):
    study, runs, ws, _ = trained
    readout = gather(study, runs, ws, ws.default_tracking_uri())
    text = "".join(t for t in readout.text() if isinstance(t, str))
    assert "downstream tasks:" in text
    row = next(line for line in text.splitlines() if "reslab_next_line" in line and "attnres vs control" in line)
    assert "2 x 24" in row and "two-way" in row
    assert '<table id="tasks">' in readout.report()


def test_a_study_with_nothing_trained_is_one_line(tmp_path, capsys):
    path = tmp_path / "evals_small.yaml"
    path.write_text(STUDY)
    assert main(["eval", str(path), "--workspace", str(tmp_path / "empty")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no run of evals_small has finished" in err[0]


def test_the_task_data_is_part_of_the_evaluation_id(trained, capsys, monkeypatch):
    """Issue 52, item 7: items of the cached local task changed on disk (still whole JSON: each item's answer
    moved) no longer pass for the evaluations of the intact file; restored, nothing is pending again. Item 6:
    a cached items file that is not whole is refused by `reslab eval` in one line before anything is submitted."""
    study, runs, ws, _ = trained
    items = task_dir(corpus_dir(runs[0].config.data), NextLineOptions()) / ITEMS_FILE
    intact = items.read_text()
    rds = [(run, ws.run_dir(study.name, run.run_id)) for run in runs]
    assert not any(pending(run, rd, study.evals, harness_version()) for run, rd in rds)
    moved = [json.loads(line) for line in intact.splitlines()]
    for item in moved:
        item["gold"] = (item["gold"] + 1) % len(item["choices"])
    try:
        items.write_text("".join(json.dumps(item) + "\n" for item in moved))
        assert all(pending(run, rd, study.evals, harness_version()) for run, rd in rds)
        items.write_text(intact[: len(intact) // 2])  # cut mid-item
        spec = ws.root.parent / "damaged.yaml"
        spec.write_text(STUDY)
        monkeypatch.delenv("RAY_ADDRESS", raising=False)
        code = main(["eval", str(spec), "--workspace", str(ws.root), "--storage", ws.storage])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(err) == 1, err
        assert f"evals.tasks: 'reslab_next_line' reads {items}, which is damaged: line" in err[0]
    finally:
        items.write_text(intact)
    assert not any(pending(run, rd, study.evals, harness_version()) for run, rd in rds)
