"""Interventions as units of work after training (issue 36), end to end on a trained tiny study: `submit` (what
`reslab run` runs) trains each run and then dispatches its interventions as a task of the dispatch loop, on the
study's backend (here the in-process one, which runs the worker's code without Ray's process boundary); each
finished run is intervened on once, its records whole in the run directory and pushed to run storage, equal to
`models.interventions.effects` called directly on the model and eval windows training itself loads, their deltas
on its MLflow child; a second submission does nothing; a driver killed while intervening leaves the run it was on
without records, and the rerun does only what was not done; the readouts then carry the knock-out effects, also
in a fresh workspace on the same run storage; the report, rendered by headless Chromium, shows the depth profiles
and the knock-out heatmaps beside the mechanism rows. Slow tier: it trains four runs."""

from __future__ import annotations

import json
import re

import mlflow
import pytest

from reslab.experiments.evals import EvalSpec
from reslab.experiments.interventions import InterventionSpec, intervention_id, resolve
from reslab.models.evals import run_model
from reslab.models.interventions import effects
from reslab.models.training import Trainer
from reslab.orchestrator.attempt.after import AfterTraining
from reslab.orchestrator.attempt.intervention import INTERVENTIONS_DIR, intervene
from reslab.orchestrator.driving.after import AfterWork
from reslab.orchestrator.driving.loop import ExecutionOptions, TaskMaker
from reslab.orchestrator.durability.storage import pull_study
from reslab.orchestrator.durability.workspace import Workspace
from reslab.orchestrator.gathering.gather import gather
from reslab.orchestrator.tasks import EvalJob, InterventionJob
from reslab.orchestrator.tracking.protocol import NullTracker

from orch_helpers import KilledDriver, forget_work_after_training, kill_at_second_call  # isort: skip
from orch_helpers import submit_quietly, train_stored_study  # isort: skip
from test_report import CHROMIUM, SIZES_SCRIPT, chromium  # isort: skip

pytestmark = pytest.mark.slow

STUDY = """\
study: knock_small
base:
  model: {preset: tiny, d_model: 32, n_layers: 2}
  optim: {batch_size: 4, warmup_steps: 2}
  train: {steps: 8, eval_every: 4, eval_windows: 8, tail_k: 1, log_every: 4}
arms:
  control: prenorm
  attnres: {residual: attnres}
seeds: 2
interventions: {kinds: [sources], mode: [zero, mean], sites: [3, 4]}
mechanisms: [growth, stream_growth, grad_cv]
comparisons:
  - {name: main, control: control, treatments: [attnres], exploratory: true}
"""




@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The study trained and intervened on by one submission, with run storage (a local folder)."""
    root = tmp_path_factory.mktemp("knock")
    study, runs, ws, lines, result = train_stored_study(root, "knock_small", STUDY)
    assert result.ok and result.intervened == len(runs) and result.evaluated == 0
    return study, runs, ws, lines


def _rows(ws, study, run):
    (records,) = (ws.run_dir(study.name, run.run_id).path / INTERVENTIONS_DIR).glob("*.jsonl")
    return records, [json.loads(line) for line in records.read_text().splitlines()]


def test_each_run_is_intervened_on_once_and_its_deltas_are_on_mlflow(trained):
    study, runs, ws, lines = trained
    assert sum(line.startswith("  interventions ") and "knock-out(s)" in line for line in lines) == len(runs)
    client = mlflow.MlflowClient(ws.default_tracking_uri())
    exp = client.get_experiment_by_name(study.name)
    children = client.search_runs([exp.experiment_id], filter_string="tags.reslab_kind = 'run'")
    assert len(children) == len(runs)
    for child in children:
        run = next(r for r in runs if r.run_id == child.data.tags["run_id"])
        records, rows = _rows(ws, study, run)
        assert records.stem == intervention_id(run.run_id, study.interventions)
        knockouts = {k: v for k, v in child.data.metrics.items() if k.startswith("knockout/")}
        assert knockouts == {f"knockout/{r['mode']}/{r['site']}/{r['source']}": pytest.approx(r["delta"])
                             for r in rows}
        assert "interventions.csv" in [a.path for a in client.list_artifacts(child.info.run_id)]
        assert child.info.status == "FINISHED"
    again: list[str] = []
    result = submit_quietly(study, runs, ws, again)  # nothing to train, nothing to intervene on
    assert result.ok and result.intervened == 0 and not any(line.startswith("  interventions ") for line in again)


def test_records_equal_effects_called_directly(trained):
    """The model and eval windows as training itself loads them (`Trainer` resuming the finished run), then
    `effects` on the same requests: the unit's rows, value for value."""
    study, runs, ws, _ = trained
    for run in runs:
        _, rows = _rows(ws, study, run)
        trainer = Trainer(run.config, ws.run_dir(study.name, run.run_id).path)
        direct = effects(trainer.model, trainer.val_batches, resolve(study.interventions, run.config),
                         autocast=trainer.autocast)
        assert len(rows) == len(direct) == (4 + 5) * 2  # sites 3 and 4 read 4 and 5 sources; two modes
        for mine, theirs in zip(rows, direct, strict=True):
            assert {k: mine[k] for k in ("kind", "site", "source", "mode", "tokens")} == \
                {k: theirs[k] for k in ("kind", "site", "source", "mode", "tokens")}
            for k in ("loss", "base_loss", "delta"):
                assert mine[k] == pytest.approx(theirs[k], rel=1e-6, abs=1e-7)
            assert mine["run_id"] == run.run_id


