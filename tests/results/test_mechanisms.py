"""Mechanisms as paired delta rows (`results.mechanisms`, the mechanisms readout): the rows against a direct
computation with scipy (the paired t interval of `scipy.stats.ttest_rel`, the exact sign flip of
`scipy.stats.permutation_test`), the long values from a runs table, bad input, and every way out of a study's
result (terminal, export, report, MLflow series) on a synthetic runs table."""

from __future__ import annotations

import io
import math

import numpy as np
import pandas as pd
import pytest
from scipy import stats as sps

from reslab.common.errors import ConfigError
from reslab.results.comparison import Comparison
from reslab.results.export import CSV_NA_REP
from reslab.results.mechanisms import VALUE_COLUMNS, mechanism_table, summary_values
from reslab.results.readout import StudyData, StudyReadout
from reslab.results.readouts.base import PROFILE_COLUMNS, TrainingRecords, no_records

ARMS = ("control", "attnres", "block")
POINTS = ("model.n_layers=4", "model.n_layers=8")
COMP = Comparison(name="main", control="control", treatments=("attnres", "block"))


def runs_table(seeds: int = 6, drop: tuple[str, str, int] | None = None) -> pd.DataFrame:
    """Three arms x two grid points x `seeds`, growth with a seed effect every arm shares, grad_cv, and
    route_max_late for the routing arms only (the control does not route); `drop` = (arm, point, seed) failed."""
    rng = np.random.default_rng(36)
    rows = []
    for point in POINTS:
        shared = rng.normal(0.0, 0.5, seeds)
        for arm in ARMS:
            for s in range(seeds):
                failed = drop == (arm, point, s)
                rows.append({
                    "run_id": f"{arm}-{point}-{s}", "arm": arm, "grid_key": point, "seed": s,
                    "status": "FAILED" if failed else "FINISHED", "val_loss_tail": 3.0 + 0.01 * s,
                    "growth": math.nan if failed else 4.0 - 2.0 * (arm != "control") + shared[s] + rng.normal(0, 0.2),
                    "grad_cv": math.nan if failed else 0.5 + rng.normal(0, 0.1),
                    "route_max_late": math.nan if failed or arm == "control" else rng.uniform(0.2, 0.6),
                })
    table = pd.DataFrame(rows)
    table["seed"] = table["seed"].astype("Int64")
    return table


def test_summary_values_are_the_finished_runs_recorded_mechanisms_in_long_rows():
    runs = runs_table(seeds=3, drop=("block", POINTS[0], 1))
    values = summary_values(runs)
    assert list(values.columns) == list(VALUE_COLUMNS)
    assert (values["metric"] == "growth").sum() == 3 * 2 * 3 - 1  # the failed run has none
    assert (values["metric"] == "route_max_late").sum() == 2 * 2 * 3 - 1  # the control has none
    row = values[(values["arm"] == "attnres") & (values["seed"] == 2) & (values["grid_key"] == POINTS[1])
                 & (values["metric"] == "grad_cv")]
    assert row["value"].item() == runs.set_index(["arm", "grid_key", "seed"]).loc[("attnres", POINTS[1], 2), "grad_cv"]


def test_a_row_is_the_paired_t_interval_and_exact_sign_flip_of_the_seed_deltas():
    runs = runs_table(seeds=7, drop=("attnres", POINTS[1], 3))
    table = mechanism_table(runs, summary_values(runs), [COMP], ["growth", "grad_cv"], alpha=0.1)
    assert len(table) == 2 * 2 * 2 and list(table["metric"].unique()) == ["growth", "grad_cv"]
    row = table[(table["metric"] == "growth") & (table["treatment"] == "attnres") & (table["grid_key"] == POINTS[1])]
    row = row.iloc[0]
    at = runs[runs["grid_key"] == POINTS[1]].set_index(["arm", "seed"])["growth"]
    seeds = [s for s in range(7) if s != 3]
    c, t = at["control"].loc[seeds].to_numpy(), at["attnres"].loc[seeds].to_numpy()
    ref = sps.ttest_rel(t, c)
    ci = ref.confidence_interval(confidence_level=0.9)
    flip = sps.permutation_test((t - c,), np.mean, permutation_type="samples", n_resamples=np.inf)
    assert row["n"] == 6 and row["seeds"] == ",".join(map(str, seeds))
    assert row["mean_delta"] == pytest.approx(float(np.mean(t - c)), rel=1e-12)
    assert (row["ci_low"], row["ci_high"]) == pytest.approx((ci.low, ci.high), rel=1e-10)
    assert row["perm_p"] == pytest.approx(flip.pvalue, rel=1e-10) and row["perm_method"] == "exact"
    assert row["control_mean"] == pytest.approx(c.mean()) and row["treatment_mean"] == pytest.approx(t.mean())
    assert row["delta"] == "treatment - control" and row["role"] == "mechanism"
    assert "seed 3: no attnres value" in row["missing"] and "incomplete" in row["flags"]


