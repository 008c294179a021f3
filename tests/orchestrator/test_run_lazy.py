"""`reslab run` at 10^6 runs (issue 39): the submission draws its runs lazily, so a study of a million runs starts
dispatching without building them.

The study is 4 arms x 25 grid points x 10,000 seeds of the tiny preset (`bench/bench_plan.py`'s study with fewer
points and more seeds: its first seed, what `reslab run` checks, resolves in a fraction of a second), its
runs given to `submit` as `reslab run` gives them (`LazyRuns`: the first seed's runs and the plan counted from the
run directories). Nothing trains: the in-process backend is stopped at its first poll by a Ctrl-C
(`orch_helpers.dying_backend`), which is a hook, not a stand-in: the loop has by then dispatched a full set of
slots, which is the moment the test is about, and the interrupt is the one a user sends (the loop cancels what it
dispatched and marks it interrupted). Training a run would only add seconds that say nothing about the driver.
"""

from __future__ import annotations

import gc
import io
import tracemalloc

from orch_helpers import dying_backend

from reslab.experiments import expand, load_study
from reslab.experiments.expand import RunSpec, count_runs, iter_runs
from reslab.orchestrator.driving import plan as plan_module
from reslab.orchestrator.driving import submit as submit_module
from reslab.orchestrator.driving.loop import ExecutionOptions
from reslab.orchestrator.driving.plan import study_counts
from reslab.orchestrator.driving.submit import LazyRuns, submit
from reslab.orchestrator.durability.workspace import Workspace

ARMS, POINTS, SEEDS = 4, 25, 10_000

STUDY = """
study: lazy
base:
  model: {{preset: tiny}}
  optim: {{batch_size: 16, warmup_steps: 20}}
  train: {{steps: 200, eval_windows: 128}}
arms:
  control: prenorm
  attnres: {{residual: attnres}}
  block2: {{residual: {{name: block_attnres, options: {{block_size: 2}}}}}}
  block4: {{residual: {{name: block_attnres, options: {{block_size: 4}}}}}}
seeds: {seeds}
limits: {{max_runs: {runs}}}
grid:
  optim.lr: [{lrs}]
  train.eval_every: [{evals}]
"""


def _study(tmp_path):
    lrs = ", ".join(f"{1e-4 * (i + 1):.4g}" for i in range(POINTS // 5))
    evals = ", ".join(str(10 * (i + 1)) for i in range(5))
    path = tmp_path / "lazy.yaml"
    path.write_text(STUDY.format(seeds=SEEDS, runs=ARMS * POINTS * SEEDS, lrs=lrs, evals=evals))
    return load_study(path)


def _count_drawn(monkeypatch) -> list[int]:
    """Wrap `iter_runs` where the submission and the plan's counting take it: how many RunSpecs each call yields."""
    drawn: list[int] = []
    real = submit_module.iter_runs

    def counted(*args, **kwargs):
        drawn.append(0)
        for run in real(*args, **kwargs):
            drawn[-1] += 1
            yield run

    monkeypatch.setattr(submit_module, "iter_runs", counted)
    monkeypatch.setattr(plan_module, "iter_runs", counted)
    return drawn


def test_a_million_run_study_starts_dispatching_without_building_its_runs(tmp_path, monkeypatch):
    study = _study(tmp_path)
    total = count_runs(study)
    assert total == ARMS * POINTS * SEEDS == 10**6
    firsts = expand(study, study.seeds[:1])  # what `reslab run` checks devices and budgets on: 100 runs
    workspace = Workspace(tmp_path / "ws")
    drawn = _count_drawn(monkeypatch)
    slots = 3
    said: list[str] = []
    tracemalloc.start()
    try:
        counts = study_counts(study, firsts, workspace)  # an empty workspace: every run to run, counted
        result = submit(study, LazyRuns(firsts, counts), workspace, dying_backend(0, KeyboardInterrupt), None,
                        ExecutionOptions(max_concurrent=slots), stream=io.StringIO(), say=said.append)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # the plan's line and the result's plan come from the counts, not from a list of the runs
    assert said[0].startswith(f"lazy: {total} runs: {total} to run, 0 to skip, 0 busy elsewhere"), said
    assert result.planned.runs == total and result.planned.by_arm["block4"][plan_module.RUN] == total // ARMS
    # the loop filled its slots, then the Ctrl-C: what it dispatched is interrupted, every other run still to run
    assert result.interrupted and result.count("interrupted") == slots, (result.states, said)
    assert result.count("to run") == total - slots
    assert len(result.states) == slots  # per-run state only for the runs that started
    # a bounded look-ahead: the runs dispatched and at most one more planned, out of one lazy pass
    assert len(drawn) == 1 and slots <= drawn[0] <= slots + 1, drawn
    # what 10^6 RunSpecs take (~0.8 GB: ~770 bytes a run), from the traced size of the runs of further seeds; the
    # submission stayed far below (~1.3 MB)
    per_run = _traced_per_run(study)
    assert per_run * total > 100 * peak, (per_run, peak)


def _traced_per_run(study) -> float:
    """Bytes each run of a seed after the first holds, by tracemalloc: `iter_runs` builds the first seed's runs
    untraced, then two more seeds' (sharing the first's config sections, as every further seed does), traced; the
    memory they hold, per run."""
    runs: list[RunSpec] = []
    per_seed = ARMS * POINTS
    try:
        for run in iter_runs(study, study.seeds[:3]):
            runs.append(run)
            if len(runs) == per_seed:
                gc.collect()
                tracemalloc.start()
        gc.collect()
        held, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(runs) == 3 * per_seed
    return held / (2 * per_seed)
