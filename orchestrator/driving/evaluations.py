"""The driver's side of evaluations: check a study's tasks before anything trains, then evaluate its finished
runs (`orchestrator.attempt.evaluation`), each (run, task) once, saying what it did per unit.

The evaluations run in the driver's process, one run after the other, after the study's runs (`reslab run`) or
on their own (`reslab eval`); each is skipped when its records are whole in the run directory.
"""

from __future__ import annotations

import sys
from typing import TextIO

from reslab.common.errors import ConfigError
from reslab.experiments.evals import EvalSpec
from reslab.experiments.expand import RunSpec
from reslab.experiments.spec import Study
from reslab.orchestrator.attempt.evaluation import evaluate
from reslab.orchestrator.durability.workspace import Workspace


def check_evals(spec: EvalSpec) -> None:
    """The harness is installed and knows every task (the local next-line task is built from each run's corpus
    when it is evaluated, so its name alone is checked here); one line each, before anything trains."""
    from reslab.models.evals.harness import check_tasks
    from reslab.models.evals.next_line import TASK_NAME

    check_tasks([t for t in spec.tasks if t != TASK_NAME])


def evaluate_study(study: Study, runs: list[RunSpec], workspace: Workspace, spec: EvalSpec, *,
                   device: str | None = None, batch_size: int = 16, stream: TextIO | None = None) -> int:
    """Evaluate every finished run of the study on `spec`'s tasks; returns how many evaluations ran."""
    stream = stream or sys.stdout
    ran = unfinished = 0
    for run in runs:
        rd = workspace.run_dir(study.name, run.run_id)
        if not rd.complete():
            unfinished += 1
            continue
        for unit, metrics in evaluate(run, rd, spec, device=device, batch_size=batch_size):
            if metrics is None:
                stream.write(f"eval {run.label} {unit.task}: skipped (done, {unit.eval_id})\n")
                continue
            ran += 1
            shown = ", ".join(f"{k} {v:.4f}" for k, v in sorted(metrics.items()))
            stream.write(f"eval {run.label} {unit.task}: {shown or 'no metrics'} ({unit.eval_id})\n")
    if unfinished:
        stream.write(f"eval: {unfinished} run(s) of {study.name} have not finished training; not evaluated\n")
    if ran == 0 and unfinished == len(runs):
        raise ConfigError(f"eval: no run of {study.name} has finished in workspace {workspace.root}; allowed: a "
                          "study that `reslab run` trained (pass its --workspace)")
    return ran
