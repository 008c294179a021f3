"""The sequential readout: a sequential study's primary result. Per comparison, grid point and
treatment, its path through the design's looks on the seed-paired deltas (`results.sequential`), the
decision, the confidence sequence and the e-value; the fixed-n paired table that follows it is
descriptive. A sequential study's runs are the ones its looks released: the others (later seeds, and
at a later look the arms of rows already decided) have no record, and `narrow` leaves them out of every
readout."""

from __future__ import annotations

import html
import math
import re
from dataclasses import replace
from pathlib import Path
from typing import Any

import pandas as pd

from reslab.results.collect import pairs_table, recorded
from reslab.results.plots import Plot, sequence_plot
from reslab.results.readouts.base import Readout, Series, StudyData, Style
from reslab.results.report import Labels, figure, no_labels
from reslab.results.report import cell_number as _num
from reslab.results.sequential import TEST_WORDS, sequential_table, sequential_text

__all__ = ["SequentialReadout", "sequence_series", "sequential_section"]

DESCRIPTIVE = ("the fixed-n table below is descriptive only: its p-values assume a number of seeds fixed in advance, "
               "which a sequential study does not have\n")


def sequence_series(table: pd.DataFrame) -> Series:
    """A sequential study's rows as MLflow metric series stepped by seeds, so the parent run's charts show
    each confidence sequence narrowing: `sequence/<comparison>/<treatment>[/<grid point>]/` + `mean_delta`,
    `cs_low`, `cs_high` (while bounded) and `looks` (1 at each look, the last one the stop)."""
    out: Series = {}
    for r in table.to_dict("records"):
        where = f"/{r['grid_key']}" if r["grid_key"] else ""
        key = re.sub(r"[^\w./ -]", "_", f"sequence/{r['comparison']}/{r['treatment']}{where}")
        for i, name in enumerate(("mean_delta", "cs_low", "cs_high"), start=1):
            points = [(int(b[0]), float(b[i])) for b in r["by_seed"] if math.isfinite(b[i])]
            if points:
                out[f"{key}/{name}"] = points
        out[f"{key}/looks"] = [(int(p[0]), 1.0) for p in r["path"]]
    return out


_DECIDED_ON_CS = ("better", "worse")
_NOT_USED = "(a)"


def _tost_cell(r: dict[str, Any]) -> str:
    """A row's equivalence bounds against its ±bound; `-` without a bound (no equivalence verdict); marked
    `(a)` on a row the confidence sequence decided (better/worse), whose bounds are of another width."""
    bound = r["bound"]
    if bound is None or (isinstance(bound, float) and math.isnan(bound)):
        return "-"
    text = f"[{_num(r['tost_low'])}, {_num(r['tost_high'])}] vs ±{_num(bound)}"
    return f"{text} {_NOT_USED}" if r["decision"] in _DECIDED_ON_CS else text


def _sequential_note(table: pd.DataFrame) -> str:
    decided = [r for r in table.to_dict("records") if r["decision"] in _DECIDED_ON_CS and _tost_cell(r) != "-"]
    if not decided:
        return ""
    return (f'<ul class="legend"><li>{_NOT_USED} decided on its confidence sequence (the CS column, two-sided at '
            "the row's level), which lies past 0. The equivalence bounds beside it are another interval: the two "
            "one-sided sequences, each at the row's level (TOST), so narrower than the CS; they test equivalence "
            "within ±the bound (the MEI), shown for reference, and did not decide the row.</li></ul>")


def sequential_section(table: pd.DataFrame | None, plot: Plot | None = None,
                       labels: Labels = no_labels) -> list[str]:
    """A sequential study's primary result: each row's decision, the seeds it took, its confidence sequence
    and e-value; the plot of the sequences narrowing seed by seed; the fixed-n table above marked descriptive."""
    if table is None or table.empty:
        return []
    head = ("comparison", "grid point", "treatment", "decision", "seeds", "looks", "mean delta", "CS",
            "equivalence bounds", "e-value")
    rows = []
    for r in table.to_dict("records"):
        cells = [r["comparison"], labels(r["grid_key"]) if r["grid_key"] else "-",
                 f"{r['treatment']} vs {r['control']}", r["decision"]]
        tost = _tost_cell(r)
        numbers = [str(r["n"]), ", ".join(map(str, r["looks"])), _num(r["mean_delta"]),
                   f"[{_num(r['cs_low'])}, {_num(r['cs_high'])}]", tost, _num(r["e_value"], "{:.3g}")]
        rows.append("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in cells)
                    + "".join(f'<td class="num">{html.escape(c)}</td>' for c in numbers) + "</tr>")
    out = ["<h2>Sequential test: the primary result</h2>",
           "<p>Seeds were added in batches and the anytime-valid test ("
           + html.escape(TEST_WORDS.get(table.attrs.get("test", "sign"), "")) + "; each row at alpha over its "
           "family's rows) read after each batch; a row stopped at the look that decided it. "
           "The confidence sequences cover at every look at once; the equivalence bounds are the two one-sided "
           "sequences (each at the row's level, as TOST) that an equivalence verdict needs within ±the bound; "
           "the fixed-n p-values of the paired table below are descriptive only.</p>",
           f'<table id="sequential"><thead><tr>{"".join(f"<th>{html.escape(h)}</th>" for h in head)}</tr></thead>'
           f"<tbody>{''.join(rows)}</tbody></table>", _sequential_note(table)]
    if plot is not None:
        out.append(figure(plot.png_base64(), "The mean delta and its confidence sequence seed by seed; dots are the "
                                              "looks, the red line the look that decided.", "sequence"))
    return out


class SequentialReadout(Readout):
    name = "sequential"

    def narrow(self, data: StudyData) -> StudyData:
        """The runs some look released (MLflow has a record of them); every run while none has one."""
        if data.sequential is None:
            return data
        released = recorded(data.runs)
        return replace(data, runs=data.runs[released].reset_index(drop=True)) if released.any() else data

    def compute(self, data: StudyData) -> pd.DataFrame | None:
        if data.sequential is None:
            return None
        return sequential_table(pairs_table(data.runs, data.comparisons), data.comparisons, data.sequential,
                                data.seeds, data.alpha)

    def text(self, result: pd.DataFrame, data: StudyData, style: Style) -> list[Any]:
        assert data.sequential is not None  # compute returned a table
        return [sequential_text(result, data.sequential) + DESCRIPTIVE]

    def json(self, result: pd.DataFrame, data: StudyData) -> list[dict[str, Any]]:
        """Each row's decision, seeds, looks, mean delta, confidence sequence, equivalence bounds and e-value; its
        path through the looks as objects (seeds, mean delta, the sequence's bounds)."""
        keys = ("seeds", "mean_delta", "cs_low", "cs_high")
        return [{**{k: v for k, v in r.items() if k != "by_seed"},
                 "path": [dict(zip(keys, p[:4], strict=True)) for p in r["path"]]} for r in result.to_dict("records")]

    def section(self, result: pd.DataFrame, data: StudyData) -> list[str]:
        """The sequential table and its plot, which leads the report (no plot among the others)."""
        plot = sequence_plot(result, data.labels) if any(len(s) for s in result["by_seed"]) else None
        return sequential_section(result, plot, data.labels)

    def artifacts(self, result: pd.DataFrame, data: StudyData, out: Path) -> dict[str, pd.DataFrame]:
        result.drop(columns=["path", "by_seed"]).to_csv(out / "sequential.csv", index=False)
        return {}

    def series(self, result: pd.DataFrame, data: StudyData) -> Series:
        return sequence_series(result)
