"""Verdicts as data (issue 55): the paired table's and the sequential table's decisions mapped to five words, their
numbers against independent references, what would decide an undecided one, and the analysis plan's diffs that
mark exactly the changed comparisons exploratory.

References: brute-force enumeration of the 2^n sign patterns (the exact sign-flip p), scipy's t quantile (the
paired-t CI), Holm by hand (statsmodels' `multipletests`), `results.power.power_rows` over the whole family (the
seeds an undecided row needs), and the FLOPs and hours summed by hand.
"""

from __future__ import annotations

import itertools
import json
import math

import numpy as np
import pandas as pd
import pytest
from scipy import stats as sps
from statsmodels.stats.multitest import multipletests

from reslab.results.collect import pairs_table
from reslab.results.comparison import Comparison
from reslab.results.power import power_rows
from reslab.results.readouts.paired import paired_section
from reslab.results.readouts.sequential import sequential_section
from reslab.results.sequential import SequentialDesign, sequential_table
from reslab.results.stats import compare
from reslab.results.verdict import (
    DECISIONS,
    Verdict,
    analysis_changes,
    analysis_of,
    fixed_verdicts,
    plan_hash,
    plan_status,
    sequential_verdicts,
)

BASE = 3.3 + 0.05 * np.random.default_rng(0).standard_normal(16)


def runs(deltas: dict[str, list[float]], grid_key: str = "", flops: float = 1e6) -> list[dict]:
    """Control arm "a" plus one arm per key, whose per-seed metric is the control's plus its deltas; every run
    trained 1000 tokens at `flops` per token for 360 s."""
    n = len(next(iter(deltas.values())))
    tag = grid_key.replace("=", "")
    cost = {"flops_per_token": flops, "tokens": 1000.0, "wall_time_s": 360.0}
    rows = [{"run_id": f"a{tag}{i}", "arm": "a", "grid_key": grid_key, "seed": i, "status": "FINISHED",
             "val_loss_tail": float(BASE[i]), **cost} for i in range(n)]
    for arm, d in deltas.items():
        rows += [{"run_id": f"{arm}{tag}{i}", "arm": arm, "grid_key": grid_key, "seed": i, "status": "FINISHED",
                  "val_loss_tail": float(BASE[i] + d[i]), **cost} for i in range(n)]
    return rows


def flip_p(d: np.ndarray) -> float:
    """The exact two-sided sign-flip p by enumerating every sign pattern."""
    observed = abs(d.sum())
    patterns = itertools.product((1, -1), repeat=d.size)
    sums = [abs(sum(s * x for s, x in zip(signs, d, strict=True))) for signs in patterns]
    return sum(s >= observed - 1e-12 for s in sums) / len(sums)


def t_ci(d: np.ndarray, alpha: float) -> tuple[float, float]:
    half = sps.t.ppf(1 - alpha / 2, d.size - 1) * d.std(ddof=1) / math.sqrt(d.size)
    return d.mean() - half, d.mean() + half


CLEAR = [-0.10, -0.12, -0.09, -0.11, -0.10, -0.13, -0.08, -0.10]  # every seed better
NOISE = [0.03, -0.02, 0.01, -0.04, 0.02, 0.00, -0.01, 0.025]  # no effect, spread 0.025


def test_fixed_decisions_map_compares_verdicts_with_hand_checked_numbers():
    table_runs = pd.DataFrame(runs({"b": CLEAR, "c": [-x for x in CLEAR], "n": NOISE}))
    comp = Comparison(name="main", control="a", treatments=("b", "c", "n"))
    table = compare(table_runs, [comp])
    verdicts = {v.treatment: v for v in fixed_verdicts(table, [comp], table_runs)}
    assert {t: v.decision for t, v in verdicts.items()} == {"b": "better", "c": "worse", "n": "undecided"}
    raw = [flip_p(np.array(d)) for d in (CLEAR, [-x for x in CLEAR], NOISE)]
    assert raw[:2] == [2 / 256, 2 / 256]
    holm = multipletests(raw, method="holm")[1]
    for (treatment, d), p in zip((("b", CLEAR), ("c", [-x for x in CLEAR]), ("n", NOISE)), holm, strict=True):
        v = verdicts[treatment]
        assert v.p_value == pytest.approx(p, rel=1e-12) and v.e_value is None
        low, high = t_ci(np.array(d), 0.05)
        assert (v.low, v.high) == (pytest.approx(low, abs=1e-12), pytest.approx(high, abs=1e-12))
        assert v.estimate == pytest.approx(np.mean(d), abs=1e-12) and v.level == 0.95
        assert v.seeds == tuple(range(8)) and v.point == {} and not v.exploratory and v.exploratory_why is None
        # 16 runs read (8 control, 8 treatment): 16 x 1000 tokens x 1e6 FLOPs, 16 x 360 s
        assert (v.compute.runs, v.compute.flops, v.compute.run_hours) == (16, 1.6e10, pytest.approx(1.6))
        assert v.tries == 1 and v.alpha == v.alpha_used == 0.05
    assert verdicts["b"].next == verdicts["c"].next == "nothing"
    assert verdicts["n"].next.startswith("more seeds: ~")


