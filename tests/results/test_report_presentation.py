"""The report's presentation (issue 35 item 15): the sentence over the paired table says which p column is
corrected, grid points go by short labels spelled out once, and a sequential row decided on its confidence
sequence says what the equivalence bounds beside it are. Tables' widths and legends' places in a browser:
`tests/orchestrator/test_report_layout_browser.py`."""

from __future__ import annotations

import html
import re

import numpy as np
import pandas as pd
import pytest

from reslab.results.collect import pairs_table
from reslab.results.comparison import Comparison
from reslab.results.export import format_table, table_model
from reslab.results.labels import point_labels
from reslab.results.readouts.paired import paired_section
from reslab.results.readouts.sequential import sequential_section
from reslab.results.report import render_report
from reslab.results.sequential import SequentialDesign, sequential_table
from reslab.results.stats import compare

LADDER = ["model.d_model=32,model.n_layers=2,model.ffn_hidden=96,train.steps=300",
          "model.d_model=48,model.n_layers=3,model.ffn_hidden=144,train.steps=400",
          "model.d_model=64,model.n_layers=4,model.ffn_hidden=192,train.steps=450",
          "model.d_model=80,model.n_layers=5,model.ffn_hidden=240,train.steps=500"]


def _runs(keys: list[str], seeds: int, gain: float, rng: np.random.Generator) -> pd.DataFrame:
    rows = []
    for key in keys:
        for seed in range(seeds):
            base = 3.3 + 0.02 * rng.standard_normal()
            rows += [("control", key, seed, base), ("attnres", key, seed, base - gain + 0.004 * rng.standard_normal()),
                     ("block", key, seed, base - gain / 2 + 0.004 * rng.standard_normal())]
    return pd.DataFrame([{"run_id": f"r{i}", "arm": a, "grid_key": k, "seed": s, "val_loss": v, "status": "FINISHED"}
                         for i, (a, k, s, v) in enumerate(rows)])


def _cells(page: str, table_id: str) -> tuple[list[str], list[list[str]]]:
    """The header and the body cells (unescaped text) of the page's table `table_id`."""
    table = re.search(rf'<table id="{table_id}">(.*?)</table>', page, re.S)
    assert table, table_id
    header = [html.unescape(h) for h in re.findall(r"<th>(.*?)</th>", table.group(1))]
    body = re.search(r"<tbody>(.*)</tbody>", table.group(1), re.S)
    assert body
    rows = [[html.unescape(c) for c in re.findall(r"<td[^>]*>(.*?)</td>", row)]
            for row in re.findall(r"<tr[^>]*>(.*?)</tr>", body.group(1), re.S)]
    return header, rows


def test_the_column_the_sentence_calls_corrected_holds_the_corrected_p():
    """The report said "p is the sign-flip p after the family's correction" over the raw p. The column the
    sentence names as corrected must hold the family-corrected p (`p_adj`), and the `p` column, which it
    must call raw, the uncorrected one (`p_primary`); the table's rows differ in the two."""
    runs = _runs(LADDER[:2], 8, 0.03, np.random.default_rng(3))
    table = compare(runs, [Comparison(name="main", control="control", treatments=("attnres", "block"),
                                      metric="val_loss")])
    assert (table["p_adj"] > table["p_primary"]).any()  # Holm over 4 rows: the columns differ
    page = "\n".join(paired_section(table))
    said = re.search(r"((?:Holm |BH |adj\. )?p) is (?:that p|the sign-flip permutation p) after the family's "
                     "correction", page)
    assert said, page[:600]
    header, rows = _cells(page, "paired")
    expected = table_model(table)[0][0][2]  # the terminal's cells: p raw, then the correction's column
    corrected = header.index(said.group(1))
    assert [r[corrected] for r in rows] == [r[header.index("p") + 1] for r in expected]
    assert "p is the raw" in page and [r[header.index("p")] for r in rows] == [r[header.index("p")] for r in expected]


