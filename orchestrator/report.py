"""Gathers a study's report: the paired table (`readout.compare_study`), per-eval curves and
diagnostics from the run directories, the plots of `results.plots`, rendered by `results.report`.

Curves and diagnostics come from the run directories (`orchestrator.records`), so a report needs no
MLflow metric history.
"""

from __future__ import annotations

import math
import re
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np
import pandas as pd

from reslab.experiments.expand import RunSpec
from reslab.experiments.spec import Study
from reslab.models.presets import resolve_model
from reslab.orchestrator.readout import StudyComparison, compare_study
from reslab.orchestrator.records import StudyRecords, study_records, tokens_per_step
from reslab.orchestrator.tracking.protocol import DriverTracker
from reslab.orchestrator.workspace import Workspace
from reslab.results.contrasts import contrast_text
from reslab.results.export import format_table
from reslab.results.ladder import ladder_text
from reslab.results.plots import (
    Plot,
    concentration_profile,
    deff_plot,
    delta_curve,
    forest_plot,
    loss_curves,
    routing_heatmaps,
    scaling_plot,
    sequence_plot,
    sweep_curve,
)
from reslab.results.report import Sections, contrast_section, ladder_section, render_report, sequential_section
from reslab.results.sequential import sequential_text
from reslab.results.stats import grid_parts

__all__ = ["build_report", "publish_study_result", "study_facts", "study_plots"]


def study_plots(study: Study, comparison: StudyComparison, records: StudyRecords) -> list[tuple[Plot, str]]:
    """Every plot the study's data supports, each with its caption."""
    plots: list[tuple[Plot, str]] = []
    table = comparison.table
    if not table.empty:
        plots.append((forest_plot(table), "Paired deltas with CIs; shaded: the MEI or equivalence margin; "
                                          "filled: significant after the family correction."))
        axes = {name for key in table["grid_key"] for name, _ in grid_parts(key or "")}
        for axis in study.grid:
            if axis.path in axes:  # rows pooled over an axis have no value on it
                plots.append((sweep_curve(table, axis.path), f"Paired delta against {axis.path} with its CI "
                                                             "band; the control is 0."))
    if comparison.ladder is not None:
        for (name, scope), ladders in comparison.ladder.arms.items():
            mults = {t: m for (c, s, t), m in comparison.ladder.multipliers.items() if (c, s) == (name, scope)}
            metric = next(c.metric for c in study.comparisons if c.name == name)
            at = f" at {scope}" if scope else ""
            plots.append((scaling_plot(ladders, mults, metric),
                          f"{name}{at}: loss against training FLOPs per arm (seeds as dots, min-max band, fitted "
                          "L(C) = E + A C^-alpha dashed), and each treatment's compute-equivalent multiplier k with "
                          "its interval, FLOPs and wall-clock."))
    if not records.evals.empty:
        plots.append((loss_curves(records.evals), "Validation loss against tokens: mean over seeds, min-max band."))
        evaluated = {arm: set(g[["grid_key", "seed", "tokens"]].itertuples(index=False))
                     for arm, g in records.evals.groupby("arm")}
        for comp in study.comparisons:
            for treatment in comp.treatments:
                if evaluated.get(comp.control, set()) & evaluated.get(treatment, set()):  # some eval is paired
                    plots.append((delta_curve(records.evals, comp.control, treatment),
                                  f"Paired validation-loss delta {treatment} - {comp.control} over training, "
                                  "mean over seeds with its paired-t CI."))
    # one colour scale over every grid point too, so an H-sweep's heatmaps compare across H
    vmax = max((float(np.nanmax(m)) for arms in records.routing.values() for m, _ in arms.values()), default=None)
    for point, arms in records.routing.items():
        at = f" at {point}" if point else ""
        plots.append((routing_heatmaps(arms, vmax=vmax), f"Routing weights{at} (last evaluation, mean over seeds), "
                                                        "one colour scale for every arm and grid point."))
        plots.append((concentration_profile(records.profiles[point]),
                      f"Routing concentration 1 - H/ln N per layer{at}."))
    if not records.depths.empty:
        plots.append((deff_plot(records.depths), "Effective depth D_eff per run (the participation ratio "
                                                 "L^2 / sum C_ij of the layers' debiased-CKA matrix C; the bar is "
                                                 "the mean over seeds), against F_L = 2L/(L+1), the D_eff of L "
                                                 "orthogonal, equal-norm updates: below F_L, the layers' updates "
                                                 "are correlated."))
    return plots