def test_equivalence_and_mei_rows_map_to_equivalent_and_better_beyond_the_margin():
    tiny = [0.001 * s for s in (1, -1, 1, -1, 0.5, -0.5, 1, -1)]  # within +-0.02 by far
    table_runs = pd.DataFrame(runs({"same": tiny, "far": CLEAR}))
    eq = Comparison(name="eq", control="a", treatments=("same", "far"), kind="equivalence", margin=0.02)
    table = compare(table_runs, [eq])
    got = {v.treatment: v for v in fixed_verdicts(table, [eq], table_runs)}
    assert got["same"].decision == "equivalent" and got["far"].decision == "better"
    # an equivalence row's p is its TOST's, family-adjusted (two rows, Holm): the larger one-sided flip p of
    # d + m and d - m
    d = np.array(tiny)
    one_sided = max(sum(sum(s * x for s, x in zip(signs, d + 0.02, strict=True)) >= (d + 0.02).sum() - 1e-12
                        for signs in itertools.product((1, -1), repeat=8)) / 256,
                    sum(sum(s * x for s, x in zip(signs, d - 0.02, strict=True)) <= (d - 0.02).sum() + 1e-12
                        for signs in itertools.product((1, -1), repeat=8)) / 256)
    assert one_sided == 1 / 256
    assert got["same"].p_value == pytest.approx(min(1.0, 2 * one_sided))  # Holm: the smaller of two, times 2


def test_a_pooled_comparison_gives_its_pooled_row_not_its_strata():
    rows = runs({"b": CLEAR}, "lr=1") + runs({"b": CLEAR[::-1]}, "lr=2")
    table_runs = pd.DataFrame(rows)
    comp = Comparison(name="pooled", control="a", treatments=("b",), pool=("lr",))
    table = compare(table_runs, [comp])
    (v,) = fixed_verdicts(table, [comp], table_runs)
    assert v.point == {"lr": "*"} and v.decision == "better"
    assert v.compute.runs == 32 and v.seeds == tuple(range(8))


def test_next_sizes_seeds_by_the_power_of_the_whole_family():
    """An undecided row's seeds come from `power_rows` at alpha over its family's rows: here a family of two
    comparisons of one row each, sized by `power_rows` over both (the machinery `reslab power` prints)."""
    table_runs = pd.DataFrame(runs({"n": NOISE, "m": [x + 0.005 for x in NOISE[::-1]]}))
    one = Comparison(name="one", control="a", treatments=("n",), mei=0.015)
    two = Comparison(name="two", control="a", treatments=("m",), mei=0.015)
    table = compare(table_runs, [one, two])
    verdicts = fixed_verdicts(table, [one, two], table_runs)
    sd = {r["comparison"]: r["sd"] for r in table.to_dict("records")}
    sized = power_rows([one, two], 8, {}, sd, 0.05)
    for v, row in zip(verdicts, sized, strict=True):
        assert v.decision == "undecided"
        need = row.seeds_recommended
        assert v.next.startswith(f"more seeds: ~{need - 8} ({need} in all for 80% power at its mei"), v.next


def design_runs(deltas: list[float]) -> pd.DataFrame:
    return pd.DataFrame(runs({"b": deltas}))


