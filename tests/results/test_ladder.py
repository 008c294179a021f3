"""`results.ladder`: a study's ladder read out from a runs table. Synthetic ladders whose losses
come from a known law (the control's L(C) = E + A C^-alpha, the treatment's the control's at k x
its compute) plus per-seed noise, so the multiplier the readout must find is known: k in FLOPs,
and k times the throughput ratio in wall-clock."""

from __future__ import annotations

import functools
import math

import numpy as np
import pandas as pd
import pytest

from reslab.results.comparison import Comparison
from reslab.results.ladder import LadderScope, ladder_readout, ladder_text
from reslab.results.scaling import PowerLaw

LAW = PowerLaw(E=1.8, A=1.0e4, alpha=0.3)  # L - E from 0.63 to 0.08 nats over the rungs
FLOPS = np.geomspace(1e14, 1e17, 5)
PARAMS = np.geomspace(2e7, 6e8, 5)
TOKENS = 20 * PARAMS
KEYS = tuple(f"model.preset=r{i}" for i in range(5))
COMP = Comparison(name="main", control="control", treatments=("fast", "slow"), metric="val_loss_tail")


def runs_table(seeds: int = 8, k: float = 1.25, speed: float = 0.8, sd: float = 0.003, seed: int = 0,
               missing: tuple[str, int, int] | None = None) -> pd.DataFrame:
    """Control at LAW; `fast` reaches the control's loss at k x its compute and runs at the same
    tokens/s; `slow` is the same law at `speed` x the throughput. Every run computes at one FLOP
    rate, so wall-clock is proportional to FLOPs. Each seed shares one offset in
    every arm and rung (the pairing) plus independent noise `sd`."""
    rng = np.random.default_rng(seed)
    rows = []
    for s in range(seeds):
        shared = rng.normal(0, 0.01)
        for arm, mult, rate in (("control", 1.0, 1.0), ("fast", k, 1.0), ("slow", k, speed)):
            for j, key in enumerate(KEYS):
                loss = float(LAW.loss(mult * FLOPS[j])) + shared + rng.normal(0, sd)
                status = "FAILED" if missing == (arm, j, s) else "FINISHED"
                rows.append({"run_id": f"{arm}-{j}-{s}", "arm": arm, "grid_key": key, "seed": s, "status": status,
                             "val_loss_tail": loss if status == "FINISHED" else math.nan,
                             # one FLOP rate at every size (one MFU): wall-clock proportional to FLOPs
                             "tokens": TOKENS[j],
                             "tokens_per_s": rate * TOKENS[j] * 1e12 / FLOPS[j] * (1 + rng.normal(0, 0.01))})
    return pd.DataFrame(rows)


def cost() -> dict[tuple[str, str], tuple[float, float]]:
    return {(arm, key): (FLOPS[j], PARAMS[j]) for arm in ("control", "fast", "slow") for j, key in enumerate(KEYS)}


def readout(table: pd.DataFrame, **kw):
    return ladder_readout(table, [COMP], [LadderScope("", KEYS)], cost(), draws=100, **kw)


@functools.cache
def default_readout():
    """The readout of the default synthetic ladder, shared by the tests that only read it."""
    return runs_table(), readout(runs_table())


def test_the_readout_recovers_a_known_flop_and_wall_clock_multiplier():
    _, result = default_readout()
    rows = result.summary.set_index("treatment")
    fast, slow = rows.loc["fast"], rows.loc["slow"]
    for row in (fast, slow):
        assert row["seeds"] == 8 and row["rungs"] == 5 and row["flags"] == ""
        assert row["k_flops_low"] < 1.25 < row["k_flops_high"], row
        assert row["flops_constant"]  # one law shifted in compute: equal exponents
        assert abs(math.log(row["k_flops"] / 1.25)) < 0.1
    # same FLOPs, 0.8x the tokens/s: the control needs 1.25x the FLOPs but 1.25 x 0.8 = 1.0x the time
    assert fast["k_wall_low"] < 1.25 < fast["k_wall_high"]
    assert slow["k_wall_low"] < 1.0 < slow["k_wall_high"] and slow["k_wall"] < fast["k_wall"]
    assert slow["statement"].startswith(f"slow matches control at {slow['k_flops']:.2f}x [")
    # issue 35: the end rungs' k always shown, and the drift of log k between them with its interval
    assert f"{slow['k_flops_first']:.2f}x [" in slow["statement"] and "at the first rung" in slow["statement"]
    assert f"{slow['k_flops_last']:.2f}x [" in slow["statement"] and "log k last - first +" in slow["statement"]
    assert slow["k_flops_drift_low"] <= 0 <= slow["k_flops_drift_high"]
    assert "wall-clock (" in slow["statement"] and slow["statement"].endswith("at the last)")
    rungs = result.rungs[result.rungs["treatment"] == "fast"]
    assert list(rungs["rung"]) == [0, 1, 2, 3, 4] and list(rungs["grid_key"]) == list(KEYS)
    assert np.all(rungs["mean_delta"] < 0)  # 1.25x the compute: a lower loss at every rung
    np.testing.assert_allclose(rungs["flops_treatment"], FLOPS)
    np.testing.assert_allclose(rungs["wall_s_treatment"], FLOPS / 1e12, rtol=0.05)


