"""The `gates:` section of a study (issue 54): a ladder study whose seeds are read at looks per gate, with
promotion between gates (`results.gates` is the rule, its error budget and its simulation).

    ladder: {model.d_model: [32, 48, 64, 80], train.steps: [100, 150, 200, 250]}   # the rungs
    seeds: 6                      # a count: the looks read its first n seeds; the last look reads them all
    gates:
      control: control            # the control arm; every other arm is a treatment unless `treatments:` names them
      treatments: [attnres]       # optional
      metric: val_loss            # a loss (results.ladder.LOSS_METRICS); default val_loss, at the run's compute
      alpha: 0.05                 # the error budget in all, split over gates and treatments (GatePlan.gate_alpha)
      errors: each                # each: each kind of wrong decision within alpha; joint: all right w.p. 1 - alpha
      looks: [3, 4, 6]            # seed counts each gate is read at, increasing from 3; the last is `seeds:`
      target: [1.0e21, 1.0e23]    # projection targets (FLOPs) the readout projects k and the loss gap to
      max_decades: 2              # a target further past the largest rung is flagged extrapolated
      law: {floor: 1.6}           # L = floor + A C^-alpha (Marin's); absent or {floor: null}: the floor fitted
      draws: 400                  # the seed bootstrap's draws at each look
      stages:                     # the gates, in order
        - {name: gate1, rungs: [0, 1], threshold: 1.0}          # promote when k's lower bound > 1 at each rung
        - {name: gate2, rungs: [0, 1, 2, 3], at: 1.0e21}        # ... at k projected to 1e21 FLOPs

A gate's `rungs` index the ladder (0 = its first rung); a rung an earlier gate trained is reused, not retrained.
`threshold` is the multiplier a treatment must beat (> 0; 1.0: any speed-up); `at` reads k projected to that
compute (FLOPs) instead of at each rung's. One line per mistake, naming the field (`parse_gates`); the checks
that need the rest of the study (a ladder, no grid, no sequential seeds, the arms) are made here too.
`GatesSpec.plan` is the `results.gates.GatePlan` the driver (`orchestrator.driving.gates`) and the readout read.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from reslab.common.errors import ConfigError
from reslab.experiments.checks import allowed_names
from reslab.experiments.schema import GatesFile, GateStageFile
from reslab.models.config import shown
from reslab.results.gates import Gate, GatePlan
from reslab.results.ladder import LOSS_METRICS
from reslab.results.projection import MAX_DECADES, LawForm

__all__ = ["ERRORS", "GatesSpec", "MAX_DRAWS", "MIN_DRAWS", "MIN_LOOK", "parse_gates"]

ERRORS = ("each", "joint")
MIN_LOOK = 3  # the bootstrap-SE t interval's n - 1 >= 2
MIN_DRAWS, MAX_DRAWS = 100, 100_000


@dataclass(frozen=True)
class GatesSpec:
    """A study's validated `gates:`: the plan, the control and treatments, the metric the laws fit, the
    projection targets (FLOPs) and how far past the largest rung a target may go before it is flagged."""

    plan: GatePlan
    control: str
    treatments: tuple[str, ...]
    metric: str = "val_loss"
    targets: tuple[float, ...] = ()
    max_decades: float = MAX_DECADES

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(g.name for g in self.plan.gates)

    @property
    def rungs(self) -> tuple[int, ...]:
        """Every rung some gate trains, in ladder order."""
        return tuple(sorted({r for g in self.plan.gates for r in g.rungs}))

    @property
    def arms(self) -> tuple[str, ...]:
        return (self.control, *self.treatments)

    def worst_runs(self) -> int:
        """The most runs the study can train: every treatment promoted through every gate at its last look."""
        return len(self.arms) * len(self.rungs) * self.plan.looks[-1]

    def least_runs(self) -> int:
        """The fewest: every treatment decided at the first gate's first look."""
        return len(self.arms) * len(self.plan.gates[0].rungs) * self.plan.looks[0]

    def lines(self, flops: Mapping[tuple[str, int], float] | None = None) -> list[str]:
        """What the plan spends: the error rate at each gate and in all, and the worst- and best-case runs (and
        FLOPs, given each (arm, rung)'s FLOPs per run), as `reslab plan` and `reslab validate` print them."""
        plan, t = self.plan, len(self.treatments)
        per_gate = plan.gate_alpha() * t
        each = plan.errors == "each"
        budget = (f"wrong promotions <= {plan.alpha:g} and wrong drops <= {plan.alpha:g} in all" if each
                  else f"every decision right with probability >= {1 - plan.alpha:g} in all")
        out = [f"gates: {len(plan.gates)} gate(s), {self.control} against {', '.join(self.treatments)} on "
               f"{self.metric}, looks at {list(plan.looks)} seeds; errors: {plan.errors}, {budget} (alpha "
               f"{plan.alpha:g} / {len(plan.gates)} gates / {t} treatment(s) = {plan.gate_alpha():.4g} per gate and "
               f"treatment, Bonferroni)"]
        for i, g in enumerate(plan.gates):
            low, high = plan.levels(i)
            where = f"k projected to {g.target:.3g} FLOPs" if g.target is not None else "k at each of its rungs"
            spent = (f"wrong promotions <= {per_gate:.4g} and wrong drops <= {per_gate:.4g} here" if each
                     else f"some decision wrong here with probability <= {per_gate:.4g}")
            out.append(f"  {g.name}: rungs {', '.join(map(str, g.rungs))}; promote when {where} is above "
                       f"{g.threshold:g} (lower bound of a {100 * low:.2f}% interval), drop when below it (upper bound "
                       f"of a {100 * high:.2f}% interval); {spent}")
        worst, least = self.worst_runs(), self.least_runs()
        line = (f"  runs: at most {worst} (every treatment promoted through every gate at {plan.looks[-1]} seeds), "
                f"at least {least} (every treatment decided at {plan.gates[0].name}'s first look)")
        if flops:
            most = sum(flops[a, r] for a in self.arms for r in self.rungs) * plan.looks[-1]
            fewest = sum(flops[a, r] for a in self.arms for r in plan.gates[0].rungs) * plan.looks[0]
            line += f"; FLOPs at most {most:.3g}, at least {fewest:.3g}"
        return [*out, line]


