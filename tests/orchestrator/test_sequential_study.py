"""A sequential study end to end on the in-process backend (the worker code a Ray task runs): real
training of tiny decoders, real MLflow, the anytime-valid test read after each look. Two arms whose
learning rates differ a thousandfold: a real, large effect, so the study stops before its maximum.
The study is one submission (`submit.SequentialSource` on the one loop, one MLflow parent run); its
looks read the run directories, so it decides with no tracking at all. A driver killed mid-look and
run again continues the same sequence: the same looks, the same runs, each trained once, the same
decision."""

from __future__ import annotations

import io
import json
import textwrap

import pytest
from mlflow import MlflowClient
from orch_helpers import KilledDriver, dying_backend

from reslab.experiments import expand, load_study
from reslab.orchestrator.dispatch.local_backend import LocalBackend
from reslab.orchestrator.driving.submit import ExecutionOptions, submit
from reslab.orchestrator.gathering.gather import gather, publish_study_result
from reslab.orchestrator.tracking.guarded import GuardedTracker
from reslab.orchestrator.tracking.layout import KIND_SUBMISSION

STUDY = """
study: seqtiny
base:
  model: {preset: tiny, d_model: 32, n_layers: 2, n_heads: 2, n_kv_heads: 2, ffn_hidden: 64, seq_len: 32}
  optim: {batch_size: 4, warmup_steps: 1, lr: 1.0e-2}
  train: {steps: 6, eval_every: 3, log_every: 3, eval_windows: 8, tail_k: 2, checkpoint_every: 3}
  cost: {measure: false}
arms:
  still: {residual: prenorm, optim: {lr: 1.0e-6}}
  moving: prenorm
seeds: {sequential: {start: 4, batch: 2, max: 10, test: t}}  # the t e-process decides at 6 seeds
comparisons:
  - {name: lr, control: still, treatments: [moving], metric: val_loss}
"""


def _sequential(study, runs, ws, backend, tracker):
    said = []
    result = submit(study, runs, ws, backend, tracker, ExecutionOptions(retries=0), stream=io.StringIO(),
                    say=said.append)
    return result, [line for line in said if ": look at " in line]


def _parents(ws) -> int:
    client = MlflowClient(ws.default_tracking_uri())
    experiment = client.get_experiment_by_name("seqtiny")
    return len(client.search_runs([experiment.experiment_id], f"tags.reslab_kind = '{KIND_SUBMISSION}'"))


LOOKS = ["seqtiny: look at 4 seeds (8 new runs of moving, still)",
         "seqtiny: look at 6 seeds (4 new runs of moving, still)"]


def _trained_segments(ws, run_id) -> int:
    """How many times the run trained from step 0 (a resumed attempt starts later)."""
    rd = ws.run_dir("seqtiny", run_id)
    segments = json.loads(rd.summary_file.read_text())["info"].get("segments", [])
    return sum(1 for s in segments if s["start_step"] == 0)


@pytest.mark.slow
def test_a_sequential_study_stops_early_and_a_killed_driver_continues_the_same_sequence(tmp_path, workspace):
    path = tmp_path / "seqtiny.yaml"
    path.write_text(textwrap.dedent(STUDY))
    study = load_study(path)
    runs = expand(study)
    assert len(runs) == 20 and study.sequential.looks() == [4, 6, 8, 10]

    # no tracking at all: the looks read the finished runs' summaries in their run directories
    straight, looks = _sequential(study, runs, workspace, LocalBackend(), None)
    row = straight.sequential.iloc[0]
    # at 4 seeds the e-process cannot reach 1/alpha at all ((1 + 4g)^(3/2) = 11.2 < 20); at 6 it decides
    assert straight.ok and looks == LOOKS and row["looks"] == [4, 6] and row["decision"] == "better"
    assert row["cs_high"] < 0 and row["e_value"] >= 20 and len(straight.runs) == 12

    other = type(workspace)(tmp_path / "other")
    other.root.mkdir()
    (other.root / "mlflow.db").write_bytes(workspace.mlflow_db.read_bytes())  # the fixture's empty store
    with pytest.raises(KilledDriver):  # killed during the second look, one of its four runs done
        _sequential(study, runs, other, dying_backend(8 + 1), GuardedTracker(other.default_tracking_uri(), other))
    assert _parents(other) == 1  # one parent run for the whole study, not one per look
    tracker = GuardedTracker(other.default_tracking_uri(), other)
    again, looks_again = _sequential(study, runs, other, LocalBackend(), tracker)
    assert looks_again == LOOKS and again.ok and _parents(other) == 2
    assert sorted(r.run_id for r in again.runs) == sorted(r.run_id for r in straight.runs)
    mine = again.sequential.iloc[0]
    assert (mine["looks"], mine["decision"], mine["n"]) == (row["looks"], row["decision"], row["n"])
    assert mine["mean_delta"] == pytest.approx(row["mean_delta"], abs=1e-9)
    for run in again.runs:  # each trained from step 0 exactly once: nothing run twice, nothing skipped
        assert _trained_segments(other, run.run_id) == 1, run.label

    # compare and the report lead with the sequential result; the fixed-n table is marked descriptive
    readout = gather(study, runs, other, other.default_tracking_uri())  # every run of the design, as `compare`
    assert len(readout.runs) == 12  # the runs the looks reached, not the design's 20
    lines = "".join(readout.text())
    assert "lr: moving vs still on val_loss: better after 6 seeds (looks [4, 6])" in lines
    assert "descriptive only" in lines
    page = readout.report()
    assert '<table id="sequential">' in page and 'id="plot-sequence"' in page
    assert page.index("Sequential test: the primary result") < page.index('<table id="sequential">')

    # the dashboard: the sequence as metric series on the parent run, stepped by seeds, the looks marked
    parent = publish_study_result(readout, tracker)
    client = MlflowClient(other.default_tracking_uri())
    history = {name: client.get_metric_history(parent, f"sequence/lr/moving/{name}")
               for name in ("mean_delta", "cs_low", "cs_high", "looks")}
    assert [m.step for m in history["mean_delta"]] == [2, 3, 4, 5, 6]
    assert [m.step for m in history["looks"]] == [4, 6]
    bounded = [m.step for m in history["cs_high"]]
    assert bounded and bounded[-1] == 6 and bounded == [m.step for m in history["cs_low"]]
    width = [h.value - lo.value for h, lo in zip(history["cs_high"], history["cs_low"], strict=True)]
    assert history["cs_high"][-1].value == pytest.approx(mine["cs_high"]) and width[-1] > 0
