"""A study's result: the ordered list of readouts (`READOUTS`) and the `StudyReadout` that computes and
renders them. This is the one place that knows the kinds of result: adding a kind is one module in
`results/readouts/` and one line in `READOUTS`; the orchestrator and the CLI only hand over the study's
plain data (`readouts.base.StudyData`) and print, write or publish what comes back.

The order is the order of everything a study shows: a sequential study's primary result, a gates study's (its
headline), then the paired table (the study's headline otherwise: its export, its MLflow table, the experiment's
description), the declared costs as
ratio rows, the declared mechanisms as paired delta rows with the depth profiles, the ladder, the contrasts, the
downstream tasks, the interventions' knock-out effects, then the training curves (plots only). The terminal
text, the report's facts, sections and plots, the artifact files and the MLflow series all follow it; an export
follows it within each readout's `export_rank`.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import pandas as pd

from reslab.results.collect import pairs_table, usable
from reslab.results.export import TEXT_EXPORTS, write_export
from reslab.results.plots import Plot
from reslab.results.readouts.base import Headline, Readout, Series, StudyData, Style, TableFormat
from reslab.results.readouts.contrasts import ContrastsReadout
from reslab.results.readouts.costs import CostsReadout
from reslab.results.readouts.curves import CurvesReadout
from reslab.results.readouts.gates import GatesReadout
from reslab.results.readouts.interventions import InterventionsReadout
from reslab.results.readouts.ladder import LadderReadout
from reslab.results.readouts.mechanisms import MechanismsReadout
from reslab.results.readouts.paired import PairedReadout
from reslab.results.readouts.sequential import SequentialReadout
from reslab.results.readouts.tasks import TasksReadout
from reslab.results.report import figures_html, render_report

__all__ = ["READOUTS", "Publication", "StudyData", "StudyReadout"]

READOUTS: tuple[Readout, ...] = (SequentialReadout(), GatesReadout(), PairedReadout(), CostsReadout(),
                                 MechanismsReadout(), LadderReadout(), ContrastsReadout(), TasksReadout(),
                                 InterventionsReadout(), CurvesReadout())


@dataclass(frozen=True)
class Publication:
    """What the submission's parent MLflow run gets besides the files: the headline table (an MLflow table,
    `Readout.headline`), further MLflow tables (artifact file -> table), metric series, and for the experiment's
    description the headline table as Markdown and its answer in one line."""

    table: pd.DataFrame
    table_md: str
    answer: str
    tables: dict[str, pd.DataFrame] = field(default_factory=dict)
    series: Series = field(default_factory=dict)


class StudyReadout:
    """Every readout of one study, computed once from its data (each readout's `narrow` applied first);
    `readouts`: `READOUTS` as it is when the study is read."""

    def __init__(self, data: StudyData, readouts: tuple[Readout, ...] | None = None) -> None:
        readouts = READOUTS if readouts is None else readouts
        for readout in readouts:
            data = readout.narrow(data)
        self.data = data
        self.readouts = readouts
        self._results: dict[str, Any] = {}

    def _result(self, readout: Readout) -> Any:
        """The readout's result, computed on first use: an export needs the readouts that export alone."""
        if readout.name not in self._results:
            self._results[readout.name] = readout.compute(self.data)
        return self._results[readout.name]

    @property
    def results(self) -> list[tuple[Readout, Any]]:
        """(readout, its result) for every readout the study has a result of, in order."""
        return [(r, result) for r in self.readouts if (result := self._result(r)) is not None]

    @property
    def headline(self) -> Headline:
        """The study's headline (`Readout.headline`): the first readout in the list that gives one (only the
        readouts up to it are computed)."""
        for readout in self.readouts:
            if type(readout).headline is not Readout.headline and (result := self._result(readout)) is not None:
                headline = readout.headline(result, self.data)
                if headline is not None:
                    return headline
        raise ValueError(f"no readout of {[r.name for r in self.readouts]} gives a headline")

    @property
    def runs(self) -> pd.DataFrame:
        return self.data.runs

    @property
    def pairs(self) -> pd.DataFrame:
        """One row per seed of each comparison with both arms' run ids and values (`results.collect.pairs_table`)."""
        return pairs_table(self.data.runs, self.data.comparisons)

    @property
    def table(self) -> pd.DataFrame:
        """The headline table (`headline`)."""
        return self.headline.table

    def status_lines(self) -> str:
        """How many runs finished, and each one that did not with what it recorded (`reslab compare`)."""
        runs = self.data.runs
        lines = [f"{self.data.name}: {int(usable(runs).sum())}/{len(runs)} runs finished"]
        for run in runs[~usable(runs)].to_dict("records"):
            error = run.get("error")  # absent from a cache written by an older version
            why = f": {error}" if isinstance(error, str) else ""
            lines.append(f"  {run['status']} {run['arm']}/{run['grid_key'] or '-'}/s{run['seed']} {run['run_id']}{why}")
        return "\n".join(lines) + "\n"

    def unfinished(self) -> list[dict[str, Any]]:
        """The runs `status_lines` lists as not finished: run id, arm, grid point, seed, status and error."""
        runs = self.data.runs
        keys = ("run_id", "arm", "grid_key", "seed", "status", "error")
        return [{k: run.get(k) for k in keys} for run in runs[~usable(runs)].to_dict("records")]

    def json(self) -> dict[str, Any]:
        """Every readout's `--json` form (`Readout.json`) by its name, in order; kinds with nothing left out."""
        return {r.name: out for r, result in self.results if (out := r.json(result, self.data)) is not None}

    def text(self, style: Style = "plain") -> list[Any]:
        """Every readout's text in order: strings, and in the rich style rich renderables too."""
        return [item for readout, result in self.results for item in readout.text(result, self.data, style)]

    def print(self, stream: TextIO | None = None, style: Style = "plain") -> None:
        """Print the text: rich on a terminal (`style="rich"`), else byte for byte as `text` gives it."""
        stream = stream or sys.stdout
        renderables: list[Any] = []
        for item in [*self.text(style), ""]:
            if not isinstance(item, str):
                renderables.append(item)
                continue
            if renderables:  # a readout's rich renderables, one after the other
                from rich.console import Console

                Console(file=stream).print(*renderables, sep="\n")
                renderables = []
            stream.write(item)

    def plots(self) -> list[tuple[Plot, str]]:
        return [plot for readout, result in self.results for plot in readout.plots(result, self.data)]

    def facts(self) -> list[tuple[str, str]]:
        """The report's "What was run": the study's facts (`StudyData.facts`), what each readout's kind declares
        (`Readout.facts`), the comparisons and the code versions the runs recorded."""
        return [*self.data.facts, *(fact for readout in self.readouts for fact in readout.facts(self.data)),
                ("comparisons", "; ".join(c.describe() for c in self.data.comparisons)),
                ("code version", ", ".join(self.data.code_versions) or "unknown (no finished run recorded one)")]

    def report(self, workers: int = 1) -> str:
        """The study's one-page HTML report (`results.report.render_report`); `workers`: processes that may draw
        its figures (`results.plots.pngs_base64`)."""
        sections = [part for readout, result in self.results for part in readout.section(result, self.data)]
        return render_report(study=self.data.name, description=self.data.description, facts=self.facts(),
                             runs=self.data.runs, sections=sections, figures=figures_html(self.plots(), workers),
                             reproduce=self.data.reproduce, labels=self.data.labels)

    def export(self, path: str | Path, fmt: str) -> Path:
        """The study's result as a file for a paper (`results.export.write_export`): in Markdown and LaTeX each
        readout's tables (`Readout.tables`), then their appendices (the per-seed pairs with their run ids); in CSV and
        Parquet each readout's tidy rows (`Readout.rows`: the paired rows, then the kinds' own, each kind's columns
        after the earlier ones'), in the readouts' order within their `export_rank`. A readout that exports
        nothing is not computed."""
        exporting = sorted((r for r in self.readouts if _exports(r)), key=lambda r: r.export_rank)
        results = [(r, result) for r in exporting if (result := self._result(r)) is not None]
        if fmt not in TEXT_EXPORTS:
            rows = [frame for r, result in results if (frame := r.rows(result, self.data)) is not None]
            return write_export(path, fmt, rows=rows)
        tfmt: TableFormat = "md" if fmt == "md" else "latex"
        tables = [t for r, result in results for t in r.tables(result, self.data, tfmt)]
        tables += [t for r, result in results for t in r.appendix(result, self.data, tfmt)]
        return write_export(path, fmt, tables)

    def publish(self, out: Path) -> Publication:
        """Write every readout's files and `report.html` into `out`; returns what goes on MLflow beside them."""
        headline = self.headline
        published = Publication(headline.table, headline.markdown, headline.answer)
        for readout, result in self.results:
            published.tables.update(readout.artifacts(result, self.data, out))
            published.series.update(readout.series(result, self.data))
        (out / "report.html").write_text(self.report(), encoding="utf-8")
        return published


def _exports(readout: Readout) -> bool:
    """Whether the readout puts anything in an export file (overrides `tables`, `appendix` or `rows`)."""
    return any(getattr(type(readout), name) is not getattr(Readout, name) for name in ("tables", "appendix", "rows"))
