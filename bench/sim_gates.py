"""Gates across scale by simulation (issue 54), printed as markdown tables with their replication counts:

1. projection coverage: synthetic seed-paired ladders with known laws (Marin's baseline through 2.534 at 1e21
   and 2.205 at 1e23 over a floor of 1.6; the arm worth k = 1.25x; each seed an offset of SD 0.01 in both arms
   at every rung plus each run's own noise of SD 0.004; 6 seeds on Marin's four rung computes), projected
   (`results.projection.project`) inside the rungs and 1-3 decades past them: how often the 95% intervals of
   k, of the loss gap, of the throughput-adjusted k_wall (tokens/s per run lognormal, 5% SD; the arm at 0.8x
   the control's rate) and of the arm's own loss hold the true values ("flagged": more than 2 decades past);
   for the fixed floor (E known: Marin's form), the fitted floor (reslab's law; fewer replications: each
   bootstrap refits 2 x `--draws` Huber laws), and a fixed floor set 0.4 nats too low and one 0.4
   too high (misspecified). With each fixed-floor row, the backtest (fit without the largest rung, predict
   it): how often its error's interval held 0 (gap and k), and the median error.
2. gates (`results.gates`): Marin's two gates (Gate 1: rungs 3.82e17 and 2.81e18, a speed-up at both; Gate 2:
   all four rungs, k projected to 1e21), looks at 4, 6, 8 seeds, alpha 0.05, fixed floor 1.6, at true k = 1.0,
   1.1, 1.25 and at a ladder whose exponents differ (k = 1.3 at the first rung, 0.95 at 1e21: a gain that
   shrinks with scale). Per scenario: promoted through both gates, dropped, stopped undecided, the wrong
   promotions and wrong drops (against the true k at the deciding gate's points), the mean seeds per gate and
   the mean FLOPs (both arms); then the full ladder (all four rungs, one look) at 4, 6, 8 and 12 fixed seeds,
   the same alpha, and the saving against the full ladder whose promotion rate at k = `--match` (default 1.1)
   equals the gates' (seeds interpolated between the simulated counts): the same error bounds, the same power.
   The gates' default budget bounds each kind of wrong decision by alpha; the "errors joint" rows bound them
   all together.

    python bench/sim_gates.py [--reps 400 --coverage-reps 2000 --fitted-reps 60 --draws 200 --match 1.1]

One core, a few minutes at the defaults (the fitted-floor rows take most of it).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
from _args import at_least

from reslab.results.gates import Gate, GatePlan, Scenario, SimSummary, fixed_plan, simulate
from reslab.results.projection import MAX_DECADES, LawForm, Throughput, backtest, project
from reslab.results.scaling import PowerLaw

FLOOR = 1.6
EXPONENT = math.log(0.934 / 0.605) / math.log(100.0)  # through 2.534 at 1e21 and 2.205 at 1e23
CONTROL = PowerLaw(FLOOR, 0.934 * 1e21**EXPONENT, EXPONENT)
RUNGS = np.array([3.82e17, 2.81e18, 1.16e19, 3.46e19])
INSIDE = np.array([1e18, 1e19])
PAST = np.array([3.46e20, 1e21, 1e23])  # 1, 1.46 and 3.46 decades past the largest rung
SEEDS = 6
RATIO = 0.8  # the arm's FLOP rate over the control's


def shifted(k: float) -> PowerLaw:
    return PowerLaw(FLOOR, CONTROL.A * k**-CONTROL.alpha, CONTROL.alpha)


def crossing(k_first: float, k_target: float, target: float) -> PowerLaw:
    """A law over the same floor worth k_first x compute at the first rung and k_target x at `target`."""
    x = np.log([RUNGS[0], target])
    y = np.log(CONTROL.loss(np.array([k_first * RUNGS[0], k_target * target])) - FLOOR)
    alpha = -(y[1] - y[0]) / (x[1] - x[0])
    return PowerLaw(FLOOR, float(np.exp(y[0] + alpha * x[0])), float(alpha))


def _coverage(form: LawForm, reps: int, draws: int, with_backtest: bool) -> dict[str, np.ndarray | float]:
    k, at = 1.25, np.concatenate([INSIDE, PAST])
    scenario = Scenario("", CONTROL, shifted(k), RUNGS)
    gap = scenario.arm.loss(at) - CONTROL.loss(at)
    rng = np.random.default_rng(7)
    hits, back, errors = np.zeros((4, at.size)), np.zeros(2), []
    arm_loss = scenario.arm.loss(at)
    tokens = RUNGS / 6e8
    for rep in range(reps):
        control, arm = scenario.draw(rng, SEEDS)
        tps = (Throughput(1e5 * rng.lognormal(0, 0.05, (SEEDS, 4)), tokens),
               Throughput(RATIO * 1e5 * rng.lognormal(0, 0.05, (SEEDS, 4)), tokens))
        p = project(control, arm, at, form=form, draws=draws, seed=rep, throughput=tps)
        hits += [(p.k_low <= k) & (k <= p.k_high), (p.gap_low <= gap) & (gap <= p.gap_high),
                 (p.k_wall_low <= k * RATIO) & (k * RATIO <= p.k_wall_high),
                 (p.losses[1, 1] <= arm_loss) & (arm_loss <= p.losses[1, 2])]
        if with_backtest:
            b = backtest(control, arm, form=form, draws=draws, seed=rep)
            back += (b.gap_covered, b.k_covered)
            errors.append(abs(b.gap_error))
    return {"k": hits[0] / reps, "gap": hits[1] / reps, "wall": hits[2] / reps, "loss": hits[3] / reps, "at": at,
            "backtest": back / reps,
            "error": float(np.median(errors)) if errors else math.nan}


def coverage_table(reps: int, fitted_reps: int, draws: int) -> list[str]:
    rows = [("fixed floor 1.6 (true)", LawForm(FLOOR), reps, True),
            ("fitted floor", LawForm(None), fitted_reps, False),
            ("fixed floor 1.2 (0.4 too low)", LawForm(FLOOR - 0.4), reps, True),
            ("fixed floor 2.0 (0.4 too high)", LawForm(FLOOR + 0.4), reps, True)]
    lines = ["| law | reps | compute | decades past | flagged | cover k | cover gap | cover k_wall | cover arm loss |",
             "|---|---|---|---|---|---|---|---|---|"]
    notes = []
    for name, form, n, with_backtest in rows:
        start = time.perf_counter()
        got = _coverage(form, n, draws, with_backtest)
        at = got["at"]
        assert isinstance(at, np.ndarray)
        for j, c in enumerate(at):
            past = math.log10(c / RUNGS[-1])
            flagged = "yes" if past > MAX_DECADES else ""
            lines.append(f"| {name} | {n} | {c:.3g} | {past:+.2f} | {flagged} | {got['k'][j]:.3f} | "  # type: ignore[index]
                         f"{got['gap'][j]:.3f} | {got['wall'][j]:.3f} | {got['loss'][j]:.3f} |")  # type: ignore[index]
        if with_backtest:
            back = got["backtest"]
            assert isinstance(back, np.ndarray)
            notes.append(f"- {name}: backtest (fit rungs 1-3, predict rung 4): the error's interval held 0 for the gap "
                         f"in {back[0]:.3f} and for k in {back[1]:.3f} of {n}; median |gap error| {got['error']:.4f} "
                         "nats")
        notes.append(f"- {name}: {time.perf_counter() - start:.0f} s")
    return lines + [""] + notes


def _row(name: str, s: SimSummary, fixed: float | None = None) -> str:
    saved = "" if fixed is None else f"{1 - s.mean_compute / fixed:+.0%}"
    return (f"| {name} | {s.scenario} | {s.reps} | {s.promoted:.3f} | {s.dropped:.3f} | {s.undecided:.3f} | "
            f"{s.wrong_promotion:.3f} | {s.wrong_drop:.3f} | {s.mean_seeds:.2f} | {s.mean_compute:.3g} | {saved} |")


FIXED = (4, 6, 8, 12)


def _equal_power_seeds(fixed: dict[int, dict[str, SimSummary]], name: str, power: float) -> float:
    """The fixed seed count whose promotion rate at scenario `name` equals `power`, linear between the simulated
    counts (a design that mixes its two neighbours); the largest count where none reaches it."""
    got = [(n, fixed[n][name].promoted) for n in FIXED]
    for (n0, p0), (n1, p1) in zip(got, got[1:], strict=False):
        if p0 >= power:
            return float(n0)
        if p1 >= power:
            return n0 + (n1 - n0) * (power - p0) / (p1 - p0)
    return float(FIXED[-1])


def gates_table(reps: int, draws: int, match_k: float) -> list[str]:
    plan = GatePlan((Gate((0, 1), 1.0, name="gate 1"), Gate((0, 1, 2, 3), 1.0, target=1e21, name="gate 2")),
                    looks=(4, 6, 8), alpha=0.05, form=LawForm(FLOOR), draws=draws)
    scenarios = [Scenario(f"k={k}", CONTROL, shifted(k), RUNGS) for k in sorted({1.0, 1.1, 1.25, match_k})]
    scenarios.append(Scenario("k 1.3 -> 0.95 (exponents differ)", CONTROL, crossing(1.3, 0.95, 1e21), RUNGS))
    gated = {s.name: simulate(plan, s, reps) for s in scenarios}
    fixed = {n: {s.name: simulate(fixed_plan(plan, n), s, reps) for s in scenarios} for n in FIXED}
    target = gated[f"k={match_k}"].promoted
    seeds = _equal_power_seeds(fixed, f"k={match_k}", target)
    per_seed = 2 * float(RUNGS.sum())  # both arms at every rung
    lines = [f"errors '{plan.errors}': gate 1 reads lower bounds at {plan.levels(0)[0]:.4f}, upper at "
             f"{plan.levels(0)[1]:.4f} (two-sided levels), gate 2 at {plan.levels(1)[0]:.4f}; alpha {plan.alpha} "
             f"({plan.gate_alpha():.3f} per gate). The full ladder at the gates' power at k = {match_k} "
             f"({target:.3f}): {seeds:.2f} seeds ({seeds * per_seed:.3g} FLOPs; linear between the simulated seed "
             "counts); 'saved' is against it", "",
             "| design | scenario | reps | promoted | dropped | undecided | wrong promotion | wrong drop | "
             "seeds/gate | FLOPs | saved vs equal-power full ladder |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for s in scenarios:
        lines.append(_row("gates 4/6/8", gated[s.name], seeds * per_seed))
    joint = replace(plan, errors="joint")  # every decision right with probability 1 - alpha: wider bounds
    lines += [_row("gates 4/6/8, errors joint", simulate(joint, s, reps)) for s in scenarios]
    for n in FIXED:
        lines += [_row(f"full ladder, {n} seeds", fixed[n][s.name]) for s in scenarios]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=at_least(10), default=400, help="simulated ladders per gates row")
    parser.add_argument("--coverage-reps", type=at_least(10), default=2000,
                        help="simulated ladders per fixed-floor coverage row (Monte Carlo SE 0.005 at 95%%)")
    parser.add_argument("--fitted-reps", type=at_least(5), default=60)
    parser.add_argument("--draws", type=at_least(20), default=200)
    parser.add_argument("--match", type=at_least(1.0, float), default=1.1,
                        help="the true k at which the fixed design's power is matched to the gates'")
    args = parser.parse_args()
    print("## Projection coverage (95% intervals, 6 seeds, true k = 1.25, rate ratio 0.8)\n")
    print("\n".join(coverage_table(args.coverage_reps, args.fitted_reps, args.draws)))
    print("\n## Gates: Marin's two gates against the full ladder\n")
    print("\n".join(gates_table(args.reps, args.draws, args.match)))


if __name__ == "__main__":
    main()
