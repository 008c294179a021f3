"""A gates study read out (issue 54): the plan (`results.gates`) replayed on the study's runs, the projection of each
treatment to the study's target computes (`results.projection`), its backtest, the throughput-adjusted multiplier,
and what the gates saved against a full ladder. A pure function of the runs table, the study's gates
(`GatesDesign`) and each (arm, rung)'s training FLOPs; `readouts.gates` renders it.

The replay. At each gate, for each treatment still in, the plan's looks are read in turn on the study's first n
seeds (`results.gates.decide_look`, bootstrap seed `results.gates.look_seed`, as `run_gates` and the study's driver
read them) while each of those seeds has a finished run with a finite metric in both arms at every one of the
gate's rungs, until a look decides: promoted, dropped (futility), undecided (the last look), in progress (a look
said "more seeds" and they have not all finished yet), waiting (the first look's seeds have not all finished) or
not reached (dropped or undecided at an earlier gate). Only the promoted treatments are read at the next gate, as
only they train there.

The projection. Each treatment with a look is projected from the rungs of every gate it was read at and the seeds
complete there, to the study's targets (none named: the last gate's target, else the largest rung): each arm's
law (the plan's `LawForm`), the loss gap and k with their paired seed-bootstrap intervals at 1 - alpha, k_wall
from each run's measured training tokens/s (`projection.Throughput`: the rate ratio resampled with the same seed
draws, so its uncertainty is in the interval), a row flag past `max_decades`, and the backtest (fit without the
largest rung, predict it), where the rungs allow one more than the law needs.

The saving. The FLOPs of every run the study recorded (finished or not) against a full ladder: every arm at every
rung with the plan's largest look's seeds.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from reslab.results.collect import matched_seeds, recorded
from reslab.results.gates import GateLook, GatePlan, decide_look, look_seed
from reslab.results.projection import MAX_DECADES, Projection, Throughput, backtest, project
from reslab.results.scaling import Ladder, PowerLaw

__all__ = ["BACKTEST_COLUMNS", "DECISION_COLUMNS", "DECISION_WORDS", "LOOK_COLUMNS", "PROJECTION_COLUMNS",
           "SAVING_COLUMNS", "GatesDesign", "GatesResult", "gates_readout"]

DECISION_WORDS = {"promote": "promoted", "drop": "dropped (futility)", "undecided": "undecided",
                  "continue": "in progress", "waiting": "waiting for seeds", "not reached": "not reached"}
DECISION_COLUMNS = ("gate", "name", "treatment", "control", "decision", "seeds", "looks", "flops", "threshold",
                    "point", "k", "k_low", "k_high", "level_low", "level_high")
LOOK_COLUMNS = ("gate", "name", "treatment", "seeds", "k", "k_low", "k_high", "decision")
PROJECTION_COLUMNS = ("treatment", "control", "target", "decades_past", "extrapolated", "seeds", "rungs",
                      "loss_control", "loss_treatment", "gap", "gap_low", "gap_high", "k", "k_low", "k_high",
                      "k_wall", "k_wall_low", "k_wall_high", "level", "note")
BACKTEST_COLUMNS = ("treatment", "control", "compute", "gap_projected", "gap_observed", "gap_error",
                    "gap_error_low", "gap_error_high", "gap_covered", "k_projected", "k_observed", "k_ratio",
                    "k_ratio_low", "k_ratio_high", "k_covered")
SAVING_COLUMNS = ("arm", "runs", "flops_used", "flops_full", "saved")


@dataclass(frozen=True)
class GatesDesign:
    """A gates study as its readout reads it: the plan (its rung indices index `rungs`, the ladder's grid keys in
    order), the control and the treatments, the metric the laws fit, the target computes of the projection, the
    decades past the largest rung beyond which a row is flagged, the bootstrap's seed, and one run's training FLOPs
    at each (arm, grid key) of the whole ladder (empty: the caller gives them), rungs no look reached included."""

    plan: GatePlan
    control: str
    treatments: tuple[str, ...]
    rungs: tuple[str, ...]
    metric: str = "val_loss"
    targets: tuple[float, ...] = ()
    max_decades: float = MAX_DECADES
    seed: int = 0
    flops: Mapping[tuple[str, str], float] = field(default_factory=dict)

    def where(self, flops: np.ndarray) -> np.ndarray:
        """The computes the projection reads (the module doc)."""
        if self.targets:
            return np.array(self.targets, dtype=np.float64)
        last = self.plan.gates[-1].target
        return np.array([last if last is not None else float(flops.max())])


@dataclass(frozen=True)
class ArmRuns:
    """One arm on the ladder: its seeds (the study's, in order), FLOPs per run at each rung, loss[seed, rung] and
    training tokens/s[seed, rung] (NaN: no usable run), tokens per run at each rung."""

    arm: str
    seeds: tuple[int, ...]
    flops: np.ndarray
    loss: np.ndarray
    tokens_per_s: np.ndarray
    tokens: np.ndarray


@dataclass(frozen=True)
class GatesResult:
    decisions: pd.DataFrame  # one row per gate, treatment and point (DECISION_COLUMNS)
    looks: pd.DataFrame  # one row per gate, treatment and look (LOOK_COLUMNS): k at the gate's worst point
    projection: pd.DataFrame  # one row per treatment and target (PROJECTION_COLUMNS)
    backtest: pd.DataFrame  # one row per treatment with a backtest (BACKTEST_COLUMNS)
    saving: pd.DataFrame  # one row per arm and one "all" (SAVING_COLUMNS)
    arms: dict[str, ArmRuns] = field(default_factory=dict)  # control first, then the treatments
    gate_rungs: tuple[tuple[int, ...], ...] = ()  # each gate's rung indices
    laws: dict[str, PowerLaw] = field(default_factory=dict)  # each arm's law on the rungs it was projected from
    projections: dict[str, Projection] = field(default_factory=dict)  # treatment -> its projection


def _arm_runs(runs: pd.DataFrame, design: GatesDesign, arm: str, flops: Mapping[tuple[str, str], float],
              seeds: Sequence[int]) -> ArmRuns:
    matched = matched_seeds(runs, [arm], design.metric)
    value = {(g, int(s)): v for g, s, v in zip(matched["grid_key"], matched["seed"], matched[f"value/{arm}"],
                                               strict=True)}
    mine = runs[(runs["arm"] == arm) & runs["grid_key"].isin(design.rungs)]
    speed = {(g, int(s)): (t, n) for g, s, t, n in zip(mine["grid_key"], mine["seed"], mine["tokens_per_s"],
                                                       mine["tokens"], strict=True)}
    loss = np.array([[value.get((key, s), np.nan) for key in design.rungs] for s in seeds], dtype=np.float64)
    tps = np.array([[speed.get((key, s), (np.nan, np.nan))[0] for key in design.rungs] for s in seeds],
                   dtype=np.float64)
    tps[~np.isfinite(loss)] = np.nan  # a run's speed counts only where its loss does
    tokens = np.array([_median([speed[key, s][1] for s in seeds if (key, s) in speed]) for key in design.rungs],
                      dtype=np.float64)
    return ArmRuns(arm, tuple(seeds), np.array([flops[arm, key] for key in design.rungs], dtype=np.float64), loss,
                   tps, tokens)


def _median(values: list[float]) -> float:
    finite = [v for v in values if math.isfinite(v)]
    return float(np.median(finite)) if finite else math.nan


def _complete(arms: Sequence[ArmRuns], cols: Sequence[int]) -> np.ndarray:
    """The seed rows where every one of `arms` has a usable run at every rung of `cols`, in seed order."""
    ok = np.ones(len(arms[0].seeds), dtype=bool)
    for a in arms:
        ok &= np.isfinite(a.loss[:, list(cols)]).all(axis=1)
    return np.flatnonzero(ok)


def _replay(plan: GatePlan, gate: int, control: ArmRuns, arm: ArmRuns, seed: int) -> list[GateLook]:
    """The looks gate `gate` read for `arm` (the module doc)."""
    rows = _complete((control, arm), plan.gates[gate].rungs)
    looks: list[GateLook] = []
    for n in plan.looks:
        if rows.size < n or rows[n - 1] != n - 1:  # a look reads the first n seeds, each complete
            break
        look = decide_look(plan, gate, Ladder(control.flops, control.loss[:n]), Ladder(arm.flops, arm.loss[:n]),
                           seed=look_seed(gate, n, seed))
        looks.append(look)
        if look.decision != "continue":
            break
    return looks


def _decision_rows(design: GatesDesign, gate: int, treatment: str, looks: list[GateLook], state: str,
                   arm: ArmRuns) -> list[dict[str, object]]:
    plan, g = design.plan, design.plan.gates[gate]
    level_low, level_high = plan.levels(gate)
    trained = sorted({r for gi in range(gate + 1) for r in plan.gates[gi].rungs})
    seeds = looks[-1].n if looks else 0
    base = {"gate": gate, "name": g.name or f"gate {gate + 1}", "treatment": treatment, "control": design.control,
            "decision": state, "seeds": seeds, "looks": ",".join(str(look.n) for look in looks),
            "flops": float(seeds * arm.flops[trained].sum()) if looks else 0.0, "threshold": g.threshold,
            "level_low": level_low, "level_high": level_high}
    if not looks:
        return [{**base, "point": math.nan, "k": math.nan, "k_low": math.nan, "k_high": math.nan}]
    last = looks[-1]
    return [{**base, "point": float(p), "k": float(last.k[j]), "k_low": float(last.low[j]),
             "k_high": float(last.high[j])} for j, p in enumerate(last.points)]


def _look_rows(design: GatesDesign, gate: int, treatment: str, looks: list[GateLook]) -> list[dict[str, object]]:
    g = design.plan.gates[gate]
    return [{"gate": gate, "name": g.name or f"gate {gate + 1}", "treatment": treatment, "seeds": look.n,
             "k": float(np.min(look.k)), "k_low": float(np.min(look.low)), "k_high": float(np.min(look.high)),
             "decision": look.decision} for look in looks]


def _state(looks: list[GateLook], alive: bool) -> str:
    if not alive:
        return "not reached"
    return looks[-1].decision if looks else "waiting"


def _throughput(control: ArmRuns, arm: ArmRuns, pick: np.ndarray,
                cols: np.ndarray) -> tuple[Throughput, Throughput] | None:
    got = []
    for a in (control, arm):
        tps, tokens = a.tokens_per_s[np.ix_(pick, cols)], a.tokens[cols]
        if not (np.all(np.isfinite(tps)) and np.all(tps > 0) and np.all(np.isfinite(tokens))):
            return None
        got.append(Throughput(tps, tokens))
    return got[0], got[1]


def _projection(design: GatesDesign, control: ArmRuns, arm: ArmRuns, gates: list[int],
                result: GatesResult) -> tuple[list[dict[str, object]], list[dict[str, object]]]:
    """The treatment's projection rows and its backtest row (the module doc)."""
    plan = design.plan
    cols = np.array(sorted({r for gi in gates for r in plan.gates[gi].rungs}), dtype=np.intp)
    pick = _complete((control, arm), cols.tolist())
    where = design.where(arm.flops[cols])
    base = {"treatment": arm.arm, "control": design.control, "seeds": int(pick.size), "rungs": len(cols),
            "level": 1.0 - plan.alpha}
    ladders = (Ladder(control.flops[cols], control.loss[np.ix_(pick, cols)]),
               Ladder(arm.flops[cols], arm.loss[np.ix_(pick, cols)]))
    try:
        throughput = _throughput(control, arm, pick, cols)
        got = project(*ladders, where, form=plan.form, level=1.0 - plan.alpha, draws=plan.draws, seed=design.seed,
                      throughput=throughput)
    except ValueError as exc:
        past = np.log10(where / float(arm.flops[cols].max()))
        return [{**base, "target": float(t), "decades_past": float(d), "extrapolated": bool(d > design.max_decades),
                 "note": f"no projection: {exc}"} for t, d in zip(where, past, strict=True)], []
    result.projections[arm.arm] = got
    result.laws[design.control], result.laws[arm.arm] = got.laws
    note = "" if throughput is not None else "no wall-clock k: a run has no measured tokens/s"
    rows = []
    flagged = got.extrapolated(design.max_decades)
    for j, target in enumerate(got.compute):
        far = f"{got.decades_past[j]:.1f} decades past the largest rung (more than {design.max_decades:g})"
        rows.append({**base, "target": float(target), "decades_past": float(got.decades_past[j]),
                     "extrapolated": bool(flagged[j]), "loss_control": float(got.losses[0, 0, j]),
                     "loss_treatment": float(got.losses[1, 0, j]), "gap": float(got.gap[j]),
                     "gap_low": float(got.gap_low[j]), "gap_high": float(got.gap_high[j]), "k": float(got.k[j]),
                     "k_low": float(got.k_low[j]), "k_high": float(got.k_high[j]), "k_wall": float(got.k_wall[j]),
                     "k_wall_low": float(got.k_wall_low[j]), "k_wall_high": float(got.k_wall_high[j]),
                     "note": "; ".join(n for n in (far if flagged[j] else "", note) if n)})
    if len(cols) < plan.form.min_rungs + 1:
        return rows, []
    b = backtest(*ladders, form=plan.form, level=1.0 - plan.alpha, draws=plan.draws, seed=design.seed)
    return rows, [{"treatment": arm.arm, "control": design.control, "compute": b.compute,
                   "gap_projected": b.gap_projected, "gap_observed": b.gap_observed, "gap_error": b.gap_error,
                   "gap_error_low": b.gap_error_low, "gap_error_high": b.gap_error_high,
                   "gap_covered": b.gap_covered, "k_projected": b.k_projected, "k_observed": b.k_observed,
                   "k_ratio": b.k_ratio, "k_ratio_low": b.k_ratio_low, "k_ratio_high": b.k_ratio_high,
                   "k_covered": b.k_covered}]


def _saving(runs: pd.DataFrame, design: GatesDesign, arms: Mapping[str, ArmRuns]) -> pd.DataFrame:
    """Per arm and in all: the FLOPs of its recorded runs against every rung at the largest look's seeds."""
    ran = runs[recorded(runs) & runs["grid_key"].isin(design.rungs)]
    full_seeds = design.plan.looks[-1]
    index = {key: j for j, key in enumerate(design.rungs)}
    rows: list[tuple[str, int, float, float]] = []
    for name, a in arms.items():
        mine = ran[ran["arm"] == name]
        rows.append((name, len(mine), float(sum(a.flops[index[key]] for key in mine["grid_key"])),
                     float(full_seeds * a.flops.sum())))
    rows.append(("all", sum(r[1] for r in rows), sum(r[2] for r in rows), sum(r[3] for r in rows)))
    return pd.DataFrame([(*r, 1 - r[2] / r[3]) for r in rows], columns=list(SAVING_COLUMNS))


def gates_readout(runs: pd.DataFrame, design: GatesDesign,
                  flops: Mapping[tuple[str, str], float] | None = None) -> GatesResult:
    """The gates replayed on `runs`, the projection, its backtest and the saving (the module doc); `flops[(arm,
    grid key)]`: one run's training FLOPs (default `design.flops`)."""
    flops = design.flops if flops is None else flops
    seeds = sorted({int(s) for s in runs.loc[runs["arm"].isin([design.control, *design.treatments]), "seed"]
                    .dropna()})
    arms = {a: _arm_runs(runs, design, a, flops, seeds) for a in (design.control, *design.treatments)}
    gate_rungs = tuple(g.rungs for g in design.plan.gates)
    result = GatesResult(pd.DataFrame(), pd.DataFrame(), pd.DataFrame(), pd.DataFrame(), pd.DataFrame(), arms,
                         gate_rungs)
    decisions: list[dict[str, object]] = []
    looks_rows: list[dict[str, object]] = []
    read: dict[str, list[int]] = {t: [] for t in design.treatments}
    alive = set(design.treatments)
    for gate in range(len(design.plan.gates)):
        promoted = set()
        for t in design.treatments:
            looks = _replay(design.plan, gate, arms[design.control], arms[t], design.seed) if t in alive else []
            if looks:
                read[t].append(gate)
            state = _state(looks, t in alive)
            promoted |= {t} if state == "promote" else set()
            decisions += _decision_rows(design, gate, t, looks, state, arms[t])
            looks_rows += _look_rows(design, gate, t, looks)
        alive = promoted
    projection, back = [], []
    for t in design.treatments:
        if read[t]:
            rows, b = _projection(design, arms[design.control], arms[t], read[t], result)
            projection += rows
            back += b
    return GatesResult(pd.DataFrame(decisions, columns=list(DECISION_COLUMNS)),
                       pd.DataFrame(looks_rows, columns=list(LOOK_COLUMNS)),
                       pd.DataFrame(projection, columns=list(PROJECTION_COLUMNS)),
                       pd.DataFrame(back, columns=list(BACKTEST_COLUMNS)), _saving(runs, design, arms), arms,
                       gate_rungs, result.laws, result.projections)
