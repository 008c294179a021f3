"""The cost readout through every way out of a study's result (`results.readout.StudyReadout`): the terminal
text (plain, Markdown, rich), every export format, the HTML report's section and plots, and what the parent
MLflow run gets (files, tables, series); on a synthetic runs table (`test_costs.runs_table`). The LaTeX compiles
where pdflatex is installed."""

from __future__ import annotations

import io
import re
import shutil
import subprocess

import pandas as pd
import pytest
from rich.table import Table
from test_costs import COMP, runs_table

from reslab.common.errors import ConfigError
from reslab.results.export import CSV_NA_REP, export_table
from reslab.results.readout import READOUTS, StudyData, StudyReadout
from reslab.results.stats import COMPARE_COLUMNS

COSTS = ("decode_tps", "decode_state_bytes")


def readout(runs: pd.DataFrame | None = None, costs: tuple[str, ...] = COSTS) -> StudyReadout:
    return StudyReadout(StudyData(name="s", runs=runs_table() if runs is None else runs, comparisons=(COMP,),
                                  grid_axes=("optim.lr",), cost_metrics=costs))


def test_the_costs_follow_the_paired_table_in_the_terminal():
    r = readout()
    assert [x.name for x, _ in r.results] == ["paired", "costs", "curves"]
    out = io.StringIO()
    r.print(out)
    text = out.getvalue()
    paired_at, cost_at = text.index("val_loss_tail (nats/token)"), text.index("cost decode_tps (tokens/s)")
    assert paired_at < cost_at < text.index("cost decode_state_bytes (bytes/token), lower is better")
    lines = text[cost_at:].splitlines()
    assert lines[1].split() == ["comparison", "optim.lr", "control", "treatment", "n", "control", "geo.", "mean",
                                "treatment", "geo.", "mean", "ratio", "[95%", "CI]", "W/L", "verdict", "notes"]
    attnres = next(x for x in lines if x.startswith("main") and "attnres" in x)
    assert re.search(r"0\.001 +control +attnres +5 +\d+\.\d +\d+\.\d +0\.\d+ \[0\.\d+, 0\.\d+\] +\d/\d +slower",
                     attnres)
    state = text[text.index("cost decode_state_bytes"):]
    assert re.search(r"attnres +5 +4096 +6144 +1\.50 \[1\.50, 1\.50\] +0/5 +larger +a", state)
    assert "a: every pair has the same ratio (a deterministic cost): the interval is the point" in state
    md = "".join(r.text("md"))
    assert "| comparison | optim.lr | control | treatment | n | control geo. mean |" in md
    assert "\n\n**cost decode_tps" in md  # a paragraph of its own, not a line of the legend's list above
    rich = [x for x in r.text("rich") if isinstance(x, Table)]
    assert [t.title for t in rich][-2:] == [c for c in (t.title for t in rich) if str(c).startswith("cost ")]


def test_every_export_format_carries_the_cost_rows(tmp_path):
    r = readout()
    paired_only = export_table(r.table, tmp_path / "p.csv", "csv")
    both = pd.read_csv(r.export(tmp_path / "t.csv", "csv"), keep_default_na=False, na_values=[CSV_NA_REP])
    assert list(both.columns[:len(COMPARE_COLUMNS)]) == list(COMPARE_COLUMNS)
    assert {"ratio", "ratio_low", "ratio_high", "control_median", "control_geomean"} <= set(both.columns)
    paired, costs = both[both["role"] != "cost"], both[both["role"] == "cost"]
    assert len(costs) == 2 * 2 * 2 and set(costs["delta"]) == {"treatment / control"}
    assert paired[list(COMPARE_COLUMNS)].to_csv(index=False, na_rep=CSV_NA_REP) == paired_only.read_text()
    assert paired["ratio"].isna().all() and costs["mean_delta"].isna().all() and costs["ratio"].notna().all()
    parquet = pd.read_parquet(r.export(tmp_path / "t.parquet", "parquet"))
    assert len(parquet) == len(both) and (parquet["role"] == "cost").sum() == 8
    assert parquet["n"].dtype == "int64" and parquet["exploratory"].dtype == bool
    md = r.export(tmp_path / "t.md", "md").read_text()
    assert md.index("**val_loss_tail") < md.index("**cost decode_tps") < md.index("**Per-seed pairs")
    tex = r.export(tmp_path / "t.tex", "latex").read_text()
    assert "\\texttt{decode\\_tps}" in tex and "seed-paired CI" in tex
    assert tex.count("\\begin{table*}") == tex.count("\\end{table*}") == 1 + 2 + 1  # paired, 2 costs, pairs
    # a study without costs exports exactly the paired table
    plain = readout(costs=())
    assert plain.export(tmp_path / "u.csv", "csv").read_text() == paired_only.read_text()


