"""A study's paired comparison for `reslab compare`, `reslab export` and the end of `reslab run`.

The one place where the two sides meet: MLflow records come through `tracking.readers.fetch_study_runs`
and go to `results` as plain dicts, so results never imports the orchestrator.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd

from reslab.common.errors import ConfigError
from reslab.experiments.expand import RunSpec, grid_key_of, rung_keys
from reslab.experiments.spec import Study
from reslab.orchestrator.tracking.readers import fetch_study_runs
from reslab.orchestrator.workspace import Workspace
from reslab.results import compare
from reslab.results.collect import collect, load_cached, pairs_table
from reslab.results.contrasts import contrast_table
from reslab.results.equal_cost import at_matched_cost
from reslab.results.ladder import LadderResult, LadderScope, ladder_readout
from reslab.results.sequential import sequential_table

if TYPE_CHECKING:
    from reslab.experiments.budget import RunBudget


@dataclass(frozen=True)
class StudyComparison:
    runs: pd.DataFrame  # results.collect.runs_table: one row per expected run
    table: pd.DataFrame  # results.compare: one row per comparison, treatment and grid point
    pairs: pd.DataFrame  # results.collect.pairs_table: one row per seed with both run ids
    ladder: LadderResult | None = None  # results.ladder: a study with a `ladder:`
    contrasts: pd.DataFrame | None = None  # results.contrasts.contrast_table: a study with `contrasts:`
    sequential: pd.DataFrame | None = None  # results.sequential.sequential_table: a sequential study's primary result

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
    if not study.comparisons and not study.contrasts:
        raise ConfigError(f"{study.path}: comparisons: none declared; add a `comparisons:` list to compare arms")
    if study.sequential is not None:  # the runs its looks reached: the later seeds were never planned
        runs = [r for r in runs if workspace.run_dir(r.study, r.run_id).status() is not None] or runs
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
    budgets = None
    if study.ladder or any(c.at != "tokens" for c in comparisons):
        from reslab.experiments.budget import budgets_by_point

        budgets = {key: b for key, (b, _) in budgets_by_point(runs).items()}  # (arm, grid key) -> cost
    values = equal_cost_tables(study, runs, workspace, table, budgets or {})
    ladder = study_ladder(study, table, alpha, budgets or {}) if study.ladder else None
    contrasts = contrast_table(table, study.contrasts, alpha=alpha) if study.contrasts else None
    pairs = pairs_table(table, comparisons)
    sequential = sequential_table(pairs, comparisons, study.sequential, study.seeds, alpha) \
        if study.sequential is not None else None
    return StudyComparison(table, compare(table, comparisons, alpha=alpha, values=values), pairs, ladder, contrasts,
                           sequential)


def study_ladder(study: Study, table: pd.DataFrame, alpha: float,
                 budgets: dict[tuple[str, str], RunBudget]) -> LadderResult:
    """`results.ladder.ladder_readout` of the study's runs table: one ladder per point of the grid
    axes, each run's FLOPs and parameters from `experiments.budget` (the figures `reslab plan` prints)."""
    scopes = [LadderScope(grid_key_of(point), tuple(rung_keys(study, point))) for point in study.scope_points()]
    cost = {key: (b.flops, float(b.params)) for key, b in budgets.items()}
    return ladder_readout(table, study.comparisons, scopes, cost, alpha=alpha)


def equal_cost_tables(study: Study, runs: list[RunSpec], workspace: Workspace, table: pd.DataFrame,
                      budgets: dict[tuple[str, str], RunBudget]) -> dict[str, pd.DataFrame]:
    """Per comparison `at: flops` or `at: wall_clock`, the runs table with its arms' val_loss read at
    the matched cost (`results.equal_cost`), from the eval curves in the run directories."""
    at_cost = [c for c in study.comparisons if c.at != "tokens"]
    if not at_cost:
        return {}
    from reslab.orchestrator.records import study_records

    evals = study_records(study, runs, workspace).evals
    spec_of = {(r.arm, r.grid_key, r.seed): r for r in runs}
    flops = {key: b.flops / spec_of[key[0], key[1], study.seeds[0]].config.train.steps for key, b in budgets.items()}
    speed = dict(zip(table["run_id"], table["tokens_per_s"], strict=True))
    out = {}
    for comp in at_cost:
        rows = []
        for e in evals[evals["arm"].isin((comp.control, *comp.treatments))].itertuples():
            run = spec_of[e.arm, e.grid_key, e.seed]
            if comp.at == "flops":
                cost = e.step * flops[e.arm, e.grid_key]
            else:
                per_step = e.tokens / e.step if e.step else 0.0
                cost = e.step * per_step / speed.get(run.run_id, np.nan)
            rows.append({"run_id": run.run_id, "cost": cost, "val_loss": e.val_loss})
        curves = pd.DataFrame(rows, columns=["run_id", "cost", "val_loss"]).dropna()
        out[comp.name] = at_matched_cost(table, curves[curves["cost"] > 0], (comp.control, *comp.treatments))
    return out
