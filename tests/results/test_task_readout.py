"""The downstream-tasks readout (`results.readouts.tasks`): from a study's item table to the terminal's task rows,
the report's section and forest plots (one per task), the artifact files and the MLflow series; a study without
evaluated items has no task result."""

import numpy as np
import pandas as pd
import pytest

from reslab.results.comparison import Comparison
from reslab.results.readouts.base import StudyData
from reslab.results.readouts.tasks import TasksReadout
from reslab.results.tasks import SUITE

COMP = Comparison(name="main", control="base", treatments=("attn",))


def items(seeds=(0, 1, 2), tasks=("next_line", "other"), n=60):
    rng = np.random.default_rng(3)
    rows = []
    for task in tasks:
        for s in seeds:
            for arm, p in (("base", 0.4), ("attn", 0.55)):
                rows += [{"arm": arm, "grid_key": "", "seed": s, "task": task, "metric": "acc", "doc_id": str(i),
                          "value": float(rng.random() < p)} for i in range(n)]
    return pd.DataFrame(rows)


def study(frame):
    return StudyData(name="s", runs=pd.DataFrame(), comparisons=(COMP,), read_task_items=lambda: frame)


def test_rows_text_section_plots_artifacts_series(tmp_path):
    data = study(items())
    readout = TasksReadout()
    table = readout.compute(data)
    assert list(table["task"]) == ["next_line", "other", SUITE]
    text = "".join(readout.text(table, data, "plain"))
    lines = text.splitlines()
    assert lines[0].startswith("downstream tasks: treatment - control on the same items")
    row = next(line for line in lines if "next_line" in line)
    r = table.iloc[0]
    assert f"{100 * r['delta']:+.1f} [{100 * r['ci_low']:.1f}, {100 * r['ci_high']:.1f}]" in row
    assert "3 x 60" in row and "two-way" in row
    section = "\n".join(readout.section(table, data))
    assert '<table id="tasks">' in section and section.count("<tr>") == 4
    plots = readout.plots(table, data)
    assert [p.name for p, _ in plots] == ["tasks_next_line", "tasks_other", f"tasks_{SUITE}"]
    assert plots[0][0].data["delta"] == pytest.approx([100 * r["delta"]])
    tables = readout.artifacts(table, data, tmp_path)
    assert "tasks_table.json" in tables and (tmp_path / "tasks.csv").is_file()
    assert (tmp_path / "tasks_next_line.png").is_file() and (tmp_path / "tasks_suite_average.png").is_file()
    series = readout.series(table, data)
    assert series["task_delta/main/attn/next_line"] == [(0, pytest.approx(r["delta"]))]


def test_no_items_no_result():
    assert TasksReadout().compute(study(items().iloc[:0])) is None


def test_task_rows_in_every_export_format(tmp_path):
    """The readout's export tables and rows (`Readout.tables`, `Readout.rows`) as `StudyReadout.export` writes them
    after the paired table (`results.export.write_export`): in Markdown and LaTeX their own table, in CSV and
    Parquet rows (`role` task) whose numbers read back equal to the task table's."""
    from reslab.results.export import CSV_NA_REP, export_table, table_latex, write_export
    from reslab.results.stats import COMPARE_COLUMNS

    data = study(items())
    readout = TasksReadout()
    table = readout.compute(data)
    paired = pd.DataFrame(columns=list(COMPARE_COLUMNS))
    r = table.iloc[0]
    cell = f"{100 * r['delta']:+.1f} [{100 * r['ci_low']:.1f}, {100 * r['ci_high']:.1f}]"

    def export(name, fmt):
        if fmt in ("md", "latex"):
            first = export_table(paired, tmp_path / f"p{name}", fmt).read_text()
            return write_export(tmp_path / name, fmt, [first, *readout.tables(table, data, fmt)])
        return write_export(tmp_path / name, fmt, rows=[paired, readout.rows(table, data)])

    md = export("t.md", "md").read_text()
    assert "downstream tasks, main: treatment - control on the same items, in points" in md
    assert md.count("| next_line |") == 1 and cell in md and "3 x 60" in md
    tex = export("t.tex", "latex").read_text()
    assert tex.startswith(table_latex(paired)) and "\\begin{table*}" in tex[len(table_latex(paired)):]
    assert "next\\_line" in tex and f"{100 * r['delta']:+.1f}" in tex
    csv = pd.read_csv(export("t.csv", "csv"), keep_default_na=False, na_values=[CSV_NA_REP])
    parquet = pd.read_parquet(export("t.parquet", "parquet"))
    for back in (csv, parquet):
        assert list(back["role"]) == ["task"] * len(table) and list(back["task"]) == list(table["task"])
        assert back["mean_delta"].to_numpy() == pytest.approx(table["delta"].to_numpy())
        assert back["p_primary"].to_numpy() == pytest.approx(table["p"].to_numpy())
        assert back["ci_low"].to_numpy() == pytest.approx(table["ci_low"].to_numpy())
