"""A study's ladder read out (issue 21): per comparison, treatment and scope (a point of the grid
axes; "" without a grid), the compute-equivalent multiplier in FLOPs and in wall-clock, the trend
of the gain with size, and the per-rung numbers behind them.

Inputs are plain: the runs table (`results.collect`), each scope's rungs as grid keys, and each
(arm, grid key)'s training FLOPs and parameters per run (`experiments.budget`). A pure function of
them; the orchestrator gathers them (`orchestrator.gathering`) and `readouts.ladder` renders the result.

What enters a ladder. Only seeds whose runs finished with a finite metric in both arms at every
rung of the scope (the bootstrap resamples seeds jointly across arms and rungs, so a seed missing
one run would unpair the rest); the others are named in the row's flags. The metric must be a loss
(`LOSS_METRICS`): k inverts a fitted loss-compute law.

The two costs of a run. FLOPs: 6NT plus attention (`experiments.budget.train_flops`), per arm, since
routing adds parameters and FLOPs. Wall-clock: the run's tokens over its measured training
tokens/s (evals excluded), the median over the ladder's seeds of that (arm, rung). A routing variant
at 0.55-0.88x pre-norm's throughput can gain in FLOPs and lose in wall-clock; the row says both.

The summary multiplier. k at the geometric middle of the arm's rungs' compute, with its interval:
"one number over the range" only when `constant` holds (the paired bootstrap of log k at the last
rung minus the first does not exclude 0, and the end rungs' intervals overlap); otherwise the row
reports k at the first and last rung and says that k drifts, never one k. Either way the statement
shows the end rungs' k with their intervals.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace

import numpy as np
import pandas as pd

from reslab.results.collect import complete_seeds, matched_seeds
from reslab.results.comparison import Comparison
from reslab.results.scaling import Ladder, Multiplier, PowerLaw, compute_multiplier, trend_test

__all__ = ["LOSS_METRICS", "SIZE", "ArmLadder", "LadderResult", "LadderScope", "interval_text", "ladder_readout",
           "ladder_text", "statement"]

LOSS_METRICS: tuple[str, ...] = ("val_loss_tail", "val_loss", "train_loss")
MIN_RUNGS = 3  # a law of 3 parameters
MIN_SEEDS = 3  # the bootstrap-SE t interval's n - 1 >= 2
DEFAULT_DRAWS = 200
SIZE = "size (parameters; FLOPs where the rungs share one size)"

SUMMARY_COLUMNS: tuple[str, ...] = (
    "comparison", "scope", "treatment", "control", "metric", "seeds", "rungs",
    "k_flops", "k_flops_low", "k_flops_high", "flops_constant", "alpha_gap", "alpha_gap_low", "alpha_gap_high",
    "k_flops_first", "k_flops_last", "k_flops_drift", "k_flops_drift_low", "k_flops_drift_high",
    "k_wall", "k_wall_low", "k_wall_high", "wall_constant",
    "trend_slope", "trend_p", "statement", "flags",
)
RUNG_COLUMNS: tuple[str, ...] = (
    "comparison", "scope", "treatment", "control", "rung", "grid_key", "params_control", "params_treatment",
    "flops_control", "flops_treatment", "wall_s_control", "wall_s_treatment", "loss_control", "loss_treatment",
    "mean_delta", "k_flops", "k_flops_low", "k_flops_high", "k_wall", "k_wall_low", "k_wall_high",
)


@dataclass(frozen=True)
class LadderScope:
    """One ladder: the scope's grid key ("" without grid axes) and the grid key of each rung at it."""

    scope: str
    rungs: tuple[str, ...]


@dataclass(frozen=True)
class ArmLadder:
    """One arm's ladder as fitted: per-rung FLOPs and wall seconds, loss[seed, rung], the FLOP law."""

    arm: str
    seeds: tuple[int, ...]
    flops: np.ndarray
    wall_s: np.ndarray
    loss: np.ndarray
    law: PowerLaw | None


