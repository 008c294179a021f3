"""A study's paired comparison for `reslab compare`, `reslab export` and the end of `reslab run`.

The one place where the two sides meet: MLflow records come through `tracking.readers.fetch_study_runs`
and go to `results` as plain dicts, so results never imports the orchestrator.
"""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd

from reslab.common.errors import ConfigError
from reslab.experiments.expand import RunSpec
from reslab.experiments.spec import Study
from reslab.orchestrator.tracking.readers import fetch_study_runs
from reslab.orchestrator.workspace import Workspace
from reslab.results import compare
from reslab.results.collect import collect, load_cached, pairs_table
from reslab.results.ladder import LadderResult, LadderScope, ladder_readout


@dataclass(frozen=True)
class StudyComparison:
    runs: pd.DataFrame  # results.collect.runs_table: one row per expected run
    table: pd.DataFrame  # results.compare: one row per comparison, treatment and grid point
    pairs: pd.DataFrame  # results.collect.pairs_table: one row per seed with both run ids
    ladder: LadderResult | None = None  # results.ladder: a study with a `ladder:`

    @property
    def finished(self) -> int:
        return int((self.runs["status"] == "FINISHED").sum())


def compare_study(study: Study, runs: list[RunSpec], workspace: Workspace, tracking_uri: str, *,
                  cached: bool = False, alpha: float = 0.05, write_cache: bool = False) -> StudyComparison:
    """Collect the study's runs (from MLflow, or the Parquet cache with `cached`) and compare them.

    Reads only, so it serves a read-only workspace: the workspace's SQLite store is never
    created by a read, and the Parquet cache is written only with `write_cache` (the end of
    `reslab run`), into an existing workspace.
    """
    if not study.comparisons:
        raise ConfigError(f"{study.path}: comparisons: none declared; add a `comparisons:` list to compare arms")
    if cached:
        table = load_cached(study.name, workspace.cache)
        table = table[table["run_id"].isin({r.run_id for r in runs})]
    else:
        if tracking_uri == workspace.default_tracking_uri() and not workspace.mlflow_db.is_file():
            raise ConfigError(f"--workspace: no MLflow store at {workspace.mlflow_db}: nothing has run in workspace "
                              f"{workspace.root}; pass the workspace `reslab run` used (--workspace or "
                              "$RESLAB_WORKSPACE) or --tracking-uri")
        cache_dir = workspace.cache if write_cache and workspace.root.is_dir() else None
        table = collect(study.name, fetch_study_runs(tracking_uri, study.name), expected=runs, cache_dir=cache_dir)
    comparisons = list(study.comparisons)
    ladder = study_ladder(study, runs, table, alpha) if study.ladder else None
    return StudyComparison(table, compare(table, comparisons, alpha=alpha), pairs_table(table, comparisons), ladder)


def study_ladder(study: Study, runs: list[RunSpec], table: pd.DataFrame, alpha: float) -> LadderResult:
    """`results.ladder.ladder_readout` of the study's runs table: one ladder per point of the grid
    axes, each run's FLOPs and parameters from `experiments.budget` (the figures `reslab plan` prints)."""
    from reslab.experiments.budget import budgets_by_point
    from reslab.experiments.expand import grid_key_of

    scopes = [LadderScope(grid_key_of(point), tuple(grid_key_of((*rung, *point)) for rung in study.rungs()))
              for point in study.scope_points()]
    cost = {key: (b.flops, float(b.params)) for key, (b, _) in budgets_by_point(runs).items()}
    return ladder_readout(table, study.comparisons, scopes, cost, alpha=alpha)
