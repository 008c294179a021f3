"""The paired readout: per comparison, treatment and grid point, the seed-paired deltas with their
interval, tests and verdict (`results.stats.compare`); comparisons at equal FLOPs or wall-clock read
each arm's eval curve at the matched cost (`results.equal_cost`) first. Its table is the study's
headline: the export, the MLflow table and the experiment's description are it."""

from __future__ import annotations

import html
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from reslab.results.collect import pairs_table
from reslab.results.comparison import Comparison
from reslab.results.equal_cost import at_matched_cost
from reslab.results.export import Labels, format_pairs, format_table, rich_renderables, table_latex, table_model
from reslab.results.plots import Plot, forest_plot, sweep_curve
from reslab.results.readouts.base import Headline, Readout, StudyData, Style, TableFormat, listed
from reslab.results.report import exploratory_notes, model_tables
from reslab.results.stats import compare, grid_parts

__all__ = ["PairedReadout", "PairedResult", "paired_section", "verdict_line"]


@dataclass(frozen=True)
class PairedResult:
    table: pd.DataFrame  # results.stats.compare: one row per comparison, treatment and grid point
    pairs: pd.DataFrame  # results.collect.pairs_table: one row per seed with both run ids


HEADLINE_CHARS = 60  # what the collapsed description shows on one line beside MLflow's assistant panel at 1400 px


def verdict_line(table: pd.DataFrame, most: int = 3) -> str:
    """The paired table's answer in one line, for the experiment's collapsed description on MLflow: each
    row's treatment against its control, verdict and mean delta (the first `most` rows, then how many more),
    or, where that would not fit the collapsed description's one line (`HEADLINE_CHARS`), the rows counted
    by verdict against their controls (the table below it gives each row)."""
    rows = table.to_dict("records") if len(table) else []
    parts = [f"{r['treatment']} vs {r['control']}{f' [{g}]' if (g := r.get('grid_key')) else ''}: {r['verdict']} "
             f"({r['mean_delta']:+.3g} {r['metric']})" for r in rows[:most]]
    more = f"; {len(rows) - most} more row(s)" if len(rows) > most else ""
    line = "; ".join(parts) + more
    if not parts:
        return "no comparison rows"
    if len(line) <= HEADLINE_CHARS:
        return line
    counts = Counter(str(r["verdict"]) for r in rows)
    controls = ", ".join(dict.fromkeys(str(r["control"]) for r in rows))
    return f"{', '.join(f'{n} {v}' for v, n in counts.most_common())} of {len(rows)} rows vs {controls}"


def _cost_curves(data: StudyData, comp: Comparison) -> pd.DataFrame:
    """Per eval of the comparison's runs: `run_id, cost, val_loss`, cost the run's FLOPs (`at: flops`) or
    training seconds (`at: wall_clock`, from its measured tokens/s) so far."""
    runs = data.runs
    run_of = {(a, g, int(s)): r for a, g, s, r in zip(runs["arm"], runs["grid_key"], runs["seed"], runs["run_id"],
                                                       strict=True)}
    speed = dict(zip(runs["run_id"], runs["tokens_per_s"], strict=True))
    rows = []
    evals = data.records.evals
    for e in evals[evals["arm"].isin((comp.control, *comp.treatments))].itertuples():
        run_id = run_of[e.arm, e.grid_key, int(e.seed)]
        if comp.at == "flops":
            c = data.costs[e.arm, e.grid_key]
            cost = e.step * (c.flops / c.steps)
        else:
            per_step = e.tokens / e.step if e.step else 0.0
            cost = e.step * per_step / speed.get(run_id, np.nan)
        rows.append({"run_id": run_id, "cost": cost, "val_loss": e.val_loss})
    curves = pd.DataFrame(rows, columns=["run_id", "cost", "val_loss"]).dropna()
    return curves[curves["cost"] > 0]


def _paired_table(table: pd.DataFrame, labels: Labels | None = None) -> str:
    """The paired table as the terminal prints it (`results.export.table_model`): per metric its caption,
    the arms' means, the delta and CI, raw and corrected p, d_z, g_z, W/L, verdict and notes; the legend below;
    grid points by their short labels."""
    blocks, legend = table_model(table, labels)
    if not blocks:
        return "<p>no comparison rows</p>"
    return model_tables(blocks, legend, "paired")


