"""The task readout's statistics (`results.tasks`) against independent references: McNemar's exact test
against statsmodels' `mcnemar(exact=True)`, the two-way variance components against a two-way ANOVA fitted
by statsmodels (`ols` + `anova_lm`), Holm against statsmodels' `multipletests`, and the task table's rows
on a hand-built item table. Coverage by simulation is in `test_task_coverage.py` (slow tier)."""

import math

import numpy as np
import pandas as pd
import pytest
from statsmodels.formula.api import ols
from statsmodels.stats.anova import anova_lm
from statsmodels.stats.contingency_tables import mcnemar
from statsmodels.stats.multitest import multipletests

from reslab.common.errors import ConfigError
from reslab.results.comparison import Comparison
from reslab.results.tasks import SUITE, TASK_COLUMNS, item_only, mcnemar_exact, task_table, two_way


@pytest.mark.parametrize("seed", range(6))
def test_mcnemar_matches_statsmodels(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(5, 400))
    control = (rng.random(n) < rng.uniform(0.2, 0.8)).astype(int)
    flip = rng.random(n) < rng.uniform(0.02, 0.4)
    treatment = np.where(flip, 1 - control, control)
    b, c, p = mcnemar_exact(control, treatment)
    table = [[int(((control == 1) & (treatment == 1)).sum()), b], [c, int(((control == 0) & (treatment == 0)).sum())]]
    reference = mcnemar(table, exact=True)
    assert p == pytest.approx(reference.pvalue, rel=1e-12, abs=1e-15)
    assert min(b, c) == reference.statistic


def test_mcnemar_without_discordant_items_is_one_and_refuses_scores():
    ones = np.ones(10, dtype=int)
    assert mcnemar_exact(ones, ones) == (0, 0, 1.0)
    with pytest.raises(ValueError, match="0/1"):
        mcnemar_exact(np.full(3, 0.5), np.ones(3))


def anova_variance(table):
    """(MS_seed + MS_item - MS_residual) / (S N) from statsmodels' two-way ANOVA without interaction."""
    s, n = table.shape
    frame = pd.DataFrame({"d": table.ravel(), "seed": np.repeat(np.arange(s), n), "item": np.tile(np.arange(n), s)})
    aov = anova_lm(ols("d ~ C(seed) + C(item)", frame).fit())
    ms = aov["sum_sq"] / aov["df"]
    return (ms["C(seed)"] + ms["C(item)"] - ms["Residual"]) / (s * n), ms


@pytest.mark.parametrize(("s", "n", "seed_sd"), [(3, 40, 0.3), (5, 25, 0.05), (2, 60, 0.5)])
def test_two_way_variance_is_the_anova_estimate(s, n, seed_sd):
    rng = np.random.default_rng(s * n)
    table = (rng.normal(0, seed_sd, (s, 1)) + rng.normal(0.1, 0.4, (1, n)) + rng.normal(0, 0.5, (s, n)))
    tw = two_way(table)
    var, ms = anova_variance(table)
    assert tw.se**2 == pytest.approx(max(var, ms["Residual"] / (s * n)), rel=1e-10)
    assert tw.estimate == pytest.approx(table.mean(), rel=1e-12)
    assert tw.seed_part + tw.item_part + tw.interaction_part == pytest.approx(var, rel=1e-10)
    assert tw.interaction_part == pytest.approx(ms["Residual"] / (s * n), rel=1e-10)
    # Satterthwaite's df over the three mean squares, written out
    parts = [(ms["C(seed)"] / (s * n), s - 1), (ms["C(item)"] / (s * n), n - 1),
             (ms["Residual"] / (s * n), (s - 1) * (n - 1))]
    assert tw.df == pytest.approx(var**2 / sum(v**2 / df for v, df in parts), rel=1e-10)
    assert tw.ci_low < tw.estimate < tw.ci_high and 0 <= tw.p <= 1
    assert sum(tw.shares) == pytest.approx(1.0)


def test_suite_of_one_task_is_the_task_and_of_two_is_the_mean():
    rng = np.random.default_rng(1)
    a, b = rng.normal(0.1, 1, (4, 30)), rng.normal(-0.2, 1, (4, 50))
    assert two_way([a]) == two_way(a)
    suite = two_way([a, b])
    assert suite.estimate == pytest.approx((a.mean() + b.mean()) / 2)
    # items are independent across tasks, seeds shared: the items' parts add with weight 1/4
    assert suite.item_part == pytest.approx((two_way(a).item_part + two_way(b).item_part) / 4)


