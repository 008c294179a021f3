"""What a gates study saves, by simulation (issue 54; `reslab power` on a study with `gates:`).

A gates plan (`results.gates.GatePlan`) simulated through `results.gates.simulate`,
the code a gates study decides with, at known multipliers (1.0, 1.1, 1.25 by default, the treatment's law the
control's shifted by k in compute) and at one whose exponents differ (worth 1.3x at the first rung and 0.95x at the
last gate's target, or 10x past the largest rung: a gain that shrinks with scale), beside the full ladder with fixed
seeds (`results.gates.fixed_plan`: every rung, one look at the plan's largest, the same alpha and rule): each design's
promotion and drop rates, its wrong promotions and wrong drops, and its expected FLOPs (both arms). The control's
law is a straight line in log(L - E) against log C through the losses the caller assumes at the rungs (E the plan's
fixed floor, else Chinchilla's); each seed shifts both arms alike by `shared`, each run its own noise `own`. Seeded:
the same reps give the same table.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from reslab.common.errors import ConfigError
from reslab.results.gates import GatePlan, Scenario, SimSummary, fixed_plan, simulate
from reslab.results.scaling import CHINCHILLA_LAW, PowerLaw

__all__ = ["CROSSING", "GATES_KS", "GATES_REPS", "GatesPowerRow", "gates_power", "gates_scenarios"]


GATES_KS = (1.0, 1.1, 1.25)
GATES_REPS = 100  # simulated ladders per row by default: Monte Carlo SE <= 0.05 on a rate, 0.022 on a rate of 0.05
CROSSING = (1.3, 0.95)  # the scenario whose exponents differ: k at the first rung, k at the last gate's target


@dataclass(frozen=True)
class GatesPowerRow:
    """One scenario: its true k at the last gate's points, the gates plan's simulation and the full ladder's."""

    scenario: str
    true_k: tuple[float, ...]
    gates: SimSummary
    fixed: SimSummary

    @property
    def saved(self) -> float:
        """The share of the full ladder's expected FLOPs the gates did not spend."""
        return 1.0 - self.gates.mean_compute / self.fixed.mean_compute


def _control_law(compute: np.ndarray, loss: np.ndarray, floor: float) -> PowerLaw:
    if np.any(loss <= floor):
        raise ConfigError(f"gates power: the assumed losses {np.round(loss, 3).tolist()} must lie above the law's "
                          f"floor {floor:g}")
    slope, intercept = np.polyfit(np.log(compute), np.log(loss - floor), 1)
    return PowerLaw(floor, float(np.exp(intercept)), float(-slope))


def _crossing(control: PowerLaw, first: float, target: float, ks: tuple[float, float]) -> PowerLaw:
    """A law over the control's floor worth ks[0] x compute at `first` and ks[1] x at `target`."""
    x = np.log([first, target])
    y = np.log(control.loss(np.array([ks[0] * first, ks[1] * target])) - control.E)
    alpha = -(y[1] - y[0]) / (x[1] - x[0])
    return PowerLaw(control.E, float(np.exp(y[0] + alpha * x[0])), float(alpha))


def gates_scenarios(plan: GatePlan, compute: np.ndarray, loss: np.ndarray, own: float, shared: float = 0.01,
                    ks: tuple[float, ...] = GATES_KS) -> list[Scenario]:
    """The simulated ladders `gates_power` runs (module section above): the control through `loss` at the rungs'
    `compute`, a treatment worth each k, and one whose exponents differ."""
    compute = np.asarray(compute, dtype=np.float64)
    floor = plan.form.floor if plan.form.floor is not None else CHINCHILLA_LAW["E"]
    control = _control_law(compute, np.asarray(loss, dtype=np.float64), floor)
    out = [Scenario(f"k={k:g}", control, PowerLaw(floor, control.A * k ** -control.alpha, control.alpha), compute,
                    shared, own) for k in ks]
    last = plan.gates[-1].target or 10.0 * float(compute.max())
    out.append(Scenario(f"k {CROSSING[0]:g} -> {CROSSING[1]:g} (exponents differ)", control,
                        _crossing(control, float(compute.min()), last, CROSSING), compute, shared, own))
    return out


def gates_power(plan: GatePlan, scenarios: Iterable[Scenario], reps: int = GATES_REPS,
                seed: int = 0) -> list[GatesPowerRow]:
    """Per scenario the gates plan and the full ladder at the plan's largest look (`fixed_plan`), each simulated
    `reps` times from `seed` (the same draws for both designs)."""
    fixed = fixed_plan(plan, plan.looks[-1])
    rows = []
    for s in scenarios:
        points = plan.gates[-1].points(s.compute)
        rows.append(GatesPowerRow(s.name, tuple(float(k) for k in s.true_k(points)), simulate(plan, s, reps, seed),
                                  simulate(fixed, s, reps, seed)))
    return rows
