"""A study's verdicts (`results.verdict`): per comparison, treatment and grid point the decision, its estimate and
interval, p or e-value, the seeds and compute it read and what would decide it, held to the analysis plan frozen at
the study's first submission. What `reslab verdict` prints (a line each, or `--json`) and `reslab.api` returns.

The statistics are the readouts' own: a fixed design's paired table (the study's headline, as `reslab compare`
prints it), a sequential design's table from the same runs its readout reads (`results.sequential`)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from reslab.experiments.budget import budgets_by_point
from reslab.experiments.expand import RunSpec, expand
from reslab.experiments.spec import Study
from reslab.orchestrator.durability.workspace import Workspace
from reslab.orchestrator.gathering.analysis import study_plan_status
from reslab.orchestrator.gathering.gather import gather
from reslab.results.collect import pairs_table, usable
from reslab.results.sequential import sequential_table
from reslab.results.verdict import DEFAULT_ALPHA, PlanStatus, Verdict, fixed_verdicts, sequential_verdicts

__all__ = ["VerdictReport", "study_verdicts"]


@dataclass(frozen=True)
class VerdictReport:
    """A study's verdicts, its design (`fixed` or `sequential`), its finished and expected runs, and its analysis
    against the frozen plan (`plan.state`: "frozen", "changed" or "not frozen")."""

    study: str
    design: str
    alpha: float
    runs: int
    finished_runs: int
    plan: PlanStatus
    verdicts: tuple[Verdict, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"study": self.study, "design": self.design, "alpha": self.alpha, "runs": self.runs,
                "finished_runs": self.finished_runs, "plan": self.plan.to_dict(),
                "verdicts": [v.to_dict() for v in self.verdicts]}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1, allow_nan=False)

    def lines(self) -> list[str]:
        """The header (the runs and the plan) and one line per verdict."""
        plan = self.plan.state + (f" ({self.plan.frozen_hash[:12]})" if self.plan.frozen_hash else "")
        if not self.plan.frozen:
            plan += ": the study was never submitted in this workspace"
        head = (f"{self.study}: {self.finished_runs}/{self.runs} runs finished; {self.design} design, alpha "
                f"{self.alpha:g}; analysis plan {plan}")
        return [head, *(f"  {v.line()}" for v in self.verdicts)]


def study_verdicts(study: Study, workspace: Workspace, tracking_uri: str, *, runs: list[RunSpec] | None = None,
                   alpha: float = DEFAULT_ALPHA, cached: bool = False) -> VerdictReport:
    """The study's verdicts from its records in `workspace` and `tracking_uri` (the Parquet cache of the last
    collect with `cached`), at `alpha`; `runs`: the study's (default: `expand(study)`)."""
    runs = expand(study) if runs is None else runs
    readout = gather(study, runs, workspace, tracking_uri, cached=cached, alpha=alpha)
    data = readout.data  # a sequential study's runs narrowed to those its looks released
    finished = int(usable(data.runs).sum())
    plan = study_plan_status(study, workspace, alpha, finished)
    flops = {key: float(b.flops) for key, (b, _) in budgets_by_point(runs).items()}
    if study.sequential is None:
        verdicts = fixed_verdicts(readout.table, data.comparisons, data.runs, alpha=alpha, plan=plan, flops=flops)
    else:
        seq = sequential_table(pairs_table(data.runs, data.comparisons), data.comparisons, study.sequential,
                               data.seeds, alpha)
        verdicts = sequential_verdicts(seq, data.comparisons, data.runs, study.sequential, data.seeds, plan=plan,
                                       flops=flops)
    return VerdictReport(study.name, "fixed" if study.sequential is None else "sequential", alpha, len(runs),
                         finished, plan, tuple(verdicts))