@dataclass(frozen=True)
class LadderResult:
    summary: pd.DataFrame  # one row per comparison, scope and treatment (SUMMARY_COLUMNS)
    rungs: pd.DataFrame  # one row per comparison, scope, treatment and rung (RUNG_COLUMNS)
    # (comparison, scope) -> arm -> its ladder, for the plots
    arms: dict[tuple[str, str], dict[str, ArmLadder]] = field(default_factory=dict)
    # (comparison, scope, treatment) -> (FLOP multiplier, wall-clock multiplier) at the rungs, for the plots
    multipliers: dict[tuple[str, str, str], tuple[Multiplier, Multiplier | None]] = field(default_factory=dict)


def _loss_matrix(matched: pd.DataFrame, arm: str, rungs: Sequence[str], seeds: Sequence[int]) -> np.ndarray:
    """loss[seed, rung] of `arm` from the seed-matched values (`collect.matched_seeds`)."""
    value = {(g, s): v for g, s, v in zip(matched["grid_key"], matched["seed"], matched[f"value/{arm}"], strict=True)}
    return np.array([[value.get((key, seed), np.nan) for key in rungs] for seed in seeds], dtype=np.float64)


def _wall_seconds(runs: pd.DataFrame, arm: str, rungs: Sequence[str], seeds: Sequence[int]) -> np.ndarray:
    """Per rung, the median over `seeds` of tokens / tokens_per_s (NaN without a measurement)."""
    out = np.full(len(rungs), np.nan)
    for j, key in enumerate(rungs):
        got = runs[(runs["arm"] == arm) & (runs["grid_key"] == key) & (runs["seed"].isin(list(seeds)))]
        seconds = (got["tokens"] / got["tokens_per_s"]).to_numpy(dtype=np.float64)
        seconds = seconds[np.isfinite(seconds) & (seconds > 0)]
        if seconds.size:
            out[j] = float(np.median(seconds))
    return out


def _complete_seeds(matched: pd.DataFrame, arms: Iterable[str], rungs: Sequence[str]) -> list[int]:
    """Seeds with a usable run of every arm at every rung."""
    complete = complete_seeds(matched[matched["grid_key"].isin(list(rungs))], arms)
    counts = complete.groupby("seed")["grid_key"].nunique()
    return sorted(int(s) for s, n in counts.items() if n == len(set(rungs)))


def _fit(ladder: Ladder) -> PowerLaw | None:
    try:
        return ladder.fit()
    except ValueError:
        return None


def _multipliers(control: Ladder, arm: Ladder, level: float, draws: int,
                 fits: tuple[PowerLaw | None, PowerLaw | None] = (None, None)) -> tuple[Multiplier | None, str]:
    """k at the arm's rungs and at their geometric middle (the last column), or why not."""
    middle = float(np.exp(np.log(arm.compute).mean()))
    known = None if fits[0] is None or fits[1] is None else (fits[0], fits[1])
    try:
        return compute_multiplier(control, arm, level=level, draws=draws, at=np.append(arm.compute, middle),
                                  fits=known), ""
    except ValueError as exc:
        return None, str(exc)


def _rungs_only(m: Multiplier) -> Multiplier:
    return replace(m, compute=m.compute[:-1], k=m.k[:-1], low=m.low[:-1], high=m.high[:-1], sd_boot=m.sd_boot[:-1],
                   se=m.se[:-1])


def _k(value: float) -> str:
    return "inf" if math.isinf(value) else f"{value:.2f}"


def _range(m: Multiplier, i: int) -> str:
    return f"{_k(float(m.k[i]))}x [{_k(float(m.low[i]))}, {_k(float(m.high[i]))}]"


def statement(treatment: str, control: str, k_flops: Multiplier | None, k_wall: Multiplier | None,
              flags: str = "") -> str:
    """A summary row in words: 'attnres matches control at 1.12x compute [0.95, 1.31], FLOPs;
    0.83x [0.70, 0.99] wall-clock', or that k drifts with compute, or why there is no k. The
    multipliers are `ladder_readout`'s: the rungs, then the geometric middle."""
    if k_flops is None:
        return f"{treatment} vs {control}: no multiplier ({flags or 'too few seeds or rungs'})"
    ends = f"{_range(k_flops, 0)} at the first rung, {_range(k_flops, -2)} at the last"
    drift = (f"log k last - first {_num(k_flops.drift, '+.3f')} [{_num(k_flops.drift_low, '+.3f')}, "
             f"{_num(k_flops.drift_high, '+.3f')}]")
    if k_flops.constant:
        text = f"{treatment} matches {control} at {_range(k_flops, -1)} compute, FLOPs ({ends}; {drift})"
    else:
        text = (f"{treatment} vs {control}: k drifts with compute, {ends}, FLOPs ({drift}; exponents differ by "
                f"{k_flops.alpha_gap:+.3f} [{k_flops.alpha_gap_low:+.3f}, {k_flops.alpha_gap_high:+.3f}])")
    if k_wall is not None:
        wall_ends = f"{_k(float(k_wall.k[0]))}x at the first rung, {_k(float(k_wall.k[-2]))}x at the last"
        text += (f"; {_range(k_wall, -1)} wall-clock ({wall_ends})" if k_wall.constant
                 else f"; wall-clock k drifts, {wall_ends}")
    return text