def _number(value: Any, where: str, what: str, positive: bool = True) -> float:
    """A finite number (> 0 when `positive`), or a one-line error naming `where`; a string YAML left unread
    (`1.0e21`: YAML 1.1 wants `1.0e+21`) is read as the number it spells."""
    if isinstance(value, str):
        with contextlib.suppress(ValueError):
            value = float(value)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) \
            or (positive and value <= 0):
        raise ConfigError(f"{where}: expected {what}, got {shown(value)}")
    return float(value)


def _int_list(value: Any, where: str, what: str) -> list[int]:
    items = value if isinstance(value, list | tuple) else None
    if not items or any(isinstance(v, bool) or not isinstance(v, int) for v in items):
        raise ConfigError(f"{where}: expected a non-empty list of {what}, got {shown(value)}")
    return list(items)


def _arms(raw: GatesFile, arms: list[str]) -> tuple[str, tuple[str, ...]]:
    if raw.control not in arms:
        raise ConfigError(f"gates.control: {shown(raw.control)} is not an arm; allowed: {allowed_names(arms)}")
    treatments = [a for a in arms if a != raw.control] if raw.treatments is None else list(raw.treatments)
    for j, t in enumerate(treatments):
        if t not in arms:
            raise ConfigError(f"gates.treatments[{j}]: {shown(t)} is not an arm; allowed: {allowed_names(arms)}")
        if t == raw.control:
            raise ConfigError(f"gates.treatments[{j}]: {t!r} is the control; a treatment must be another arm")
    if len(set(treatments)) != len(treatments):
        raise ConfigError(f"gates.treatments: arms repeat: {treatments}")
    if not treatments:
        raise ConfigError("gates.treatments: none; a gates study promotes treatments, so it needs an arm besides "
                          f"the control {raw.control!r}")
    return raw.control, tuple(treatments)


def _looks(value: Any, seeds: int) -> tuple[int, ...]:
    looks = _int_list(value, "gates.looks", f"seed counts from {MIN_LOOK}, increasing (e.g. [3, 4, 6])")
    if looks[0] < MIN_LOOK or any(b <= a for a, b in zip(looks, looks[1:], strict=False)):
        raise ConfigError(f"gates.looks: expected seed counts from {MIN_LOOK}, increasing (the bootstrap interval "
                          f"needs {MIN_LOOK} seeds), got {looks}")
    if looks[-1] != seeds:
        raise ConfigError(f"gates.looks: the last look reads {looks[-1]} seeds, but `seeds:` gives {seeds}; allowed: "
                          f"seeds: {looks[-1]} (the looks read its first n seeds, the last all of them)")
    return tuple(looks)


def _law(value: Any) -> LawForm:
    if value is None:
        return LawForm()
    if not isinstance(value, dict) or set(value) - {"floor"}:
        raise ConfigError(f"gates.law: expected a mapping {{floor: E}} (E: the fixed floor of L = E + A C^-alpha, "
                          f"or null to fit it), got {shown(value)}")
    floor = value.get("floor")
    if floor is None:
        return LawForm()
    what = "a fixed floor >= 0 (nats, below every loss) or null to fit it"
    if _number(floor, "gates.law.floor", what, positive=False) < 0:
        raise ConfigError(f"gates.law.floor: expected {what}, got {shown(floor)}")
    return LawForm(float(floor))