def test_a_driver_killed_while_intervening_redoes_only_the_unfinished(trained, monkeypatch):
    study, runs, ws, _ = trained
    forget_work_after_training(study, runs, ws, INTERVENTIONS_DIR)  # start over: no unit done
    calls = kill_at_second_call(monkeypatch, run_model, "intervene_run")
    with pytest.raises(KilledDriver):
        submit_quietly(study, runs, ws, [])
    first, second = calls
    folder = {r.run_id: ws.run_dir(study.name, r.run_id).path / INTERVENTIONS_DIR for r in runs}
    assert len(list(folder[first].glob("*.jsonl"))) == 1
    assert list(folder[second].glob("*.json*")) == []
    calls.clear()
    result = submit_quietly(study, runs, ws, [])
    assert result.ok and result.intervened == 3 and first not in calls and sorted(calls) == sorted(
        r.run_id for r in runs if r.run_id != first)
    calls.clear()
    assert submit_quietly(study, runs, ws, []).intervened == 0 and calls == []
    # the worker checks the marker again under the run's lock: a unit done is skipped, not redone
    unit, rows = intervene(runs[0], ws.run_dir(study.name, runs[0].run_id), study.interventions)
    assert rows is None and unit.done() and calls == []


def test_a_fresh_workspace_on_storage_reads_the_readout(trained, tmp_path):
    study, runs, ws, _ = trained
    fresh = Workspace.at(tmp_path / "fresh", storage=ws.storage)
    assert sorted(pull_study(fresh, study.name, [r.run_id for r in runs])) == sorted(r.run_id for r in runs)
    for run in runs:
        assert _rows(fresh, study, run)[1] == _rows(ws, study, run)[1]
    readout = gather(study, runs, fresh, ws.default_tracking_uri())
    text = "".join(t for t in readout.text() if isinstance(t, str))
    assert "interventions: loss with the source removed - without" in text
    assert "attnres (mean, 2 seed(s)):" in text and "control (zero, 2 seed(s)):" in text
    assert '<table id="interventions">' in readout.report()


def test_one_task_per_run_carries_each_kind_still_pending(trained):
    """The loop holds one task per run in flight, so a run's task of work after training carries every kind
    with units pending, and none that is done; a run with nothing pending has no task."""
    pytest.importorskip("lm_eval")  # an evaluation's content id holds the harness's version
    study, runs, ws, _ = trained
    evals = EvalJob(EvalSpec(tasks=("reslab_next_line",)))
    done, other = InterventionJob(study.interventions), InterventionJob(InterventionSpec(kinds=("source",),
                                                                                         sites=(0,)))
    maker = TaskMaker(ws, "s", {}, ExecutionOptions())
    run = runs[0]
    assert AfterWork(ws, NullTracker(), print, evals=evals, interventions=done).task(run, maker).work == \
        AfterTraining(evals=evals)
    assert AfterWork(ws, NullTracker(), print, evals=evals, interventions=other).task(run, maker).work == \
        AfterTraining(evals=evals, interventions=other)
    assert AfterWork(ws, NullTracker(), print, interventions=done).task(run, maker) is None


@pytest.mark.skipif(CHROMIUM is None, reason="headless Chromium is not installed (Debian: apt-get install chromium)")
def test_the_report_shows_the_depth_profiles_and_the_knockout_heatmaps_in_chromium(trained, tmp_path):
    """Issue 36's "done when": the report of a study with mechanisms and interventions shows the per-layer
    profiles (output RMS, gradient norm) and one knock-out heatmap per arm, each decoded by the browser at a
    non-zero size, and the mechanism rows beside the loss rows."""
    study, runs, ws, _ = trained
    page = gather(study, runs, ws, ws.default_tracking_uri()).report()
    probe = tmp_path / "report.html"
    probe.write_text(page.replace("</body>", SIZES_SCRIPT.replace("document.images",
                                  "document.querySelectorAll('figure[id^=plot-profile_] img, "
                                  "figure[id^=plot-knockout_] img')") + "</body>"))
    dom = chromium(tmp_path, "--window-size=1200,3000", "--virtual-time-budget=10000", "--dump-dom", probe.as_uri())
    figures = set(re.findall(r'<figure id="plot-((?:profile|knockout)_[^"]*)"', dom))
    assert {"knockout_control", "knockout_attnres"} <= figures, figures
    assert any(f.startswith("profile_") and "grad" in f for f in figures), figures
    assert any(f.startswith("profile_") and "rms" in f for f in figures), figures
    sizes = re.search(r'<pre id="image-sizes">([^<]*)</pre>', dom)
    assert sizes, dom[-2000:]
    dims = [tuple(map(int, s.split("x"))) for s in sizes.group(1).split()]
    assert len(dims) == len(figures) and all(w > 0 and h > 0 for w, h in dims), (figures, dims)
    assert "<h2>Mechanisms</h2>" in dom and "<h2>Interventions</h2>" in dom
    assert re.search(r"<td>stream_growth</td>|>stream_growth<", dom), "no stream_growth row"
