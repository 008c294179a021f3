"""`results.collect` reads a run's summary from its `summary/<name>` tags (what the driver writes), from
`summary/<name>` metrics (stores written before the summary moved out of MLflow's metric charts), and
leaves an unfinished run's summary NaN."""

from __future__ import annotations

import math

from reslab.results.collect import runs_table


def record(run_id: str, status: str, tags: dict[str, str], metrics: dict[str, float]) -> dict:
    base = {"run_id": run_id, "study": "s", "arm": "a", "seed": "0", "pair_key": "seed=0", "grid_key": ""}
    return {"mlflow_run_id": f"m-{run_id}", "status": status, "start_time": 1, "end_time": 2,
            "tags": {**base, **tags}, "metrics": metrics, "params": {}}


def test_the_summary_comes_from_tags_exactly_or_from_an_older_stores_metrics():
    value = 4.123456789012345  # 16 significant digits: a tag holds repr(float), which reads back exactly
    table = runs_table([
        record("new", "FINISHED", {"summary/val_loss_tail": repr(value)}, {"val_loss_tail": 9.0}),
        record("old", "FINISHED", {}, {"summary/val_loss_tail": 3.5, "val_loss_tail": 9.0}),
        record("running", "RUNNING", {}, {"val_loss_tail": 9.0}),  # a curve's latest point is no summary
    ]).set_index("run_id")
    assert table.loc["new", "val_loss_tail"] == value
    assert table.loc["old", "val_loss_tail"] == 3.5
    assert math.isnan(table.loc["running", "val_loss_tail"])