def test_rows_are_marked_by_their_t_p_corrected_over_the_comparisons_family():
    """Issue 51, item 4: each row's paired t p (scipy's `ttest_rel`), Holm-adjusted by statsmodels over every
    mechanism row of the family (two comparisons of family "f": 2 x 2 treatments x points x metrics), or
    Benjamini-Hochberg where the family says so; marked where the adjusted p is at most alpha."""
    from statsmodels.stats.multitest import multipletests

    runs = runs_table(seeds=3)
    for correction in ("holm", "bh"):
        comps = [Comparison(name=n, control="control", treatments=("attnres", "block"), family="f",
                            correction=correction) for n in ("one", "two")]
        table = mechanism_table(runs, summary_values(runs), comps, ["growth", "grad_cv"])
        p = []
        for r in table.to_dict("records"):
            at = runs[runs["grid_key"] == r["grid_key"]].set_index(["arm", "seed"])[r["metric"]]
            p.append(sps.ttest_rel(at[r["treatment"]].to_numpy(), at["control"].to_numpy()).pvalue)
        reject, adjusted, _, _ = multipletests(p, alpha=0.05, method="holm" if correction == "holm" else "fdr_bh")
        assert len(table) == 16 and table["t_p"].to_numpy() == pytest.approx(p, rel=1e-9)
        assert table["p_adj"].to_numpy() == pytest.approx(adjusted, rel=1e-9)
        assert list(table["marked"]) == list(reject) and table["marked"].any()
    # at 3 seeds the sign flip's p is at least 0.25 however large the effect; the t p is not
    assert (table["perm_p"] >= 0.25).all() and (table["t_p"] < 0.01).any()


def test_a_mechanism_only_one_arm_recorded_has_rows_without_pairs():
    runs = runs_table(seeds=3)
    table = mechanism_table(runs, summary_values(runs), [COMP], ["route_max_late"])
    assert (table["n"] == 0).all() and table["mean_delta"].isna().all()
    assert all("no pairs" in f for f in table["flags"])


def test_interventions_rows_join_the_summaries_in_the_same_frame():
    """Another source of per-run values (the interventions' `imbalance`) is rows of the same long frame."""
    runs = runs_table(seeds=4)
    extra = pd.DataFrame([{"arm": arm, "grid_key": point, "seed": s, "metric": "imbalance",
                           "value": 0.1 * s + (0.3 if arm == "block" else 0.0)}
                          for arm in ARMS for point in POINTS for s in range(4)])
    values = pd.concat([summary_values(runs), extra], ignore_index=True)
    table = mechanism_table(runs, values, [COMP], ["imbalance"])
    block = table[table["treatment"] == "block"]
    assert block["mean_delta"].to_numpy() == pytest.approx([0.3, 0.3])
    assert block["control_run_ids"].iloc[0] == ";".join(f"control-{POINTS[0]}-{s}" for s in range(4))


def _profiles(n_layers: int = 4) -> pd.DataFrame:
    """`TrainingRecords.depth_profiles` of 3 seeds at step 20, by pandas from one long row per value."""
    rows = []
    for point in POINTS:
        for arm in ARMS:
            for seed in range(3):
                for i in range(n_layers):
                    growth = (i + 1) if arm == "control" else 1.0
                    rows += [(arm, point, seed, "layer_out_rms", i, growth * (1 + 0.1 * seed)),
                             (arm, point, seed, "layer_grad_norm", i, 1.0 / (i + 1))]
                rows += [(arm, point, seed, "in_rms", s, 0.02 * (s + 1)) for s in range(2 * n_layers)]
    long = pd.DataFrame(rows, columns=["arm", "grid_key", "seed", "quantity", "index", "value"])
    profile = long.groupby(["grid_key", "arm", "quantity", "index"], sort=False)["value"].agg(["mean", "min", "max"])
    return profile.reset_index().assign(step=20, seeds=3)[list(PROFILE_COLUMNS)]


def readout(runs: pd.DataFrame | None = None, mechanisms: tuple[str, ...] = ("growth", "grad_cv")) -> StudyReadout:
    runs = runs_table() if runs is None else runs
    records = TrainingRecords(evals=no_records().evals, depths=no_records().depths, depth_profiles=_profiles())
    return StudyReadout(StudyData(name="s", runs=runs, comparisons=(COMP,), grid_axes=("model.n_layers",),
                                  mechanism_metrics=mechanisms, read_mechanisms=lambda: summary_values(runs),
                                  read_records=lambda: records))