def test_the_report_and_the_parent_run_get_the_cost_table_a_plot_per_grid_point_and_series(tmp_path):
    # one cost (a plot per cost: test_cost_report.py in Chromium, the golden study) and one rendering for both:
    # publish writes report.html too
    published = readout(costs=("decode_state_bytes",)).publish(tmp_path)
    page = (tmp_path / "report.html").read_text()
    assert page.index("<h2>Paired comparisons</h2>") < page.index("<h2>Costs</h2>") < page.index("<h2>Plots</h2>")
    assert '<table id="costs">' in page and '<table id="costs-2">' not in page
    figures = re.findall(r'<figure id="plot-([^"]+)"', page)
    assert [f for f in figures if f.startswith("cost_")] == ["cost_decode_state_bytes", "cost_decode_state_bytes-2"]
    # the grid point by its short label, spelled out in the report's key table
    assert "val_loss_tail against decode_state_bytes at g1: lr0.002: each arm&#x27;s seeds" in page
    assert "<tr><td>g1</td><td>lr0.002</td><td>optim.lr = 0.002</td></tr>" in page
    files = {p.name for p in tmp_path.iterdir()}
    assert {"costs.csv", "cost_decode_state_bytes_optim.lr=0.001.png", "cost_decode_state_bytes_optim.lr=0.002.png",
            "paired_table.csv"} <= files
    assert len(pd.read_csv(tmp_path / "costs.csv")) == 4
    assert list(published.tables) == ["costs_table.json"] and len(published.tables["costs_table.json"]) == 4
    key = "cost/main/attnres/optim.lr_0.001/decode_state_bytes"
    assert published.series[f"{key}/ratio"] == [(5, pytest.approx(1.5))]
    assert published.series[f"{key}/ratio_low"] == published.series[f"{key}/ratio_high"]


def test_runs_without_a_declared_cost_stop_the_readout_with_one_line():
    runs = runs_table().drop(columns=["decode_tps"])  # a cache written before reslab measured serving cost
    with pytest.raises(ConfigError, match=r"^study s: costs: decode_tps was not recorded .* the runs recorded: "
                                          r"decode_state_bytes, params_total\. "):
        readout(runs).text()


def test_costs_are_a_readout_of_their_own():
    assert [r.name for r in READOUTS] == ["sequential", "gates", "paired", "costs", "mechanisms", "ladder", "contrasts",
                                          "tasks", "interventions", "curves"]
    assert readout(costs=()).results[1][0].name == "curves"  # no costs declared: no cost result


def test_the_cost_tables_compile_in_a_two_column_article(tmp_path):
    if shutil.which("pdflatex") is None:
        pytest.skip("pdflatex not installed (Debian: texlive-latex-base texlive-latex-recommended)")
    readout().export(tmp_path / "table.tex", "latex")
    text = " ".join(["Serving cost across seeds."] * 200)
    (tmp_path / "doc.tex").write_text("\\documentclass[twocolumn]{article}\n\\usepackage{booktabs}\n"
                                      "\\begin{document}\n\\input{table.tex}\n" + text + "\n\\end{document}\n")
    done = subprocess.run(["pdflatex", "-interaction=nonstopmode", "-halt-on-error", "doc.tex"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    log = (tmp_path / "doc.log").read_text(errors="replace")
    assert done.returncode == 0, log[-3000:]
    assert "Overfull \\hbox" not in log, re.findall(r"Overfull \\hbox.*", log)
