"""Collecting runs, paired statistics, power, exports, and a study's readouts.

``comparison`` is the one declared-comparison type (the study spec builds it); ``collect`` turns
MLflow records into the tidy runs table (one row per run) and holds the one test of a usable run and
the one seed matcher (`usable`, `matched_seeds`); ``stats`` turns the runs table into seed-paired
comparison rows; ``power`` says what a comparison can show before anything runs; ``export`` renders
and writes the rows; ``scaling`` fits loss against compute across a ladder of sizes, the
compute-equivalent multiplier with a paired seed bootstrap and the paired trend test, and ``ladder``
reads a study's ladder out with it; ``projection`` projects a ladder's laws to a target compute (the gap,
k and the throughput-adjusted k with intervals, a backtest) and ``gates`` promotes treatments up a ladder
gate by gate on them, with the simulation of what that saves; ``contrasts`` tests weighted sums of arms
on per-seed values and the fraction of a gain a cheaper arm keeps; ``costs`` reads declared cost metrics as seed-paired
ratios treatment / control and finds the arms' loss-cost Pareto front; ``sequential`` is the anytime-valid
test of a sequential study; ``equal_cost`` reads eval curves at a matched FLOPs or wall-clock; ``plots`` and ``report``
draw and lay out the one-page HTML report; ``records`` aggregates what the runs recorded while training
(depth profiles, routing) over seeds.

A study's result is the ordered list of readouts in ``readout`` (`READOUTS`), one module each in
``readouts/`` behind one protocol (`readouts.base.Readout`), which owns every medium of its kind: text,
export tables and rows, report facts, section and plots, MLflow files and series. ``readout.StudyReadout``
computes and renders them from plain study data (`readouts.base.StudyData`), which the orchestrator's
gatherer fills. Adding a kind of result is one module there and one line in the list.

All are pure functions of plain records, arrays or a pandas DataFrame; nothing here imports
experiments/ or the orchestrator.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from reslab.results.comparison import Comparison

if TYPE_CHECKING:
    from reslab.results.export import EXPORT_FORMATS, PRINT_FORMATS, export_table, format_table
    from reslab.results.stats import COMPARE_COLUMNS, benjamini_hochberg, compare, holm, paired_summary

# loaded on first use: the study spec needs `Comparison` only, and `export`/`stats` bring pandas
# and scipy (about 1 s), which neither a submission's driver nor a Ray worker needs
_LAZY = {
    "EXPORT_FORMATS": "export", "PRINT_FORMATS": "export", "export_table": "export", "format_table": "export",
    "COMPARE_COLUMNS": "stats", "benjamini_hochberg": "stats", "compare": "stats", "holm": "stats",
    "paired_summary": "stats",
}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)

__all__ = [
    "COMPARE_COLUMNS",
    "EXPORT_FORMATS",
    "PRINT_FORMATS",
    "Comparison",
    "benjamini_hochberg",
    "compare",
    "export_table",
    "format_table",
    "holm",
    "paired_summary",
]