def test_sequential_decisions_futility_and_the_next_look():
    comp = Comparison(name="seq", control="a", treatments=("b",))
    design = SequentialDesign(start=4, batch=2, max=8)
    seeds = tuple(range(8))
    # no effect: stopped for futility at the look of 6 seeds (from half of max on, no verdict is reachable)
    table_runs = design_runs(NOISE)
    table = sequential_table(pairs_table(table_runs, [comp]), [comp], design, seeds, 0.05)
    assert table["decision"].tolist() == ["futile"]
    (v,) = sequential_verdicts(table, [comp], table_runs, design, seeds)
    assert v.decision == "futility" and v.next == "nothing" and v.p_value is None
    assert table["n"][0] == 6 and v.seeds == (0, 1, 2, 3, 4, 5) and v.compute.runs == 12
    assert v.e_value == table["e_value"][0] and v.level == 0.95
    # only the first look's 4 seeds finished: undecided, the next look is at 6 seeds
    partial = table_runs[table_runs["seed"] < 4]
    table = sequential_table(pairs_table(partial, [comp]), [comp], design, seeds, 0.05)
    (v,) = sequential_verdicts(table, [comp], partial, design, seeds)
    assert v.decision == "undecided" and v.next == "the next look: 6 seeds (+2)" and v.seeds == (0, 1, 2, 3)
    assert v.compute.runs == 8
    data = json.loads(json.dumps(v.to_dict(), allow_nan=False))  # an unbounded sequence is null, not Infinity
    assert data["decision"] == "undecided" and set(data) >= {"low", "high", "compute", "next", "tries", "alpha_used"}


def test_every_decision_word_is_one_of_five_and_a_verdict_refuses_another():
    assert DECISIONS == ("better", "worse", "equivalent", "undecided", "futility")
    with pytest.raises(ValueError, match="inconclusive"):
        Verdict(comparison="c", control="a", treatment="b", point={}, metric="m", direction="minimize",
                kind="superiority", decision="inconclusive", estimate=0.0, low=0.0, high=0.0, level=0.95,  # type: ignore[arg-type]
                p_value=None, e_value=None, seeds=(), compute=None, next="nothing")  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------------ the analysis plan
MAIN = Comparison(name="main", control="a", treatments=("b",), kind="equivalence", margin=0.01)
SIDE = Comparison(name="side", control="a", treatments=("c",), mei=0.02, family="other")


def test_a_margin_change_marks_that_comparison_alone_with_its_difference():
    old = analysis_of([MAIN, SIDE])
    new = analysis_of([Comparison(name="main", control="a", treatments=("b",), kind="equivalence", margin=0.02),
                       SIDE])
    assert analysis_changes(old, new) == {"main": ("margin 0.01 -> 0.02",)}
    assert plan_hash(old) != plan_hash(new) and plan_hash(old) == plan_hash(analysis_of([MAIN, SIDE]))


def test_study_wide_changes_mark_every_comparison_and_seeds_do_not():
    old = analysis_of([MAIN, SIDE], sequential=SequentialDesign(4, 2, 16))
    assert analysis_changes(old, analysis_of([MAIN, SIDE], sequential=SequentialDesign(4, 4, 32))) == {}
    new = analysis_of([MAIN, SIDE], alpha=0.1, sequential=SequentialDesign(4, 2, 16, test="t"))
    assert analysis_changes(old, new) == {name: ("alpha 0.05 -> 0.1", "sequential.test flip -> t")
                                          for name in ("main", "side")}


def test_a_comparison_added_to_a_family_marks_the_family_and_not_the_others():
    added = Comparison(name="more", control="a", treatments=("d",), kind="equivalence", margin=0.01)
    changes = analysis_changes(analysis_of([MAIN, SIDE]), analysis_of([MAIN, SIDE, added]))
    assert changes == {"main": ("family_members [main] -> [main, more]",), "more": ("comparison added",)}