def test_ladder_rungs_and_grid_points_get_short_labels():
    labels = point_labels(LADDER, [("", LADDER)])
    assert [labels(k) for k in LADDER] == ["r0: d32 L2 ff96 st300", "r1: d48 L3 ff144 st400",
                                           "r2: d64 L4 ff192 st450", "r3: d80 L5 ff240 st500"]
    grid = point_labels(["model.n_heads=4,optim.lr=0.001", "model.n_heads=8,optim.lr=0.001"])
    assert grid("model.n_heads=8,optim.lr=0.001") == "g1: h8"  # only the axis that differs
    assert grid("model.n_heads=*,optim.lr=0.001") == "all h"  # a pooled row's key
    assert grid("") == ""
    # a ladder at two grid points: each rung's label names its point
    two = [k + ",model.n_heads=2" for k in LADDER[:2]] + [k + ",model.n_heads=4" for k in LADDER[:2]]
    scoped = point_labels(two, [("model.n_heads=2", two[:2]), ("model.n_heads=4", two[2:])])
    assert [scoped(k) for k in two] == ["g0.r0: d32 L2 ff96 st300 h2", "g0.r1: d48 L3 ff144 st400 h2",
                                        "g1.r0: d32 L2 ff96 st300 h4", "g1.r1: d48 L3 ff144 st400 h4"]
    assert labels.key_rows()[0] == ("r0: d32 L2 ff96 st300", "model.d_model = 32, model.n_layers = 2, "
                                    "model.ffn_hidden = 96, train.steps = 300")


def test_the_report_writes_each_grid_key_once_in_its_key_table():
    """Every cell used to repeat the whole key: now the paired table, the facts and the failed runs use the
    short label, and the key table spells each out once."""
    runs = _runs(LADDER, 4, 0.03, np.random.default_rng(4))
    runs.loc[0, "status"] = "FAILED"
    table = compare(runs, [Comparison(name="main", control="control", treatments=("attnres",), metric="val_loss")])
    labels = point_labels(runs["grid_key"], [("", LADDER)])
    page = render_report(study="s", description="", facts=[("model", f"tiny [{LADDER[0]}]")], runs=runs,
                         sections=paired_section(table, labels), figures=[], reproduce=[], labels=labels)
    header, rows = _cells(page, "paired")
    assert [r[header.index("grid point")] for r in rows] == [labels(k) for k in LADDER]
    _, keys = _cells(page, "points")
    assert [r[0] for r in keys] == ["r0", "r1", "r2", "r3"] and keys[0][1] == "d32 L2 ff96 st300"
    for key in LADDER:  # spelled out once, as `axis = value` in the key table; nowhere as the raw key
        assert key not in page
    assert "tiny [r0: d32 L2 ff96 st300]" in page and "control/r0: d32 L2 ff96 st300/s0" in page
    assert LADDER[0] in format_table(table, "text") or "32, 2, 96, 300" in format_table(table, "text")  # terminal


@pytest.fixture(scope="module")
def decided():
    """A sequential study whose two rows are decided better; the attnres row's comparison has an MEI (so
    equivalence bounds), the block row's none (no bound)."""
    runs = _runs([""], 6, 0.05, np.random.default_rng(5))
    comps = [Comparison(name="main", control="control", treatments=("attnres",), metric="val_loss", mei=0.02),
             Comparison(name="plain", control="control", treatments=("block",), metric="val_loss")]
    table = sequential_table(pairs_table(runs, comps), comps, SequentialDesign(4, 2, 6, test="t"), tuple(range(6)))
    return table


def test_a_row_decided_better_says_what_its_equivalence_bounds_are(decided):
    assert list(decided["decision"]) == ["better", "better"]
    page = "\n".join(sequential_section(decided))
    header, rows = _cells(page, "sequential")
    bounds = rows[0][header.index("equivalence bounds")]
    assert bounds.endswith("vs ±0.02 (a)"), bounds  # marked: not the CS's width, not what decided it
    note = re.search(r"<li>\(a\) (.*?)</li>", page, re.S)
    assert note and "one-sided" in note.group(1) and "did not decide" in note.group(1)
    assert rows[1][header.index("equivalence bounds")] == "-"  # no bound: no "±-"


def test_the_terminal_says_so_too(decided):
    from reslab.results.sequential import sequential_text

    line = next(ln for ln in sequential_text(decided, SequentialDesign(4, 2, 6)).splitlines() if "attnres" in ln)
    assert ": better after" in line
    assert "against +-0.02 (the one-sided pair, for reference: the CS decided this row)" in line
