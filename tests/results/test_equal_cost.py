"""`results.equal_cost`: arms read from their eval curves at the cost every arm reached; and the
comparison that states it."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

from reslab.results import compare
from reslab.results.comparison import Comparison
from reslab.results.equal_cost import at_matched_cost, value_at


def test_a_curve_is_read_linearly_in_log_cost_and_never_extrapolated():
    cost, value = np.array([1e9, 4e9, 1.6e10]), np.array([3.0, 2.6, 2.4])
    assert value_at(cost, value, 4e9) == 2.6 and value_at(cost, value, 1.6e10) == 2.4
    assert value_at(cost, value, 2e9) == pytest.approx(2.8)  # halfway in log between 1e9 and 4e9
    assert math.isnan(value_at(cost, value, 5e8)) and math.isnan(value_at(cost, value, 2e10))


def _runs_and_curves(seeds: int = 6, overhead: float = 1.25):
    """Control and a routing arm with the same loss at the same tokens (no gain per token) but
    `overhead` x the FLOPs per step; evals every 100 of 500 steps, loss falling with the step."""
    rng = np.random.default_rng(3)
    runs, curves = [], []
    for s in range(seeds):
        shift = rng.normal(0, 0.01)
        for arm, per_step in (("control", 1e9), ("routed", overhead * 1e9)):
            rid = f"{arm}-{s}"
            steps = np.arange(100, 501, 100)
            loss = 2.0 + 3.0 / np.sqrt(steps) + shift + rng.normal(0, 1e-4, steps.size)
            curves += [{"run_id": rid, "cost": st * per_step, "val_loss": v} for st, v in zip(steps, loss, strict=True)]
            runs.append({"run_id": rid, "arm": arm, "grid_key": "", "seed": s, "status": "FINISHED",
                         "val_loss": loss[-1]})
    return pd.DataFrame(runs), pd.DataFrame(curves)


def test_at_equal_flops_the_costlier_arm_is_read_before_its_end():
    runs, curves = _runs_and_curves()
    matched = at_matched_cost(runs, curves, ["control", "routed"]).set_index("run_id")
    for s in range(6):
        # the control reached 5e11 FLOPs at its end; the routed arm reached it at step 400 of 500
        assert matched.loc[f"control-{s}", "val_loss"] == runs.set_index("run_id").loc[f"control-{s}", "val_loss"]
        curve = curves[curves["run_id"] == f"routed-{s}"]
        assert matched.loc[f"routed-{s}", "val_loss"] == pytest.approx(curve["val_loss"].iloc[3])
    comp = Comparison(name="eq", control="control", treatments=("routed",), metric="val_loss", at="flops")
    by_tokens = compare(runs, [Comparison(name="eq", control="control", treatments=("routed",), metric="val_loss")])
    by_flops = compare(runs, [comp], values={"eq": at_matched_cost(runs, curves, ["control", "routed"])})
    assert abs(by_tokens["mean_delta"].iloc[0]) < 1e-3  # no gain per token
    assert by_flops["mean_delta"].iloc[0] > 0.005  # and a loss per FLOP: 20% fewer steps at equal FLOPs
    assert "at equal FLOPs: each arm's val_loss read from its eval curve" in by_flops["flags"].iloc[0]
    assert "at equal" not in by_tokens["flags"].iloc[0]


def test_a_run_whose_curve_starts_after_the_matched_cost_has_no_value():
    runs, curves = _runs_and_curves(seeds=1, overhead=6.0)  # the routed arm's first eval is past 5e11
    matched = at_matched_cost(runs, curves, ["control", "routed"]).set_index("run_id")
    assert math.isnan(matched.loc["routed-0", "val_loss"]) and not math.isnan(matched.loc["control-0", "val_loss"])


def test_equal_cost_needs_the_curve_metric():
    from reslab.common.errors import ConfigError

    with pytest.raises(ConfigError, match="at 'flops' reads each run's eval curve, which holds val_loss"):
        Comparison(name="x", control="a", treatments=("b",), metric="val_loss_tail", at="flops")
