"""The downstream-tasks readout: per (comparison, treatment, grid point, task) the control's and treatment's
accuracy on the same items, the paired delta with its two-level interval (seeds x items, `results.tasks`), p and
Holm p over the tasks, the shares of variance from seeds and items, and the suite average; in the terminal, the
report (a table and a forest plot per task), the artifacts (`tasks.csv`, an MLflow table) and MLflow series."""

from __future__ import annotations

import html
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from reslab.results.export import PRINT_FORMATS, Model, latex_escape, render_model, tex_float, tex_text
from reslab.results.plots import DPI, Plot
from reslab.results.readouts.base import Readout, Series, StudyData, Style, TableFormat
from reslab.results.tasks import SUITE, task_table

__all__ = ["TASK_HEAD", "TasksReadout", "format_tasks", "task_cells", "task_forest", "task_model", "tasks_text"]

TASK_HEAD = ("task", "treatment vs control", "control", "treatment", "delta [CI]", "p", "Holm p", "seeds/items share",
             "seeds x items", "method")


def _points(x: float) -> str:
    return "-" if x is None or math.isnan(x) else f"{100 * x:.1f}"


def _task_p(x: float) -> str:
    return "-" if x is None or math.isnan(x) else f"{x:.3g}"


def task_cells(r: dict) -> list[str]:
    """One task row's cells (`TASK_HEAD`): accuracies and the delta in points (x100)."""
    share = "-" if math.isnan(r["share_seeds"]) else f"{r['share_seeds']:.0%}/{r['share_items']:.0%}"
    return [r["task"], f"{r['treatment']} vs {r['control']}", _points(r["control_mean"]),
            _points(r["treatment_mean"]),
            f"{100 * r['delta']:+.1f} [{_points(r['ci_low'])}, {_points(r['ci_high'])}]", _task_p(r["p"]),
            _task_p(r["p_holm"]), share, f"{r['n_seeds']} x {r['n_items']}", r["method"]]


def task_model(tasks: pd.DataFrame) -> tuple[Model, list[str]]:
    """The downstream task rows (`results.tasks.task_table`) as `table_model` gives the paired rows: one block
    per (comparison, grid point), and the lines that explain them."""
    blocks = []
    for (comparison, grid_key), block in tasks.groupby(["comparison", "grid_key"], sort=False):
        where = f" [{grid_key}]" if grid_key else ""
        blocks.append((f"downstream tasks, {comparison}{where}: treatment - control on the same items, in points",
                       list(TASK_HEAD), [task_cells(r) for r in block.to_dict("records")]))
    lines = ["intervals over seeds x items (variance components, Satterthwaite t): both the training seed and the "
             "benchmark's items vary; Holm over each comparison's tasks; the suite average weights every task "
             "equally; one seed pair: McNemar's exact test, its interval over items only"]
    return blocks, lines


def format_tasks(tasks: pd.DataFrame, fmt: str = "md") -> str:
    """The downstream task rows as Markdown (``"md"``) or aligned plain text (``"text"``), like `format_table`."""
    if fmt not in PRINT_FORMATS:
        raise ValueError(f"unknown print format {fmt!r}; allowed: {list(PRINT_FORMATS)}")
    return render_model(*task_model(tasks), fmt) if len(tasks) else "no task rows\n"


def _tasks_latex(tasks: pd.DataFrame) -> str:
    """The downstream task rows (`task_model`) as one booktabs float per block, like the cost rows'."""
    blocks, lines = task_model(tasks)
    explain = " ".join(tex_text(line) + "." for line in lines)
    out: list[str] = []
    for caption, header, rows in blocks:
        body = [" & ".join(latex_escape(c) for c in row) + " \\\\" for row in rows]
        out += tex_float("\\footnotesize", tex_text(caption) + ".", "ll" + "r" * (len(header) - 3) + "l",
                         [latex_escape(h) for h in header], body,
                         f"\\par\\smallskip\\parbox{{\\linewidth}}{{\\scriptsize {explain}}}")
    return "\n".join(out)


def _task_rows(tasks: pd.DataFrame) -> pd.DataFrame:
    """The task rows in the paired table's columns (CSV, Parquet): `role` task, `delta` treatment - control,
    its value in `mean_delta` and p in `p_primary`; the task's own columns after."""
    rows = tasks.rename(columns={"delta": "mean_delta", "p": "p_primary"})
    return rows.assign(role="task", delta="treatment - control")


HEAD = ("comparison", *TASK_HEAD)


def _cells(r: dict, labels: Callable[[str], str] = str) -> list[str]:
    """A task row's cells (`HEAD`): its comparison and grid point, then the export's task cells; `labels`: how
    a grid point is named (the report: its short label)."""
    where = f" [{labels(r['grid_key'])}]" if r["grid_key"] else ""
    return [f"{r['comparison']}{where}", *task_cells(r)]


