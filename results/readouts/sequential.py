"""The sequential readout: a sequential study's primary result. Per comparison, grid point and
treatment, its path through the design's looks on the seed-paired deltas (`results.sequential`), the
decision, the confidence sequence and the e-value; the fixed-n paired table that follows it is
descriptive. A sequential study's runs are the ones its looks released: the others (later seeds, and
at a later look the arms of rows already decided) have no record, and `narrow` leaves them out of every
readout."""

from __future__ import annotations

import math
import re
from dataclasses import replace
from pathlib import Path
from typing import Any

import pandas as pd

from reslab.results.collect import pairs_table, recorded
from reslab.results.plots import sequence_plot
from reslab.results.readouts.base import Readout, Series, StudyData, Style
from reslab.results.report import sequential_section
from reslab.results.sequential import sequential_table, sequential_text

__all__ = ["SequentialReadout", "sequence_series"]

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

    def section(self, result: pd.DataFrame, data: StudyData) -> list[str]:
        """The sequential table and its plot, which leads the report (no plot among the others)."""
        plot = sequence_plot(result, data.labels) if any(len(s) for s in result["by_seed"]) else None
        return sequential_section(result, plot, data.labels)

    def artifacts(self, result: pd.DataFrame, data: StudyData, out: Path) -> dict[str, pd.DataFrame]:
        result.drop(columns=["path", "by_seed"]).to_csv(out / "sequential.csv", index=False)
        return {}

    def series(self, result: pd.DataFrame, data: StudyData) -> Series:
        return sequence_series(result)