def _at(m: Multiplier | None, i: int) -> tuple[float, float, float]:
    return (math.nan,) * 3 if m is None else (float(m.k[i]), float(m.low[i]), float(m.high[i]))


def _arm_ladders(runs: pd.DataFrame, matched: pd.DataFrame, pair: tuple[str, str], keys: Sequence[str],
                 seeds: list[int], cost: Mapping[tuple[str, str], tuple[float, float]]) -> dict[str, ArmLadder]:
    out = {}
    for arm in pair:
        flops = np.array([cost[arm, key][0] for key in keys], dtype=np.float64)
        loss = _loss_matrix(matched, arm, keys, seeds)
        law = _fit(Ladder(flops, loss)) if seeds and len(keys) >= MIN_RUNGS else None
        out[arm] = ArmLadder(arm=arm, seeds=tuple(seeds), flops=flops, wall_s=_wall_seconds(runs, arm, keys, seeds),
                             loss=loss, law=law)
    return out


def _both_multipliers(ctrl: ArmLadder, trt: ArmLadder, level: float, draws: int,
                      flags: list[str]) -> tuple[Multiplier | None, Multiplier | None]:
    """(FLOP, wall-clock) multipliers at the rungs and the middle, or None with the reason in `flags`."""
    if len(ctrl.flops) < MIN_RUNGS:
        flags.append(f"{len(ctrl.flops)} rungs: a multiplier needs {MIN_RUNGS}")
        return None, None
    if len(ctrl.seeds) < MIN_SEEDS:
        flags.append(f"{len(ctrl.seeds)} complete seeds: an interval for k needs {MIN_SEEDS}")
        return None, None
    k_flops, why = _multipliers(Ladder(ctrl.flops, ctrl.loss), Ladder(trt.flops, trt.loss), level, draws,
                                (ctrl.law, trt.law))
    if k_flops is None:
        flags.append(f"FLOPs: {why}")
    if not (np.all(np.isfinite(ctrl.wall_s)) and np.all(np.isfinite(trt.wall_s))):
        flags.append("wall-clock: a run has no measured tokens/s")
        return k_flops, None
    k_wall, why = _multipliers(Ladder(ctrl.wall_s, ctrl.loss), Ladder(trt.wall_s, trt.loss), level, draws)
    if k_wall is None:
        flags.append(f"wall-clock: {why}")
    return k_flops, k_wall


def _trend(ctrl: ArmLadder, trt: ArmLadder, sizes: np.ndarray) -> tuple[float, float]:
    """(mean per-seed slope of the delta on log size, its sign-flip p); a token-budget ladder (one
    size) uses its compute as the size."""
    if np.unique(sizes).size < 2:
        sizes = ctrl.flops
    if not ctrl.seeds or np.unique(sizes).size < 2:
        return math.nan, math.nan
    trend = trend_test(ctrl.loss, trt.loss, sizes)
    return trend.slope, trend.p


