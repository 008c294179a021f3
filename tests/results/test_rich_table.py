"""The terminal table (rich) carries the plain table's cells, right-aligns numbers and colours verdicts."""

from __future__ import annotations

import numpy as np
import pandas as pd
from rich.console import Console
from rich.table import Table

from reslab.results import compare, format_table
from reslab.results.comparison import Comparison
from reslab.results.export import rich_renderables


def _table() -> pd.DataFrame:
    rng = np.random.default_rng(0)
    rows = []
    for s in range(8):  # 8 pairs: the smallest exact sign-flip p, 2/2**8, is below 0.05 after Holm over 2
        base = 3.0 + rng.normal(0, 0.05)
        rows += [{"run_id": f"c{s}", "arm": "control", "grid_key": "", "seed": s, "status": "FINISHED",
                  "val_loss_tail": base},
                 {"run_id": f"a{s}", "arm": "good", "grid_key": "", "seed": s, "status": "FINISHED",
                  "val_loss_tail": base - 0.1 + rng.normal(0, 0.002)},
                 {"run_id": f"b{s}", "arm": "noise", "grid_key": "", "seed": s, "status": "FINISHED",
                  "val_loss_tail": base + rng.normal(0, 0.05)}]
    return compare(pd.DataFrame(rows), [Comparison(name="c", control="control", treatments=("good", "noise"))])


def test_rich_table_has_the_plain_cells_aligned_and_coloured():
    table = _table()
    assert list(table["verdict"]) == ["better", "inconclusive"]
    (grid, *legend) = rich_renderables(table)
    assert isinstance(grid, Table)
    header = [c.header for c in grid.columns]
    plain = format_table(table, "text")
    for column in grid.columns:
        assert column.header in plain.splitlines()[1]
        cells = list(column.cells)
        assert all(c in plain for c in cells if c)
    assert {c.header: c.justify for c in grid.columns}["n"] == "right"
    assert [r.style for r in grid.rows] == ["bold green", None]
    assert header.index("verdict") >= 0 and legend and all(line.plain in plain for line in legend)
    console = Console(record=True, force_terminal=True, color_system="standard", width=250)
    console.print(*rich_renderables(table))
    assert "\x1b[1;32m" in console.export_text(styles=True)  # bold green: the significant row
