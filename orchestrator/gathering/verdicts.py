"""A study's verdicts (`results.verdict`): per comparison, treatment and grid point the decision, its estimate and
interval, p or e-value, the seeds and compute it read and what would decide it, held to the analysis plan frozen at
the study's first submission. What `reslab verdict` prints (a line each, or `--json`) and `reslab.api` returns.

The statistics are the readouts' own: a fixed design's paired table (the study's headline, as `reslab compare`
prints it), a sequential design's table from the same runs its readout reads (`results.sequential`)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from reslab.experiments.budget import budgets_by_point
from reslab.experiments.expand import RunSpec, expand
from reslab.experiments.spec import Study
from reslab.models.optim import hashed_config
from reslab.orchestrator.durability.ledger import tries_of
from reslab.orchestrator.durability.workspace import Workspace
from reslab.orchestrator.gathering.analysis import finished_by_arm, study_plan_status
from reslab.orchestrator.gathering.gather import gather
from reslab.results.collect import pairs_table
from reslab.results.readout import StudyReadout
from reslab.results.sequential import sequential_table
from reslab.results.tries import row_keys, spent_alpha, study_try
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
                   alpha: float = DEFAULT_ALPHA, cached: bool = False, ledger_correction: bool = False
                   ) -> VerdictReport:
    """The study's verdicts from its records in `workspace` and `tracking_uri` (the Parquet cache of the last
    collect with `cached`), at `alpha`; `runs`: the study's (default: `expand(study)`). Each verdict says how many
    tries of its comparison the workspace's ledger holds (`with_tries`); with `ledger_correction` (`reslab verdict
    --ledger-correction`) the k-th try is decided at `results.tries.spent_alpha(alpha, k)`."""
    runs = expand(study) if runs is None else runs
    readout = gather(study, runs, workspace, tracking_uri, cached=cached, alpha=alpha)
    data = readout.data  # a sequential study's runs narrowed to those its looks released
    by_arm = finished_by_arm(data.runs)
    plan = study_plan_status(study, workspace, alpha, by_arm)
    flops = {key: float(b.flops) for key, (b, _) in budgets_by_point(runs).items()}

    def decide(level: float) -> list[Verdict]:
        """The verdicts with every test at `level`: the same tables, computed again at it."""
        if study.sequential is None:
            table = readout.table if level == alpha else StudyReadout(dataclasses.replace(data, alpha=level)).table
            return fixed_verdicts(table, data.comparisons, data.runs, alpha=level, plan=plan, flops=flops)
        seq = sequential_table(pairs_table(data.runs, data.comparisons), data.comparisons, study.sequential,
                               data.seeds, level)
        return sequential_verdicts(seq, data.comparisons, data.runs, study.sequential, data.seeds, plan=plan,
                                   flops=flops)

    verdicts = with_tries(study, runs, workspace, decide, alpha, ledger_correction)
    return VerdictReport(study.name, "fixed" if study.sequential is None else "sequential", alpha, len(runs),
                         sum(by_arm.values()), plan, tuple(verdicts))


def with_tries(study: Study, runs: list[RunSpec], workspace: Workspace, decide: Callable[[float], list[Verdict]],
               alpha: float, correct: bool) -> list[Verdict]:
    """`decide(alpha)`'s verdicts, each with its comparison's tries in the workspace's ledger
    (`orchestrator.durability.ledger`, keyed by `results.tries.row_keys`): this study's try is the k-th (a study
    never submitted here: the next one), and the verdict states max(k, tries recorded). With `correct` each verdict
    is `decide(alpha_k)`'s instead, alpha_k = `spent_alpha(alpha, k)` (`alpha_used`)."""
    first = study.seeds[0]
    configs = {(r.arm, r.grid_key): hashed_config(r.config) for r in runs if r.seed == first}
    keys = row_keys(study.comparisons, configs)
    tries = tries_of(workspace.root, set(keys.values()))
    mine = study_try(study.seeds, study.sequential)
    at: dict[float, dict[tuple[str, str, str], Verdict]] = {}
    out = []
    for v in decide(alpha):
        found = tries.get(keys.get((v.comparison, v.treatment, v.where), ""), [])
        k = next((t.number for t in found if t.id == mine), len(found) + 1)
        if not correct:
            out.append(dataclasses.replace(v, tries=max(k, len(found))))
            continue
        level = spent_alpha(alpha, k)
        if level not in at:
            at[level] = {(w.comparison, w.treatment, w.where): w for w in decide(level)}
        out.append(dataclasses.replace(at[level][(v.comparison, v.treatment, v.where)], tries=max(k, len(found)),
                                       alpha=alpha, alpha_used=level))
    return out