def _summary_row(comp: Comparison, scope: str, treatment: str, seeds: int, rungs: int,
                 mults: tuple[Multiplier | None, Multiplier | None], trend: tuple[float, float],
                 flags: list[str]) -> dict[str, object]:
    k_flops, k_wall = mults
    row: dict[str, object] = {"comparison": comp.name, "scope": scope, "treatment": treatment,
                              "control": comp.control, "metric": comp.metric, "seeds": seeds, "rungs": rungs}
    row["k_flops"], row["k_flops_low"], row["k_flops_high"] = _at(k_flops, -1)
    row["flops_constant"] = None if k_flops is None else bool(k_flops.constant)
    row["alpha_gap"], row["alpha_gap_low"], row["alpha_gap_high"] = (
        (math.nan,) * 3 if k_flops is None else (k_flops.alpha_gap, k_flops.alpha_gap_low, k_flops.alpha_gap_high))
    row["k_flops_first"], row["k_flops_last"] = _at(k_flops, 0)[0], _at(k_flops, rungs - 1)[0]
    row["k_flops_drift"], row["k_flops_drift_low"], row["k_flops_drift_high"] = (
        (math.nan,) * 3 if k_flops is None else (k_flops.drift, k_flops.drift_low, k_flops.drift_high))
    row["k_wall"], row["k_wall_low"], row["k_wall_high"] = _at(k_wall, -1)
    row["wall_constant"] = None if k_wall is None else bool(k_wall.constant)
    row["trend_slope"], row["trend_p"] = trend
    row["flags"] = note = "; ".join(flags)
    row["statement"] = statement(treatment, comp.control, k_flops, k_wall, note)
    return row


def _rung_rows(comp: Comparison, scope: str, treatment: str, keys: Sequence[str], ctrl: ArmLadder, trt: ArmLadder,
               params: Mapping[str, np.ndarray], mults: tuple[Multiplier | None, Multiplier | None]) -> list[dict]:
    rows = []
    for j, key in enumerate(keys):
        r: dict[str, object] = {
            "comparison": comp.name, "scope": scope, "treatment": treatment, "control": comp.control, "rung": j,
            "grid_key": key, "params_control": params[comp.control][j], "params_treatment": params[treatment][j],
            "flops_control": ctrl.flops[j], "flops_treatment": trt.flops[j],
            "wall_s_control": ctrl.wall_s[j], "wall_s_treatment": trt.wall_s[j],
            "loss_control": float(ctrl.loss[:, j].mean()) if ctrl.seeds else math.nan,
            "loss_treatment": float(trt.loss[:, j].mean()) if ctrl.seeds else math.nan,
            "mean_delta": float((trt.loss[:, j] - ctrl.loss[:, j]).mean()) if ctrl.seeds else math.nan,
        }
        r["k_flops"], r["k_flops_low"], r["k_flops_high"] = _at(mults[0], j)
        r["k_wall"], r["k_wall_low"], r["k_wall_high"] = _at(mults[1], j)
        rows.append(r)
    return rows


def ladder_readout(runs: pd.DataFrame, comparisons: Iterable[Comparison], scopes: Sequence[LadderScope],
                   cost: Mapping[tuple[str, str], tuple[float, float]], *, alpha: float = 0.05,
                   draws: int = DEFAULT_DRAWS) -> LadderResult:
    """The ladder of every comparison on a loss metric, per scope and treatment (the module doc).

    `cost[(arm, grid_key)]` is (training FLOPs per run, parameters); intervals are 1 - alpha."""
    summary, per_rung = [], []
    result = LadderResult(summary=pd.DataFrame(), rungs=pd.DataFrame())
    # comparisons that differ only in family, `at` or name share a ladder: fitted once
    done: dict[tuple[str, str, str, str], tuple[tuple[Multiplier | None, Multiplier | None], list[str]]] = {}
    for comp in comparisons:
        if comp.metric not in LOSS_METRICS:
            continue
        for scope in scopes:
            keys = scope.rungs
            for treatment in comp.treatments:
                pair = (comp.control, treatment)
                matched = matched_seeds(runs, pair, comp.metric)
                seeds = _complete_seeds(matched, pair, keys)
                everyone = sorted({int(s) for s in runs[runs["arm"].isin(pair)]["seed"].dropna()})
                missing = [str(s) for s in everyone if s not in seeds]
                flags = [f"seeds {','.join(missing)} left out: a run of theirs did not finish"] if missing else []
                ladders = _arm_ladders(runs, matched, pair, keys, seeds, cost)
                result.arms.setdefault((comp.name, scope.scope), {}).update(ladders)
                ctrl, trt = ladders[comp.control], ladders[treatment]
                key = (comp.control, treatment, comp.metric, scope.scope)
                if key not in done:
                    reasons: list[str] = []
                    done[key] = (_both_multipliers(ctrl, trt, 1.0 - alpha, draws, reasons), reasons)
                mults, reasons = done[key]
                flags += reasons
                if mults[0] is not None:
                    result.multipliers[comp.name, scope.scope, treatment] = (
                        _rungs_only(mults[0]), None if mults[1] is None else _rungs_only(mults[1]))
                params = {arm: np.array([cost[arm, key][1] for key in keys], dtype=np.float64) for arm in pair}
                trend = _trend(ctrl, trt, params[comp.control])
                summary.append(_summary_row(comp, scope.scope, treatment, len(seeds), len(keys), mults, trend, flags))
                per_rung += _rung_rows(comp, scope.scope, treatment, keys, ctrl, trt, params, mults)
    return LadderResult(summary=pd.DataFrame(summary, columns=list(SUMMARY_COLUMNS)),
                        rungs=pd.DataFrame(per_rung, columns=list(RUNG_COLUMNS)), arms=result.arms,
                        multipliers=result.multipliers)