def _targets(value: Any) -> tuple[float, ...]:
    items = list(value) if isinstance(value, list | tuple) else [value]
    targets = tuple(_number(v, f"gates.target[{i}]", "a compute in FLOPs > 0 (e.g. 1.0e21)")
                    for i, v in enumerate(items))
    if len(set(targets)) != len(targets):
        raise ConfigError(f"gates.target: computes repeat: {list(targets)}")
    return targets


def _stage(i: int, value: GateStageFile, rungs: int, form: LawForm) -> Gate:
    where = f"gates.stages[{i}]"
    picked = _int_list(value.rungs, f"{where}.rungs", f"ladder rung indices from 0 to {rungs - 1}")
    bad = [r for r in picked if not 0 <= r < rungs]
    if bad:
        raise ConfigError(f"{where}.rungs: rung {bad[0]} is not on the ladder; allowed: 0 to {rungs - 1} (the "
                          f"ladder has {rungs} rungs)")
    if len(set(picked)) != len(picked):
        raise ConfigError(f"{where}.rungs: rungs repeat: {picked}")
    if len(picked) < form.min_rungs:
        floor = "a fitted floor" if form.floor is None else "a fixed floor"
        raise ConfigError(f"{where}.rungs: {len(picked)} rung(s); the law with {floor} needs at least "
                          f"{form.min_rungs} (gates.law: {{floor: E}} fits 2)")
    threshold = _number(value.threshold, f"{where}.threshold", "a multiplier > 0 (1.0: any speed-up)")
    at = None if value.at is None else _number(value.at, f"{where}.at", "a compute in FLOPs > 0 to read k "
                                                                        "projected there, or null for its rungs")
    return Gate(tuple(sorted(picked)), threshold, at, value.name or f"gate{i + 1}")


def _context(rungs: int, sequential: bool, grid: bool) -> None:
    """What a gates study needs of the rest of the study."""
    if not rungs:
        raise ConfigError("gates: a gates study promotes treatments up a ladder; add a `ladder:` of at least 2 rungs")
    if sequential:
        raise ConfigError("seeds: a gates study reads its seeds at gates.looks; give a count (e.g. seeds: 6), "
                          "not {sequential: ...}")
    if grid:
        raise ConfigError("grid: a gates study is one ladder; drop the grid (or write one study per grid point)")


def parse_gates(raw: GatesFile | None, arms: list[str], rungs: int, seeds: tuple[int, ...], sequential: bool,
                grid: bool) -> GatesSpec | None:
    """The study's `gates:` checked against its arms, its ladder's `rungs` (0 without one), its `seeds`, whether
    they are sequential and whether it has a grid (module docstring); one-line `ConfigError`s. None without one."""
    if raw is None:
        return None
    _context(rungs, sequential, grid)
    control, treatments = _arms(raw, arms)
    if raw.metric not in LOSS_METRICS:
        raise ConfigError(f"gates.metric: {shown(raw.metric)} is not a loss a law fits; allowed: "
                          f"{allowed_names(LOSS_METRICS)}")
    alpha = _number(raw.alpha, "gates.alpha", "a number between 0 and 1 (e.g. 0.05)")
    if alpha >= 1:
        raise ConfigError(f"gates.alpha: expected a number between 0 and 1 (e.g. 0.05), got {shown(raw.alpha)}")
    if raw.errors not in ERRORS:
        raise ConfigError(f"gates.errors: {shown(raw.errors)} is not a budget; allowed: each (each kind of wrong "
                          "decision within alpha), joint (all decisions right with probability 1 - alpha)")
    looks = _looks(raw.looks, len(seeds))
    decades = _number(raw.max_decades, "gates.max_decades", "a number of decades > 0 (e.g. 2)")
    draws = raw.draws
    if isinstance(draws, bool) or not isinstance(draws, int) or not MIN_DRAWS <= draws <= MAX_DRAWS:
        raise ConfigError(f"gates.draws: expected an integer from {MIN_DRAWS} to {MAX_DRAWS}, got {shown(draws)}")
    form = _law(raw.law)
    gates = tuple(_stage(i, s, rungs, form) for i, s in enumerate(raw.stages))
    names = [g.name for g in gates]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ConfigError(f"gates.stages: name(s) {dup} repeat; give each gate its own name")
    plan = GatePlan(gates, looks, alpha, len(treatments), form, draws, raw.errors)
    return GatesSpec(plan, control, treatments, raw.metric, _targets(raw.target), decades)