def _where(runs: list[RunSpec], study: Study) -> str:
    """The grid points that `runs` cover, or the arms (at a grid point) where only some arms are in."""
    all_arms = {a.name for a in study.arms}
    arms_at: dict[str, set[str]] = {}
    for run in runs:
        arms_at.setdefault(run.grid_key, set()).add(run.arm)
    places: list[str] = []
    for point, arms in sorted(arms_at.items()):
        if point and arms == all_arms:
            places.append(point)
        else:
            places += [f"{arm} at {point}" if point else arm for arm in sorted(arms)]
    return ", ".join(places)


def _over_runs(study: Study, runs: list[RunSpec], describe: Callable[[RunSpec], str]) -> str:
    """One fact over every run: its value when all runs share it, else each value with where it holds."""
    by_value: dict[str, list[RunSpec]] = {}
    for run in runs:
        by_value.setdefault(describe(run), []).append(run)
    if len(by_value) == 1:
        return next(iter(by_value))
    return "; ".join(f"{value} [{_where(rs, study)}]" for value, rs in by_value.items())


def _model(run: RunSpec) -> str:
    shape = resolve_model(run.config.model, vocab_size=1)  # the vocabulary does not change these sizes
    return (f"{run.config.model.preset}: d_model {shape.d_model}, {shape.n_layers} layers, {shape.n_heads} heads, "
            f"seq_len {shape.seq_len}")


def study_facts(study: Study, runs: list[RunSpec], code_versions: Iterable[str],
                finished_seeds: Iterable[int] = ()) -> list[tuple[str, str]]:
    """What was run, over every run of the study: a fact that differs between grid points (or arms)
    lists each value with the grid points (or arms) it holds for. A sequential study's seeds are the
    ones with a finished run (`finished_seeds`), out of its design's maximum."""
    arms = ", ".join(f"{a.name} ({a.residual})" for a in study.arms)
    grid = "; ".join(f"{a.path} = {', '.join(map(str, a.values))}" for a in study.grid) or "none"
    codes = sorted({c for c in code_versions if c})
    seeds = ", ".join(map(str, study.seeds))
    if study.sequential is not None:
        d, ran = study.sequential, [s for s in study.seeds if s in set(finished_seeds)]
        seeds = (f"sequential: {d.start}, +{d.batch} per look, at most {d.max}; {len(ran)} run "
                 f"({', '.join(map(str, ran)) or 'none yet'})")
    facts = [("arms", arms), ("seeds", seeds), ("grid", grid)]
    if runs:
        facts += [
            ("corpus", _over_runs(study, runs, lambda r: f"{r.config.data.corpus} ({r.config.data.tokenizer} "
                                                         "tokenizer)")),
            ("model", _over_runs(study, runs, _model)),
            ("tokens per run", _over_runs(study, runs, lambda r: f"{r.config.train.steps * tokens_per_step(r):,} "
                                                                 f"({r.config.train.steps} steps)")),
        ]
    facts += [("comparisons", "; ".join(c.describe() for c in study.comparisons)),
              ("code version", ", ".join(codes) or "unknown (no finished run recorded one)")]
    return facts


def build_report(study: Study, runs: list[RunSpec], workspace: Workspace, tracking_uri: str, *,
                 alpha: float = 0.05, cached: bool = False, comparison: StudyComparison | None = None) -> str:
    """The study's HTML report (see `results.report.render_report`)."""
    if comparison is None:
        comparison = compare_study(study, runs, workspace, tracking_uri, cached=cached, alpha=alpha)
    records = study_records(study, runs, workspace)
    sets = " ".join(f"--set {k}={v}" for k, v in study.overrides)
    spec = f"{study.path}{' ' + sets if sets else ''}"
    reproduce = [f"reslab run {spec}", f"reslab compare {spec}", f"reslab report {spec} -o report.html"]
    finished = comparison.runs[comparison.runs["status"] == "FINISHED"]
    facts = study_facts(study, runs, comparison.runs["code_version"].dropna(), finished["seed"].dropna().astype(int))
    return render_report(study=study.name, description=study.description, facts=facts,
                         table=comparison.table, runs=comparison.runs, plots=study_plots(study, comparison, records),
                         reproduce=reproduce,
                         sections=Sections(
                             lead=sequential_section(comparison.sequential, _sequence_plot(comparison)),
                             after=[*ladder_section(comparison.ladder), *contrast_section(comparison.contrasts)]))