def test_every_way_out_shows_the_mechanism_rows_after_the_loss_rows(tmp_path):
    r = readout()
    assert [x.name for x, _ in r.results] == ["paired", "mechanisms", "curves"]
    out = io.StringIO()
    r.print(out)
    text = out.getvalue()
    assert text.index("val_loss_tail") < text.index("mechanisms: paired delta treatment - control")
    line = next(x for x in text.splitlines() if x.lstrip().startswith("growth") and "block vs control" in x)
    assert "model.n_layers=4" in line and " 6 " in line and "0.0312" in line  # 6 pairs, all negative: 2 / 2^6
    both = pd.read_csv(r.export(tmp_path / "t.csv", "csv"), keep_default_na=False, na_values=[CSV_NA_REP])
    mech = both[both["role"] == "mechanism"]
    assert len(mech) == 2 * 2 * 2 and mech["mean_delta"].notna().all() and mech["perm_p"].notna().all()
    md = r.export(tmp_path / "t.md", "md").read_text()
    assert md.index("**val_loss_tail") < md.index("**mechanisms: paired delta") < md.index("**Per-seed pairs")
    tex = r.export(tmp_path / "t.tex", "latex").read_text()
    assert tex.count("\\begin{table*}") == tex.count("\\end{table*}") == 1 + 1 + 1  # paired, mechanisms, pairs
    published = r.publish(tmp_path)
    assert (tmp_path / "mechanisms.csv").is_file() and "mechanisms_table.json" in published.tables
    key = "mechanism/main/block/model.n_layers_8/growth"  # MLflow keys: "=" as "_"
    assert {f"{key}/delta", f"{key}/ci_low", f"{key}/ci_high"} <= set(published.series)
    pngs = sorted(p.name for p in tmp_path.glob("profile_*.png"))
    assert pngs == sorted(f"profile_{q}_{p}.png" for q in ("layer_out_rms", "layer_grad_norm", "in_rms")
                          for p in POINTS)
    html = (tmp_path / "report.html").read_text()
    assert '<table id="mechanisms">' in html and "Depth profile" in html and "step 20" in html


def test_the_profile_is_the_seed_mean_with_a_min_max_band_at_the_last_step():
    from reslab.results.readouts.mechanisms import profile_plot

    profiles = _profiles()
    plot = profile_plot(profiles[profiles["grid_key"] == POINTS[0]], "layer_out_rms", "t")
    control = plot.data["control"]
    assert control["index"].tolist() == [1, 2, 3, 4]
    assert control["mean"] == pytest.approx([(i + 1) * 1.1 for i in range(4)])  # seeds 1.0, 1.1, 1.2
    assert control["low"] == pytest.approx([i + 1 for i in range(4)])
    assert control["high"] == pytest.approx([(i + 1) * 1.2 for i in range(4)])


def test_a_mechanism_no_run_recorded_is_one_line_naming_what_was():
    runs = runs_table(seeds=3).assign(grad_cv=math.nan)
    with pytest.raises(ConfigError) as err:
        readout(runs).print(io.StringIO())
    message = str(err.value)
    assert "\n" not in message and "mechanisms: grad_cv was not recorded" in message
    assert "recorded: growth, route_max_late" in message


def test_moe_utilisation_becomes_a_per_layer_profile():
    """A MoE run's diagnostics (`models.training.moe_utilisation`) gather into `moe_max_load` rows, the most loaded
    expert's share x experts per layer, which the mechanisms readout draws as a depth profile."""
    from reslab.results.readouts.mechanisms import profile_plot
    from reslab.results.records import depth_profiles, profile_vectors

    row = {"step": 10, "moe": {"layers": [0, 1], "fraction": [[0.5, 0.25, 0.25, 0.0], [0.25] * 4]}}
    found = [("", "control", seed, 10, profile_vectors(row)) for seed in (0, 1)]
    frame = depth_profiles(found, lambda i, step: [])  # each run at its last step: no earlier row is read
    assert frame[["quantity", "index", "seeds", "mean", "min", "max"]].values.tolist() == [
        ["moe_max_load", 0, 2, 2.0, 2.0, 2.0], ["moe_max_load", 1, 2, 1.0, 1.0, 1.0]]
    plot = profile_plot(frame, "moe_max_load", "t")
    assert plot.data["control"]["index"].tolist() == [1, 2] and plot.data["control"]["mean"].tolist() == [2.0, 1.0]
