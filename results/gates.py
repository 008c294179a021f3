"""Gates across scale (issue 54): promote a treatment up a ladder while its compute-equivalent multiplier
holds, drop it when it does not, add seeds while undecided; and, by simulation through the same code,
what that costs and saves against a full ladder with fixed seeds.

A plan (`GatePlan`) is ordered gates, each a set of the ladder's rungs and a rule, read at pre-declared
looks (seed counts). At a look the gate fits both arms on its rungs with the first n seeds
(`projection.project`, the plan's `LawForm`) and reads k, with its paired seed-bootstrap interval, at
the gate's points: each of its rungs' compute, or the gate's `target` compute (the projected gain):

- promote when k's lower bound exceeds the gate's threshold at every point (Marin's Gate 1: a speed-up
  at both rungs);
- drop (futility) when k's upper bound lies below the threshold at some point;
- otherwise add seeds (the next look), and at the last look stop undecided (not promoted).

Only promoted treatments train at the next gate. A gate's rungs may repeat an earlier gate's (Marin's
Gate 2 refits on all four rungs): a rung's runs are trained once per seed and counted once.

The error budget, and why it holds. A decision is wrong only if a bound misses the k it bounds: a
wrong promotion needs a lower bound above a true k <= threshold, at a point where the truth is so (a
point fixed by the truth, not chosen by the data); a wrong drop needs an upper bound below a true
k >= threshold, at whichever point the data picked. alpha is split by Bonferroni over gates and
treatments: alpha_g = alpha / (gates x treatments) at each gate, per treatment (`GatePlan.gate_alpha`).
Within a gate the looks are declared before any data, so a union bound over them is a valid confidence
sequence whenever the plan stops. Two budgets (`GatePlan.errors`):

- "each" (default): each kind of wrong decision at most alpha in all (alpha_g per gate). The lower
  bounds are one-sided at alpha_g / looks (the two-sided interval at 1 - 2 alpha_g / looks); the upper
  bounds at alpha_g / (looks x points), the points too being a union (a drop reads any point).
- "joint": the whole run's decisions all right with probability >= 1 - alpha: every interval two-sided
  at 1 - alpha_g / (looks x points), so P(any bound of the run misses) <= alpha.

`GatePlan.levels` gives the two-sided levels the lower and the upper bounds are read at. Either way it
assumes each fixed-n interval covers at its level, which bench/sim_gates.py measures (the fixed-floor
interval is the paired t interval of a smooth function of the seeds' means: 94-96% at 95%). Not an
e-process on per-seed gaps (`results.sequential`): k is a function of both arms' fits over all seeds,
not a mean of per-seed quantities whose null is symmetric about 0, and a finite union bound needs no
such assumption. It is conservative (Bonferroni over looks ignores how much successive looks share),
which costs seeds, not errors.

The simulation (`simulate`): seed-paired synthetic ladders from known laws (each seed an offset shared
by both arms at every rung plus each run's own noise) through `run_gates`, counting wrong promotions and
wrong drops against the true k at each gate's points, the seeds and the compute used; `fixed_plan` is
the full ladder read once at a fixed seed count, the design the gates are compared with.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Literal

import numpy as np

from reslab.common.errors import ConfigError
from reslab.results.projection import DEFAULT_DRAWS, LawForm, project
from reslab.results.scaling import Ladder, PowerLaw, multiplier

__all__ = ["GATE_COLUMNS", "Gate", "GateLook", "GateOutcome", "GatePlan", "Scenario", "SimSummary", "decide_look",
           "fixed_plan", "gate_rows", "look_seed", "run_gates", "simulate"]

Decision = Literal["promote", "drop", "continue", "undecided"]
TIE = 1e-9


@dataclass(frozen=True)
class Gate:
    """One gate: the indices of the ladder's rungs it fits on, the multiplier to beat, and where k is read
    (None: at each of its rungs' compute; a compute: k projected there)."""

    rungs: tuple[int, ...]
    threshold: float = 1.0
    target: float | None = None
    name: str = ""

    def points(self, compute: np.ndarray) -> np.ndarray:
        """The computes k is read at, from the arm's rung computes (all the ladder's rungs)."""
        return np.array([self.target]) if self.target is not None else compute[list(self.rungs)]


@dataclass(frozen=True)
class GatePlan:
    """Ordered gates read at the seed counts `looks`; `alpha` the whole plan's error budget over `treatments`
    treatments (the module doc); `form` the law both arms are fitted with; `draws` the bootstrap's."""

    gates: tuple[Gate, ...]
    looks: tuple[int, ...] = (4, 6, 8)
    alpha: float = 0.05
    treatments: int = 1
    form: LawForm = field(default_factory=LawForm)
    draws: int = DEFAULT_DRAWS
    errors: Literal["each", "joint"] = "each"

    def __post_init__(self) -> None:
        if not self.gates:
            raise ConfigError("gates: expected at least one gate")
        if list(self.looks) != sorted(set(self.looks)) or self.looks[0] < 3:
            raise ConfigError(f"gates.looks: expected increasing seed counts from 3, got {list(self.looks)}")
        if self.errors not in ("each", "joint"):
            raise ConfigError(f"gates.errors: {self.errors!r} is not a budget; allowed: each (each kind of wrong "
                              "decision within alpha), joint (all decisions right with probability 1 - alpha)")
        if not 0 < self.alpha < 1:
            raise ConfigError(f"gates.alpha: expected 0 < alpha < 1, got {self.alpha!r}")
        for i, gate in enumerate(self.gates):
            if len(set(gate.rungs)) < self.form.min_rungs:
                raise ConfigError(f"gates[{i}].rungs: the law needs {self.form.min_rungs} distinct rungs "
                                  f"({'fitted' if self.form.floor is None else 'fixed'} floor), got {list(gate.rungs)}")
            if not (math.isfinite(gate.threshold) and gate.threshold > 0):
                raise ConfigError(f"gates[{i}].threshold: expected a multiplier > 0, got {gate.threshold!r}")

    def gate_alpha(self) -> float:
        """The error spent at each gate, per treatment."""
        return self.alpha / (len(self.gates) * self.treatments)

    def levels(self, gate: int) -> tuple[float, float]:
        """The two-sided levels of the intervals whose lower and whose upper bounds `gate` reads (module doc)."""
        points = 1 if self.gates[gate].target is not None else len(self.gates[gate].rungs)
        share = self.gate_alpha() / len(self.looks)
        if self.errors == "joint":
            return (1.0 - share / points,) * 2
        return 1.0 - 2.0 * share, 1.0 - 2.0 * share / points


@dataclass(frozen=True)
class GateLook:
    """One look at one gate for one treatment: k with its bounds at the gate's points (each at its level,
    `GatePlan.levels`), and the decision."""

    gate: int
    n: int
    points: np.ndarray
    k: np.ndarray
    low: np.ndarray
    high: np.ndarray
    decision: Decision


def decide_look(plan: GatePlan, gate: int, control: Ladder, arm: Ladder, seed: int = 0) -> GateLook:
    """The decision at `gate` from every seed of `control` and `arm` (ladders over all the study's rungs, seeds
    paired); a look is read at one of the plan's seed counts."""
    g = plan.gates[gate]
    n = control.loss.shape[0]
    if n not in plan.looks:
        raise ValueError(f"a look is read at the plan's seed counts {list(plan.looks)}, got {n} seeds")
    cols = list(g.rungs)
    where = g.points(arm.compute)
    ladders = Ladder(control.compute[cols], control.loss[:, cols]), Ladder(arm.compute[cols], arm.loss[:, cols])
    lower, upper = plan.levels(gate)
    got = project(*ladders, where, form=plan.form, level=lower, draws=plan.draws, seed=seed)
    # the same draws (seed) at the upper bounds' level: one bootstrap read at two quantiles
    wide = got if upper == lower else project(*ladders, where, form=plan.form, level=upper, draws=plan.draws,
                                              seed=seed)
    low, high = np.nan_to_num(got.k_low, nan=0.0), np.nan_to_num(wide.k_high, nan=math.inf)
    decision: Decision
    if np.all(low > g.threshold):
        decision = "promote"
    elif np.any(high < g.threshold):
        decision = "drop"
    else:
        decision = "undecided" if n >= plan.looks[-1] else "continue"
    return GateLook(gate, n, where, got.k, low, high, decision)


@dataclass(frozen=True)
class GateOutcome:
    """Where a treatment stopped at a gate: the last look, the seeds it used there and the FLOPs its runs took
    up to then (every gate so far), and its looks."""

    gate: int
    treatment: str
    decision: Decision
    seeds: int
    compute: float
    last: GateLook
    looks: tuple[GateLook, ...]


def look_seed(gate: int, n: int, seed: int = 0) -> int:
    """The bootstrap's seed at `gate`'s look at n seeds: `run_gates` and a study's driver
    (`orchestrator.driving.gates`) use it alike, so a study's decisions replay from its finished runs."""
    return seed + 7919 * gate + n


def _first(ladder: Ladder, n: int) -> Ladder:
    return Ladder(ladder.compute, ladder.loss[:n])


def _spent(trained: np.ndarray, compute: np.ndarray) -> float:
    return float(trained @ compute)


def run_gates(plan: GatePlan, control: Ladder, arms: Mapping[str, Ladder],
              seed: int = 0) -> tuple[list[GateOutcome], float]:
    """The plan over ladders holding every seed a look could read (loss[max look, rungs]), read in seed order:
    per gate and treatment still in, its outcome; and the control's FLOPs (its runs at each rung, to the most
    seeds any treatment used there). What a study does look by look, replayed on its runs."""
    trained = {name: np.zeros(a.compute.size) for name, a in arms.items()}
    trained_control = np.zeros(control.compute.size)
    alive, out = list(arms), []
    for gi, gate in enumerate(plan.gates):
        promoted = []
        for name in alive:
            looks = []
            for n in plan.looks:
                look = decide_look(plan, gi, _first(control, n), _first(arms[name], n), seed=look_seed(gi, n, seed))
                looks.append(look)
                trained[name][list(gate.rungs)] = np.maximum(trained[name][list(gate.rungs)], n)
                trained_control[list(gate.rungs)] = np.maximum(trained_control[list(gate.rungs)], n)
                if look.decision != "continue":
                    break
            out.append(GateOutcome(gi, name, looks[-1].decision, looks[-1].n,
                                   _spent(trained[name], arms[name].compute), looks[-1], tuple(looks)))
            if looks[-1].decision == "promote":
                promoted.append(name)
        alive = promoted
    return out, _spent(trained_control, control.compute)


GATE_COLUMNS = ("gate", "name", "treatment", "decision", "seeds", "compute", "looks", "threshold", "point", "k",
                "k_low", "k_high", "level_low", "level_high")


def gate_rows(plan: GatePlan, outcomes: list[GateOutcome]) -> list[dict[str, object]]:
    """One row per gate, treatment and point (`GATE_COLUMNS`): the decision, the seeds and FLOPs it used, the
    seed counts it looked at, and k with its bounds at the last look (each bound at its level)."""
    rows = []
    for o in outcomes:
        gate, (level_low, level_high) = plan.gates[o.gate], plan.levels(o.gate)
        for j, point in enumerate(o.last.points):
            rows.append({"gate": o.gate, "name": gate.name or f"gate {o.gate + 1}", "treatment": o.treatment,
                         "decision": o.decision, "seeds": o.seeds, "compute": o.compute,
                         "looks": [look.n for look in o.looks], "threshold": gate.threshold, "point": float(point),
                         "k": float(o.last.k[j]), "k_low": float(o.last.low[j]), "k_high": float(o.last.high[j]),
                         "level_low": level_low, "level_high": level_high})
    return rows


def fixed_plan(plan: GatePlan, seeds: int) -> GatePlan:
    """The full ladder with fixed seeds: one gate on every rung of the plan's, read once at `seeds`, by the
    last gate's rule and points, at the same alpha."""
    rungs = tuple(sorted({r for g in plan.gates for r in g.rungs}))
    last = plan.gates[-1]
    return replace(plan, gates=(Gate(rungs, last.threshold, last.target, "full ladder"),), looks=(seeds,))


@dataclass(frozen=True)
class Scenario:
    """A synthetic ladder: the true laws and the rungs' compute (both arms'), each seed an offset of SD `shared`
    in both arms at every rung, each run its own noise of SD `own`."""

    name: str
    control: PowerLaw
    arm: PowerLaw
    compute: np.ndarray
    shared: float = 0.01
    own: float = 0.004

    def draw(self, rng: np.random.Generator, seeds: int) -> tuple[Ladder, Ladder]:
        offset = rng.normal(0.0, self.shared, (seeds, 1))
        noise = rng.normal(0.0, self.own, (2, seeds, self.compute.size))
        return (Ladder(self.compute, self.control.loss(self.compute)[None, :] + offset + noise[0]),
                Ladder(self.compute, self.arm.loss(self.compute)[None, :] + offset + noise[1]))

    def true_k(self, points: np.ndarray) -> np.ndarray:
        return multiplier(self.control, self.arm, points)


@dataclass(frozen=True)
class SimSummary:
    """What a plan did over `reps` simulated ladders of one scenario: the share promoted through every gate,
    dropped at some gate, stopped undecided; the wrong promotions and wrong drops (against the true k at the
    deciding gate's points); the mean seeds per gate reached and the mean FLOPs (both arms)."""

    scenario: str
    reps: int
    promoted: float
    dropped: float
    undecided: float
    wrong_promotion: float
    wrong_drop: float
    mean_compute: float
    mean_seeds: float


def _wrong(plan: GatePlan, scenario: Scenario, outcome: GateOutcome) -> tuple[bool, bool]:
    gate = plan.gates[outcome.gate]
    truth = scenario.true_k(gate.points(scenario.compute))
    # a true k equal to the threshold (k = 1 against 1) makes both wrong; TIE absorbs its rounding
    wrong_promotion = outcome.decision == "promote" and bool(np.any(truth <= gate.threshold * (1 + TIE)))
    wrong_drop = outcome.decision == "drop" and bool(np.all(truth >= gate.threshold * (1 - TIE)))
    return wrong_promotion, wrong_drop


def simulate(plan: GatePlan, scenario: Scenario, reps: int, seed: int = 0) -> SimSummary:
    """`reps` ladders of `scenario` through `run_gates` (one treatment): the plan's rates and costs."""
    rng = np.random.default_rng(seed)
    counts = dict.fromkeys(("promote", "drop", "undecided", "wrong_promotion", "wrong_drop"), 0)
    compute, seeds = 0.0, 0.0
    for rep in range(reps):
        control, arm = scenario.draw(rng, plan.looks[-1])
        outcomes, control_flops = run_gates(plan, control, {"arm": arm}, seed=rep)
        last = outcomes[-1]
        passed = last.decision == "promote" and last.gate == len(plan.gates) - 1
        end = "promote" if passed else last.decision if last.decision == "drop" else "undecided"
        counts[end] += 1
        wrongs = [_wrong(plan, scenario, o) for o in outcomes]
        counts["wrong_promotion"] += any(w[0] for w in wrongs)
        counts["wrong_drop"] += any(w[1] for w in wrongs)
        compute += last.compute + control_flops
        seeds += float(np.mean([o.seeds for o in outcomes]))
    return SimSummary(scenario.name, reps, counts["promote"] / reps, counts["drop"] / reps, counts["undecided"] / reps,
                      counts["wrong_promotion"] / reps, counts["wrong_drop"] / reps, compute / reps, seeds / reps)