def paired_section(table: pd.DataFrame, labels: Labels | None = None,
                   notes: Mapping[str, str] | None = None) -> list[str]:
    """The paired table under the sentence that says what its columns are: the `p` column is the raw
    sign-flip p, the correction's column (`Holm p`, `BH p`) the p after the family's correction; above it, each
    comparison whose analysis changed after the plan was frozen (`notes`), marked exploratory."""
    blocks, _ = table_model(table)
    corrected = list(dict.fromkeys(header[header.index("p") + 1] for _, header, _ in blocks)) or ["Holm p"]
    return ["<h2>Paired comparisons</h2>",
            "<p>delta = treatment - control on the same grid point and seed; CI is the paired-t interval (a pooled "
            "row's: the shifts its stratified sign flip does not reject); "
            "p is the raw two-sided sign-flip permutation p (equivalence rows: its TOST p), before any correction; "
            f"{html.escape(' / '.join(corrected))} is that p after the family's correction, which the verdict "
            "reads.</p>",
            *exploratory_notes(notes or {}, table["comparison"]),
            _paired_table(table, labels)]


PAIRED_LISTS = {"seeds": ",", "control_run_ids": ";", "treatment_run_ids": ";", "missing": ";", "flags": ";"}


class PairedReadout(Readout):
    name = "paired"

    def compute(self, data: StudyData) -> PairedResult:
        values = {comp.name: at_matched_cost(data.runs, _cost_curves(data, comp), (comp.control, *comp.treatments))
                  for comp in data.comparisons if comp.at != "tokens"}
        table = compare(data.runs, list(data.comparisons), alpha=data.alpha, values=values)
        return PairedResult(table, pairs_table(data.runs, data.comparisons))

    def text(self, result: PairedResult, data: StudyData, style: Style) -> list[Any]:
        if style == "rich":
            return rich_renderables(result.table)
        return [format_table(result.table, "md" if style == "md" else "text")]

    def section(self, result: PairedResult, data: StudyData) -> list[str]:
        return paired_section(result.table, data.labels, data.analysis_notes)

    def headline(self, result: PairedResult, data: StudyData) -> Headline:
        """The paired table: the study's headline."""
        return Headline(result.table, format_table(result.table, "md"), verdict_line(result.table))

    def tables(self, result: PairedResult, data: StudyData, fmt: TableFormat) -> list[str]:
        """The paired table, the export's first (`results.export.export_table`)."""
        return [format_table(result.table, "md") if fmt == "md" else table_latex(result.table)]

    def appendix(self, result: PairedResult, data: StudyData, fmt: TableFormat) -> list[str]:
        """One row per seed with both arms' run ids, below every table (`results.export.format_pairs`)."""
        return [format_pairs(result.pairs, fmt)]

    def rows(self, result: PairedResult, data: StudyData) -> pd.DataFrame:
        """The paired rows: every column of the table, run ids included."""
        return result.table

    def json(self, result: PairedResult, data: StudyData) -> list[dict[str, Any]]:
        """The paired rows, every column, the seeds, run ids, missing seeds and notes as lists."""
        return listed(result.table.to_dict("records"), PAIRED_LISTS)

    def _sweeps(self, result: PairedResult, data: StudyData) -> list[str]:
        axes = {name for key in result.table["grid_key"] for name, _ in grid_parts(key or "")}
        return [axis for axis in data.grid_axes if axis in axes]  # rows pooled over an axis have no value on it

    def plots(self, result: PairedResult, data: StudyData) -> list[tuple[Plot, str]]:
        if result.table.empty:
            return []
        plots = [(forest_plot(result.table, data.labels), "Paired deltas with CIs; shaded: the MEI or equivalence "
                                                          "margin; filled: significant after the family correction.")]
        plots += [(sweep_curve(result.table, axis), f"Paired delta against {axis} with its CI band; the control is 0.")
                  for axis in self._sweeps(result, data)]
        return plots

    def artifacts(self, result: PairedResult, data: StudyData, out: Path) -> dict[str, pd.DataFrame]:
        result.table.to_csv(out / "paired_table.csv", index=False)
        if not result.table.empty:
            forest_plot(result.table, data.labels).save(out / "forest.png")
            for axis in data.grid_axes:
                sweep_curve(result.table, axis).save(out / f"sweep_{axis}.png")
        return {}