def _sequence_plot(comparison: StudyComparison) -> Plot | None:
    table = comparison.sequential
    return sequence_plot(table) if table is not None and any(len(s) for s in table["by_seed"]) else None


def publish_study_result(study: Study, runs: list[RunSpec], workspace: Workspace, tracker: DriverTracker,
                         comparison: StudyComparison) -> str:
    """Put the study's result on this submission's parent MLflow run: the paired table (MLflow table
    and `paired_table.csv`), `forest.png`, `sweep_<axis>.png` per grid axis and `report.html`.
    Returns the parent's MLflow id."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        comparison.table.to_csv(out / "paired_table.csv", index=False)
        if not comparison.table.empty:
            forest_plot(comparison.table).save(out / "forest.png")
            for axis in study.grid:
                sweep_curve(comparison.table, axis.path).save(out / f"sweep_{axis.path}.png")
        tables = {}
        if comparison.ladder is not None:
            comparison.ladder.summary.to_csv(out / "ladder_summary.csv", index=False)
            comparison.ladder.rungs.to_csv(out / "ladder_rungs.csv", index=False)
            tables["ladder_table.json"] = comparison.ladder.summary
        if comparison.sequential is not None:
            comparison.sequential.drop(columns=["path", "by_seed"]).to_csv(out / "sequential.csv", index=False)
        if comparison.contrasts is not None:
            comparison.contrasts.to_csv(out / "contrasts.csv", index=False)
            tables["contrasts_table.json"] = comparison.contrasts
        page = build_report(study, runs, workspace, tracker.uri, comparison=comparison)
        (out / "report.html").write_text(page, encoding="utf-8")
        series = sequence_series(comparison.sequential) if comparison.sequential is not None else None
        return tracker.log_study_result(comparison.table, out, tables, series)


def sequence_series(table: pd.DataFrame) -> dict[str, list[tuple[int, float]]]:
    """A sequential study's rows as MLflow metric series stepped by seeds, so the parent run's charts show
    each confidence sequence narrowing: `sequence/<comparison>/<treatment>[/<grid point>]/` + `mean_delta`,
    `cs_low`, `cs_high` (while bounded) and `looks` (1 at each look, the last one the stop)."""
    out: dict[str, list[tuple[int, float]]] = {}
    for r in table.to_dict("records"):
        where = f"/{r['grid_key']}" if r["grid_key"] else ""
        key = re.sub(r"[^\w./ -]", "_", f"sequence/{r['comparison']}/{r['treatment']}{where}")
        for i, name in enumerate(("mean_delta", "cs_low", "cs_high"), start=1):
            points = [(int(b[0]), float(b[i])) for b in r["by_seed"] if math.isfinite(b[i])]
            if points:
                out[f"{key}/{name}"] = points
        out[f"{key}/looks"] = [(int(p[0]), 1.0) for p in r["path"]]
    return out


def sequential_lines(study: Study, comparison: StudyComparison) -> str:
    """A sequential study's primary result, and the line that makes the fixed-n table below it descriptive."""
    if comparison.sequential is None or study.sequential is None:
        return ""
    return (sequential_text(comparison.sequential, study.sequential)
            + "the fixed-n table below is descriptive only: its p-values assume a number of seeds fixed in advance, "
              "which a sequential study does not have\n")


def study_result(study: Study, runs: list[RunSpec], workspace: Workspace, tracker: DriverTracker,
                 publish: bool) -> str:
    """What `reslab run` prints after its runs: the paired table, the arms' tuned configs when they came
    from `--from-tune`, and (when `publish`, i.e. this submission has a parent run) the same result
    put on that parent run for the dashboard."""
    comparison = compare_study(study, runs, workspace, tracker.uri, write_cache=True)
    text = sequential_lines(study, comparison) + format_table(comparison.table, "text")
    if comparison.ladder is not None:
        text += ladder_text(comparison.ladder)
    if comparison.contrasts is not None:
        text += contrast_text(comparison.contrasts)
    tuned = [f"{a.name}: " + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in a.tuned)
             for a in study.arms if a.tuned]
    if tuned:
        text += "arms at their tuned configs: " + "; ".join(tuned) + "\n"
    if publish:
        publish_study_result(study, runs, workspace, tracker, comparison)
        text += (f"{study.name}: paired table, plots and report.html are on the submission's MLflow run "
                 "(`reslab dashboard`)\n")
    return text