def test_a_multiplier_that_drifts_with_compute_is_said_so():
    table = runs_table()
    fast = table["arm"] == "fast"
    j = table.loc[fast, "grid_key"].map(KEYS.index)
    # a steeper law for the treatment: equal loss at the first rung, a growing gain above it
    table.loc[fast, "val_loss_tail"] = (LAW.E + LAW.A * (FLOPS[j] ** -0.36) * FLOPS[0] ** 0.06
                                        + np.random.default_rng(1).normal(0, 0.002, fast.sum()))
    row = readout(table).summary.set_index("treatment").loc["fast"]
    assert not row["flops_constant"] and row["alpha_gap_low"] > 0
    assert row["k_flops_last"] > row["k_flops_first"]
    assert "k drifts with compute" in row["statement"] and "exponents differ by +" in row["statement"]


def test_a_seed_missing_one_run_leaves_the_ladder_with_its_reason():
    result = readout(runs_table(missing=("slow", 2, 3)))
    rows = result.summary.set_index("treatment")
    assert rows.loc["fast", "seeds"] == 8 and rows.loc["fast", "flags"] == ""
    assert rows.loc["slow", "seeds"] == 7
    assert rows.loc["slow", "flags"] == "seeds 3 left out: a run of theirs did not finish"


def test_too_few_seeds_or_rungs_give_no_multiplier_and_say_why():
    few = readout(runs_table(seeds=2)).summary.iloc[0]
    assert math.isnan(few["k_flops"]) and "2 complete seeds: an interval for k needs 3" in few["flags"]
    assert few["statement"].startswith("fast vs control: no multiplier (")
    two = ladder_readout(runs_table(), [COMP], [LadderScope("", KEYS[:2])], cost(), draws=20).summary.iloc[0]
    assert "2 rungs: a multiplier needs 3" in two["flags"] and not math.isnan(two["trend_slope"])


def test_the_trend_is_the_paired_slope_of_the_delta_on_log_size():
    table, result = default_readout()
    ctrl = table[table["arm"] == "control"].pivot(index="seed", columns="grid_key", values="val_loss_tail")[list(KEYS)]
    fast = table[table["arm"] == "fast"].pivot(index="seed", columns="grid_key", values="val_loss_tail")[list(KEYS)]
    x = np.log(PARAMS) - np.log(PARAMS).mean()
    slopes = (fast.to_numpy() - ctrl.to_numpy()) @ x / (x @ x)
    row = result.summary.set_index("treatment").loc["fast"]
    assert row["trend_slope"] == pytest.approx(slopes.mean())
    # a gain shrinking in nats as the loss flattens: every seed's slope has one sign, p = 2/2^8
    assert np.all(slopes > 0) and row["trend_p"] == pytest.approx(2 / 2**8)


def test_a_comparison_on_a_metric_that_is_not_a_loss_has_no_ladder():
    speed = Comparison(name="speed", control="control", treatments=("fast",), metric="tokens_per_s",
                       direction="maximize")
    result = ladder_readout(runs_table(), [speed], [LadderScope("", KEYS)], cost())
    assert result.summary.empty and result.rungs.empty and ladder_text(result) == ""


def test_the_terminal_text_names_the_statement_trend_and_every_rung():
    text = ladder_text(default_readout()[1])
    lines = text.splitlines()
    assert lines[0].startswith("across scale (val_loss_tail): k = the compute the control needs")
    assert any(line.startswith("main: fast matches control at ") for line in lines)
    assert sum(line.strip().startswith(("0: preset=r0", "4: preset=r4")) for line in lines) == 4  # two treatments