def tasks_text(table: pd.DataFrame, alpha: float = 0.05) -> str:
    """The task rows for the terminal: a fixed-width table, the accuracies and deltas in points (x100)."""
    rows = [list(HEAD)] + [_cells(r) for r in table.to_dict("records")]
    widths = [max(len(row[c]) for row in rows) for c in range(len(HEAD))]
    lines = [f"downstream tasks: treatment - control on the same items, in points; {1 - alpha:.0%} intervals over "
             "seeds x items (variance components, Satterthwaite t); Holm over each comparison's tasks; one seed "
             "pair: McNemar's exact test"]
    lines += ["  " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows]
    flagged = [f"  {r['task']} ({r['treatment']} vs {r['control']}): {r['flags']}" for r in table.to_dict("records")
               if r["flags"] and r["task"] != SUITE]
    return "\n".join(lines + flagged) + "\n"


def task_forest(table: pd.DataFrame, task: str, point: Callable[[str], str] = str) -> Plot:
    """One task's forest plot: each (comparison, treatment, grid point)'s delta with its two-level interval
    and, thinner, the item-only interval one model's stderr would give; `point` names a grid point (the
    report: its short label)."""
    rows = table[table["task"] == task].to_dict("records")
    labels = [f"{r['treatment']} vs {r['control']}" + (f" [{point(r['grid_key'])}]" if r["grid_key"] else "")
              for r in rows]
    from matplotlib.figure import Figure  # on first plot (issue 39)

    fig = Figure(figsize=(5.5 + 0.07 * max(map(len, labels), default=0), max(2.0, 0.45 * len(rows) + 1.2)), dpi=DPI,
                 layout="constrained")
    ax = fig.add_subplot()
    y = np.arange(len(rows))[::-1].astype(float)
    delta = np.array([100 * r["delta"] for r in rows])
    low, high = (np.array([100 * r[k] for r in rows]) for k in ("ci_low", "ci_high"))
    item_low, item_high = (np.array([100 * r[k] for r in rows]) for k in ("item_ci_low", "item_ci_high"))
    ax.axvline(0.0, color="0.5", lw=1, ls="--", label="no difference (delta = 0)")
    ax.hlines(y, low, high, color="C0", lw=2, label="seeds x items interval")
    ax.hlines(y - 0.15, item_low, item_high, color="C1", lw=1, label="items-only interval")
    ax.plot(delta, y, "o", color="C0")
    ax.set_yticks(y, labels)
    ax.set_xlabel(f"{task}: treatment - control ({rows[0]['metric'] if rows else ''}, points)")
    ax.legend(loc="best", fontsize="small")
    return Plot(f"tasks_{task}", fig, {"delta": delta, "ci_low": low, "ci_high": high, "labels": labels})


class TasksReadout(Readout):
    name = "tasks"

    def compute(self, data: StudyData) -> pd.DataFrame | None:
        items = data.task_items
        if items.empty or not data.comparisons:
            return None
        table = task_table(items, data.comparisons, alpha=data.alpha)
        return table if len(table) else None

    def text(self, result: pd.DataFrame, data: StudyData, style: Style) -> list[Any]:
        return [tasks_text(result, data.alpha)]

    def tables(self, result: pd.DataFrame, data: StudyData, fmt: TableFormat) -> list[str]:
        """The task rows' own tables (`task_model`): one per comparison and grid point."""
        return [format_tasks(result, "md") if fmt == "md" else _tasks_latex(result)]

    def rows(self, result: pd.DataFrame, data: StudyData) -> pd.DataFrame:
        return _task_rows(result)

    def section(self, result: pd.DataFrame, data: StudyData) -> list[str]:
        rows = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in _cells(r, data.labels)) + "</tr>"
                       for r in result.to_dict("records"))
        head = "".join(f"<th>{html.escape(h)}</th>" for h in HEAD)
        return ["<h2>Downstream tasks</h2>",
                f"<p>Treatment - control on the same items, in points (accuracy x 100); {1 - data.alpha:.0%} intervals "
                "over seeds x items (variance components with a Satterthwaite t: both the training seed and the "
                "benchmark's items vary); Holm over each comparison's tasks; the suite average weights every task "
                "equally. One seed pair: McNemar's exact test, and the interval counts items only.</p>",
                f'<table id="tasks"><thead><tr>{head}</tr></thead><tbody>{rows}</tbody></table>']

    def plots(self, result: pd.DataFrame, data: StudyData) -> list[tuple[Plot, str]]:
        return [(task_forest(result, task, data.labels), f"{task}: paired delta per comparison, seeds x items "
                 "interval (thick) and the items-only interval (thin)") for task in dict.fromkeys(result["task"])]

    def artifacts(self, result: pd.DataFrame, data: StudyData, out: Path) -> dict[str, pd.DataFrame]:
        result.to_csv(out / "tasks.csv", index=False)
        for plot, _ in self.plots(result, data):
            plot.save(out / f"{plot.name.replace(' ', '_')}.png")
        return {"tasks_table.json": result}

    def series(self, result: pd.DataFrame, data: StudyData) -> Series:
        out: Series = {}
        for r in result.to_dict("records"):
            key = f"task_delta/{r['comparison']}/{r['treatment']}/{r['task'].replace(' ', '_')}"
            out[key + (f"/{r['grid_key']}" if r["grid_key"] else "")] = [(0, float(r["delta"]))]
        return out
