"""A study's analysis against the plan frozen at its first submission (`durability.plans`), as the read commands
see it: the analysis now (`results.verdict.analysis_of`, at the level the command reads at), recorded as a new
version the first time a read sees it changed, and which comparisons that makes exploratory
(`results.verdict.plan_status`). A workspace that cannot be written still gets the status; the change is then
recorded by the next command that can."""

from __future__ import annotations

import logging

import pandas as pd

from reslab.experiments.spec import Study
from reslab.orchestrator.durability.plans import read_versions, record_version
from reslab.orchestrator.durability.workspace import Workspace
from reslab.results.collect import usable
from reslab.results.verdict import PlanStatus, analysis_of, plan_hash, plan_status

__all__ = ["analysis_notes", "finished_by_arm", "study_analysis", "study_plan_status"]

log = logging.getLogger(__name__)


def study_analysis(study: Study, alpha: float) -> dict:
    return analysis_of(study.comparisons, alpha=alpha, sequential=study.sequential, contrasts=study.contrasts)


def finished_by_arm(runs: pd.DataFrame) -> dict[str, int]:
    """Arm -> its usable (finished) runs in a runs table."""
    done = runs[usable(runs)]
    return {str(arm): int(n) for arm, n in done.groupby("arm").size().items()} if len(done) else {}


def study_plan_status(study: Study, workspace: Workspace, alpha: float, finished: dict[str, int]) -> PlanStatus:
    """The study's analysis at `alpha` against its frozen plan; a changed analysis is recorded with `finished` (the
    study's finished runs per arm now) unless the workspace refuses the write."""
    analysis = study_analysis(study, alpha)
    try:
        versions = record_version(workspace.root, study.name, analysis, plan_hash(analysis), finished, first=False)
    except OSError as exc:  # a read-only workspace: the status, unrecorded
        log.warning("analysis plan of %s not recorded (%s); the change is recorded by the next command that can",
                    study.name, exc)
        versions = read_versions(workspace.root, study.name)
    return plan_status(versions, analysis, sum(finished.values()), finished)


def analysis_notes(study: Study, workspace: Workspace, alpha: float, runs: pd.DataFrame) -> dict[str, str]:
    """Comparison -> why its analysis is exploratory (changed since the plan was frozen), for the report; `runs`:
    the study's runs table."""
    status = study_plan_status(study, workspace, alpha, finished_by_arm(runs))
    return {name: change.why() for name, change in status.changes.items()}
