"""The driver's side of interventions: say and log what each finished run's interventions came to. One kind of
work after training (`orchestrator.driving.after`), beside evaluations.

A study's `interventions:` (`experiments.interventions`) is checked against every arm's variant when the study
loads, before anything trains. Each finished run of the arms it names is one unit (`orchestrator.attempt.
intervention`), carried out once on the run's device; `Interventions.logged` hands back its rows' deltas as the
run's MLflow metrics `knockout/<mode>/<site>/<source>` and its rows as the child's `interventions.csv`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from reslab.experiments.expand import RunSpec
from reslab.experiments.interventions import InterventionSpec
from reslab.orchestrator.attempt.intervention import pending
from reslab.orchestrator.durability.workspace import RunDir
from reslab.orchestrator.tasks import InterventionJob


class Interventions:
    """A submission's interventions (module docstring): which runs have them pending, and what it says of each."""

    kind = "intervention"
    noun = "interventions"  # what the progress display calls its units

    def __init__(self, job: InterventionJob, say: Callable[[str], Any]) -> None:
        self.job, self.say = job, say
        self.ran = 0       # (run, request) units done by this submission
        self.skipped = 0   # found done by the worker

    @property
    def spec(self) -> InterventionSpec:
        spec: InterventionSpec = self.job.spec
        return spec

    def pending(self, run: RunSpec, rd: RunDir) -> bool:
        return pending(run, rd, self.spec) is not None

    def logged(self, run: RunSpec, unit: dict[str, Any]) -> tuple[dict[str, float], dict[str, list[dict[str, Any]]]]:
        """One (run, request) done: its line (the largest knock-out effect), its metrics and its table."""
        rows = unit.get("rows")
        if rows is None:
            self.skipped += 1
            self.say(f"  interventions {run.label}: skipped (done, {unit.get('id')})")
            return {}, {}
        self.ran += 1
        top = max(rows, key=lambda r: r["delta"], default=None)
        largest = "" if top is None else (f"; largest {top['delta']:+.4f} ({top['kind']} {top['source']}"
                                          f"{'' if top['site'] is None else ' at site ' + str(top['site'])}, "
                                          f"{top['mode']})")
        base = f"base loss {rows[0]['base_loss']:.4f}, " if rows else ""
        self.say(f"  interventions {run.label}: {base}{len(rows)} knock-out(s){largest} ({unit.get('id')})")
        return dict(unit.get("metrics") or {}), {"interventions.csv": rows}


__all__ = ["Interventions"]