def _rung_label(grid_key: str, scope: str) -> str:
    """A rung's grid key without the scope's axes, paths shortened to their last part."""
    in_scope = set(scope.split(",")) if scope else set()
    return ", ".join(f"{path.rsplit('.', 1)[-1]}={value}" for path, _, value in
                     (part.partition("=") for part in grid_key.split(",") if part not in in_scope))


def _num(value: float, spec: str) -> str:
    return "-" if math.isnan(value) else format(value, spec)


def interval_text(k: float, low: float, high: float) -> str:
    return "-" if math.isnan(k) else f"{_k(k)} [{_k(low)}, {_k(high)}]"


def ladder_text(result: LadderResult, alpha: float = 0.05) -> str:
    """The ladder for the terminal (`reslab compare`, the end of `reslab run`): per comparison,
    scope and treatment its statement, the trend of the gain with size, then one line per rung."""
    if result.summary.empty:
        return ""
    metric = result.summary["metric"].iloc[0]
    lines = [f"across scale ({metric}): k = the compute the control needs to reach the treatment's fitted loss, "
             "over the treatment's compute (k > 1 favours the treatment); the headline k is at the geometric middle "
             f"of the rungs; {1 - alpha:.0%} intervals from a paired seed bootstrap (seeds resampled jointly across "
             "arms and rungs)"]
    for row in result.summary.to_dict("records"):
        where = f" [{row['scope']}]" if row["scope"] else ""
        lines.append(f"{row['comparison']}{where}: {row['statement']}")
        if not math.isnan(row["trend_slope"]):
            lines.append(f"  delta against log size: {row['trend_slope']:+.4f} per e-fold of {SIZE}, sign-flip "
                         f"p {row['trend_p']:.3g} over {row['seeds']} seeds (negative: the gain grows with size)")
        if row["flags"]:
            lines.append(f"  note: {row['flags']}")
        rungs = result.rungs[(result.rungs["comparison"] == row["comparison"]) & (result.rungs["scope"] == row["scope"])
                             & (result.rungs["treatment"] == row["treatment"])]
        table = [("rung", "params", "FLOPs/run", "s/run", row["control"], row["treatment"], "delta", "k FLOPs",
                  "k wall-clock")]
        for r in rungs.to_dict("records"):
            table.append((
                f"{r['rung']}: {_rung_label(r['grid_key'], row['scope'])}", f"{r['params_treatment']:.3g}",
                f"{r['flops_treatment']:.3g}",
                f"{_num(r['wall_s_control'], '.3g')}/{_num(r['wall_s_treatment'], '.3g')}",
                _num(r["loss_control"], ".4f"), _num(r["loss_treatment"], ".4f"), _num(r["mean_delta"], "+.4f"),
                interval_text(r["k_flops"], r["k_flops_low"], r["k_flops_high"]),
                interval_text(r["k_wall"], r["k_wall_low"], r["k_wall_high"])))
        widths = [max(len(t[i]) for t in table) for i in range(len(table[0]))]
        for t in table:
            lines.append("  " + "  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                                          for i, (c, w) in enumerate(zip(t, widths, strict=True))).rstrip())
    return "\n".join(lines) + "\n"
