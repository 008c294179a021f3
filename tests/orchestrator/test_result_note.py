"""The experiment's description carries the latest result (`tracking.layout.result_note`): the section is
replaced, never appended twice, a user's own text around it stays, and a table too long for an MLflow tag
is cut with a pointer to the rest."""

from __future__ import annotations

import pandas as pd

from reslab.orchestrator.tracking.layout import RESULT_BEGIN, RESULT_END, result_note
from reslab.results.readouts.paired import HEADLINE_CHARS, verdict_line

TABLE = "| comparison | delta |\n|---|---:|\n| main | -0.0123 [-0.0200, -0.0046] |\n"


def test_the_result_section_is_replaced_and_the_users_text_kept():
    first = result_note("", TABLE, "3", "abc", "submission 2026-12-02 01:00:00")
    assert first.startswith(RESULT_BEGIN) and first.endswith(RESULT_END)
    assert "](#/experiments/3/runs/abc/artifacts/report.html)" in first and "| main | -0.0123" in first
    mine = "My notes on this study.\n\n" + first + "\n\nMore notes."
    second = result_note(mine, TABLE.replace("-0.0123", "-0.0456"), "3", "def", "submission 2026-12-02 02:00:00")
    assert second.startswith("My notes on this study.") and second.endswith("More notes.")
    assert second.count(RESULT_BEGIN) == 1 and "-0.0456" in second and "-0.0123" not in second
    assert "runs/def" in second and "runs/abc" not in second
    assert result_note("Notes only.", TABLE, "3", "abc", "s").startswith("Notes only.\n\n" + RESULT_BEGIN)


def test_a_long_table_is_cut_to_fit_an_mlflow_tag():
    long = "\n".join(f"| row {i} | {i / 1000:.4f} |" for i in range(2000))
    note = result_note("", long, "3", "abc", "s", limit=5000)
    assert len(note) <= 5000 and "| row 0 |" in note and "| row 1999 |" not in note
    assert "the rest of the table is in the report" in note


def test_the_first_line_is_the_answer():
    rows = [{"treatment": t, "control": "prenorm", "grid_key": g, "verdict": v, "mean_delta": d, "metric": "val_loss"}
            for t, g, v, d in [("attnres", "", "better", -0.0123), ("block", "model.preset=small", "inconclusive",
                                                                     0.004), ("a", "", "worse", 0.1),
                               ("b", "", "better", -0.2)]]
    line = verdict_line(pd.DataFrame(rows[:1]))
    assert line == "attnres vs prenorm: better (-0.0123 val_loss)"
    note = result_note("", TABLE, "3", "abc", "submission 2026-12-02", verdicts=line)
    assert note.splitlines()[1] == f"### Latest result: {line}" and note.splitlines()[2] == "(submission 2026-12-02)"
    assert verdict_line(pd.DataFrame()) == "no comparison rows"


def test_rows_that_would_not_fit_one_line_are_counted_by_verdict():
    """Two treatments' verdicts in full took a line and a half, and MLflow's collapsed description clipped them
    (issue 52, item 14): past `HEADLINE_CHARS` the headline counts the rows by verdict; the table follows it."""
    rows = [{"treatment": t, "control": "prenorm_adamw", "grid_key": g, "verdict": v, "mean_delta": d,
             "metric": "val_loss_tail"}
            for t, g, v, d in [("prenorm_muon", "optim.lr=0.001", "inconclusive", 0.152),
                               ("prenorm_muon", "optim.lr=0.003", "better", -0.17),
                               ("attnres", "optim.lr=0.001", "inconclusive", 0.01)]]
    line = verdict_line(pd.DataFrame(rows))
    assert line == "2 inconclusive, 1 better of 3 rows vs prenorm_adamw"
    assert len(line) <= HEADLINE_CHARS