def test_plan_status_counts_the_finished_runs_at_the_first_version_that_showed_the_change():
    frozen = analysis_of([MAIN, SIDE])
    edited = analysis_of([MAIN, Comparison(name="side", control="a", treatments=("c",), mei=0.05, family="other")])
    versions = [{"hash": plan_hash(frozen), "analysis": frozen, "finished_runs": 0},
                {"hash": plan_hash(edited), "analysis": edited, "finished_runs": 6}]
    status = plan_status(versions, edited, finished_now=10)
    assert status.state == "changed" and set(status.changes) == {"side"}
    assert status.changes["side"].why() == "analysis changed after 6 finished runs: mei 0.02 -> 0.05"
    assert status.frozen_hash == plan_hash(frozen) and status.current_hash == plan_hash(edited)
    # a change seen before any run finished could not follow a result: it is the plan
    early = [{**versions[0]}, {**versions[1], "finished_runs": 0}]
    assert plan_status(early, edited, 10).state == "frozen"
    # not yet recorded (a read-only workspace): the finished runs now
    assert plan_status(versions[:1], edited, 10).changes["side"].finished_runs == 10
    never = plan_status([], edited, 10)
    assert never.state == "not frozen" and not never.changes and never.to_dict()["frozen_hash"] is None


def test_a_comparison_declared_before_its_treatment_had_a_result_is_not_exploratory():
    """A loop re-submits one study with a new arm and its comparison after the control has run: the new
    comparison was declared before any result it decides on existed, so it is the plan, not a change. Once its
    treatment has runs, a change to it (a margin) is one; without the per-arm counts (an older workspace) the
    change stands."""
    frozen = analysis_of([MAIN])
    proposal = Comparison(name="main", control="a", treatments=("d",))
    asked = analysis_of([proposal])
    v1 = {"hash": plan_hash(frozen), "analysis": frozen, "finished_runs": 0, "finished_by_arm": {}}
    v2 = {"hash": plan_hash(asked), "analysis": asked, "finished_runs": 6, "finished_by_arm": {"a": 3, "b": 3}}
    assert plan_status([v1, v2], asked, 9, {"a": 3, "b": 3, "d": 3}).state == "frozen"
    assert plan_status([v1], asked, 6, {"a": 3, "b": 3}).state == "frozen"  # not recorded yet: the counts now
    with_margin = analysis_of([Comparison(name="main", control="a", treatments=("d",), mei=0.05)])
    changed = plan_status([v1, v2], with_margin, 9, {"a": 3, "b": 3, "d": 3})
    assert "mei none -> 0.05" in changed.changes["main"].diffs
    older = [{k: v for k, v in version.items() if k != "finished_by_arm"} for version in (v1, v2)]
    assert set(plan_status(older, asked, 9).changes) == {"main"}


def test_verdicts_carry_the_plans_marks_and_a_declared_exploratory_one():
    table_runs = pd.DataFrame(runs({"b": CLEAR, "c": NOISE}))
    main = Comparison(name="main", control="a", treatments=("b",))
    side = Comparison(name="side", control="a", treatments=("c",), exploratory=True, family="x")
    frozen = analysis_of([main, side])
    edited = analysis_of([Comparison(name="main", control="a", treatments=("b",), mei=0.01), side])
    status = plan_status([{"hash": plan_hash(frozen), "analysis": frozen, "finished_runs": 4}], edited, 16)
    table = compare(table_runs, [main, side])
    got = {v.comparison: v for v in fixed_verdicts(table, [main, side], table_runs, plan=status)}
    assert got["main"].exploratory and got["main"].exploratory_why == \
        "analysis changed after 16 finished runs: mei none -> 0.01"
    assert got["side"].exploratory and got["side"].exploratory_why == "declared exploratory in the study"


def test_the_reports_tables_mark_the_changed_comparisons_alone():
    table_runs = pd.DataFrame(runs({"b": CLEAR, "c": NOISE}))
    main = Comparison(name="main", control="a", treatments=("b",))
    side = Comparison(name="side", control="a", treatments=("c",), family="x")
    notes = {"main": "analysis changed after 6 finished runs: mei 0.01 -> 0.02"}
    page = "\n".join(paired_section(compare(table_runs, [main, side]), notes=notes))
    assert ('<p class="flags" id="exploratory-paired-main"><b>main is exploratory</b>: analysis changed after 6 '
            "finished runs: mei 0.01 -&gt; 0.02") in page and "exploratory-paired-side" not in page
    design = SequentialDesign(start=4, batch=2, max=8)
    seq = sequential_table(pairs_table(table_runs, [main, side]), [main, side], design, tuple(range(8)))
    page = "\n".join(sequential_section(seq, notes=notes))
    assert page.count("main is exploratory") == 1 and "side is exploratory" not in page
    assert "main is exploratory" not in "\n".join(paired_section(compare(table_runs, [main, side])))
