"""Evaluations as units of work (issue 34), end to end on a trained tiny study: each finished run is evaluated on
the local task once, its records whole in the run directory; a second pass skips every (run, task); an
evaluation interrupted part-way leaves nothing, and the rerun evaluates only what was not done; the study's
readouts then carry the task rows. Slow tier: it trains four runs (in-process backend) and runs the harness."""

from __future__ import annotations

import io
import json

import pandas as pd
import pytest

pytest.importorskip("lm_eval")

from reslab.common.errors import ConfigError  # noqa: E402
from reslab.experiments import expand, load_study  # noqa: E402
from reslab.models.evals import run_model  # noqa: E402
from reslab.orchestrator.attempt.evaluation import EVALS_DIR  # noqa: E402
from reslab.orchestrator.dispatch.local_backend import LocalBackend  # noqa: E402
from reslab.orchestrator.driving.evaluations import check_evals, evaluate_study  # noqa: E402
from reslab.orchestrator.driving.loop import ExecutionOptions  # noqa: E402
from reslab.orchestrator.driving.submit import submit  # noqa: E402
from reslab.orchestrator.durability.workspace import Workspace  # noqa: E402
from reslab.orchestrator.gathering.gather import gather  # noqa: E402
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


class Killed(BaseException):
    """The evaluating process dies (a BaseException, as a signal's: nothing catches it on the way out)."""


@pytest.fixture(autouse=True)
def hub_off(monkeypatch, tmp_path):
    """Offline, and the harness's `datasets` cache (the local task's JSON as Arrow) in a temporary folder."""
    import datasets

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-datasets", raising=False)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("evals")
    path = root / "evals_small.yaml"
    path.write_text(STUDY)
    study = load_study(path)
    runs = expand(study)
    ws = Workspace.at(root / "ws")
    tracker = GuardedTracker(ws.default_tracking_uri(), ws)
    result = submit(study, runs, ws, LocalBackend(), tracker, ExecutionOptions(), stream=io.StringIO(),
                    say=lambda *_: None)
    assert result.ok
    return study, runs, ws


def test_each_run_once_then_skipped_and_an_interruption_redoes_only_the_unfinished(trained, monkeypatch):
    study, runs, ws = trained
    check_evals(study.evals)
    calls: list[str] = []
    kill = [True]
    real = run_model.evaluate_run

    def counted(cfg, run_dir, *args, **kwargs):
        calls.append(run_dir.name)
        if len(calls) == 2 and kill and kill.pop():
            raise Killed  # killed while evaluating the second run
        return real(cfg, run_dir, *args, **kwargs)

    monkeypatch.setattr(run_model, "evaluate_run", counted)
    with pytest.raises(Killed):
        evaluate_study(study, runs, ws, study.evals, stream=io.StringIO())
    first = calls[0]
    assert list((ws.run_dir(study.name, calls[1]).path / EVALS_DIR).glob("*.parquet")) == []
    calls.clear()
    out = io.StringIO()
    assert evaluate_study(study, runs, ws, study.evals, stream=out) == 3
    assert first not in calls and len(calls) == 3
    assert "skipped (done" in out.getvalue()
    calls.clear()
    assert evaluate_study(study, runs, ws, study.evals, stream=io.StringIO()) == 0 and calls == []
    for run in runs:
        folder = ws.run_dir(study.name, run.run_id).path / EVALS_DIR
        (records,) = folder.glob("reslab_next_line-*.parquet")
        frame = pd.read_parquet(records)
        assert len(frame) == 24 and set(frame["run_id"]) == {run.run_id}
        assert {"doc_id", "doc_hash", "acc", "acc_norm", "loglikelihoods"} <= set(frame.columns)
        marker = json.loads(records.with_suffix(".json").read_text())
        assert marker["settings"]["limit"] == 24 and marker["metrics"]["acc"] == pytest.approx(frame["acc"].mean())


def test_the_readouts_carry_the_task_rows(trained):
    study, runs, ws = trained
    evaluate_study(study, runs, ws, study.evals, stream=io.StringIO())
    readout = gather(study, runs, ws, ws.default_tracking_uri())
    text = "".join(t for t in readout.text() if isinstance(t, str))
    assert "downstream tasks:" in text
    row = next(line for line in text.splitlines() if "reslab_next_line" in line and "attnres vs control" in line)
    assert "2 x 24" in row and "two-way" in row
    assert '<table id="tasks">' in readout.report()


def test_a_study_with_nothing_trained_is_one_line(tmp_path):
    path = tmp_path / "evals_small.yaml"
    path.write_text(STUDY)
    study = load_study(path)
    with pytest.raises(ConfigError, match="no run of evals_small has finished"):
        evaluate_study(study, expand(study), Workspace.at(tmp_path / "empty"), study.evals, stream=io.StringIO())