def test_two_way_refuses_what_it_cannot_estimate():
    with pytest.raises(ValueError, match=">= 2"):
        two_way(np.ones((1, 5)))
    with pytest.raises(ValueError, match="same seeds"):
        two_way([np.ones((3, 5)), np.ones((2, 5))])
    with pytest.raises(ValueError, match="NaN"):
        two_way(np.array([[0.0, math.nan], [1.0, 0.0]]))


def test_item_only_is_the_paired_item_stderr():
    rng = np.random.default_rng(2)
    table = rng.normal(0, 1, (3, 100))
    estimate, se, low, high = item_only(table)
    cols = table.mean(axis=0)
    assert se == pytest.approx(cols.std(ddof=1) / 10)
    assert (low + high) / 2 == pytest.approx(estimate)


# ----------------------------------------------------------------------------- the task table

COMP = Comparison(name="main", control="base", treatments=("attn",), direction="maximize")


def items_table(seeds, tasks, n_items, gain=0.15, seed=0):
    """Correctness of both arms on every (seed, task, item); the treatment is better by `gain` in probability."""
    rng = np.random.default_rng(seed)
    rows = []
    for task in tasks:
        easy = rng.uniform(0.2, 0.6, n_items)
        for s in seeds:
            for arm, shift in (("base", 0.0), ("attn", gain)):
                ok = rng.random(n_items) < easy + shift
                rows += [{"arm": arm, "grid_key": "", "seed": s, "task": task, "doc_id": i, "value": float(v),
                          "metric": "acc"} for i, v in enumerate(ok)]
    return pd.DataFrame(rows)


def test_task_rows_holm_and_suite():
    items = items_table([0, 1, 2], ["t1", "t2", "t3"], 120)
    table = task_table(items, [COMP])
    assert list(table.columns) == list(TASK_COLUMNS)
    assert list(table["task"]) == ["t1", "t2", "t3", SUITE]
    tasks = table[table["task"] != SUITE]
    assert np.allclose(tasks["p_holm"], multipletests(tasks["p"], method="holm")[1])
    assert (tasks["method"] == "two-way").all() and (tasks["n_seeds"] == 3).all() and (tasks["n_items"] == 120).all()
    suite = table[table["task"] == SUITE].iloc[0]
    assert suite["delta"] == pytest.approx(tasks["delta"].mean())
    assert math.isnan(suite["p_holm"]) and suite["n_items"] == 360
    one = items[items["task"] == "t1"]
    delta = (one[one["arm"] == "attn"]["value"].to_numpy() - one[one["arm"] == "base"]["value"].to_numpy()).mean()
    assert tasks.iloc[0]["delta"] == pytest.approx(delta)
    assert tasks.iloc[0]["treatment_mean"] - tasks.iloc[0]["control_mean"] == pytest.approx(delta)
    assert (table["share_seeds"] + table["share_items"] + table["share_interaction"]).round(12).eq(1).all()


def test_one_seed_pair_is_mcnemar_with_the_item_interval():
    items = items_table([4], ["t1"], 200)
    row = task_table(items, [COMP]).iloc[0]
    c = items[items["arm"] == "base"]["value"].to_numpy().astype(int)
    t = items[items["arm"] == "attn"]["value"].to_numpy().astype(int)
    assert row["method"] == "mcnemar" and row["p"] == pytest.approx(mcnemar_exact(c, t)[2])
    assert "one seed pair" in row["flags"] and math.isnan(row["share_seeds"])
    assert (row["ci_low"], row["ci_high"]) == pytest.approx((row["item_ci_low"], row["item_ci_high"]))


def test_unpaired_seeds_and_missing_items_are_left_out_and_flagged():
    items = items_table([0, 1, 2], ["t1"], 50)
    items = items[~((items["arm"] == "attn") & (items["seed"] == 2))]          # seed 2 only in the control
    items = items[~((items["arm"] == "base") & (items["seed"] == 0) & (items["doc_id"] == 7))]
    row = task_table(items, [COMP]).iloc[0]
    assert row["n_seeds"] == 2 and row["n_items"] == 49 and row["seeds"] == "0,1"
    assert "base seeds 2 unpaired" in row["flags"] and "49 items" in row["flags"]


def test_item_table_without_its_columns_is_one_line():
    with pytest.raises(ConfigError, match="missing column.*doc_id"):
        task_table(pd.DataFrame({"arm": [], "grid_key": [], "seed": [], "task": [], "value": []}), [COMP])
