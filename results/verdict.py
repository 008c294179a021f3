"""Verdicts: a study's answer per comparison, treatment and grid point as data a loop or a person reads, and the
frozen analysis plan that says which of those answers are confirmatory.

A `Verdict` is read off the statistics reslab already computed, never recomputed another way: the paired table of
`results.stats.compare` (what `reslab compare` prints) for a fixed design, the sequential table of
`results.sequential.sequential_table` for a sequential one (its primary result; the paired table is then
descriptive). Their decisions map to five words (`DECISIONS`):

- fixed design: `better`, `worse` and `equivalent` as `compare` decides them (superiority: the family-adjusted
  sign-flip p <= alpha and the CI past 0, or equivalent when the TOST within +-MEI passes; equivalence: the TOST
  within +-margin passes, or better/worse when the CI lies beyond the margin); `inconclusive` is `undecided`. A
  pooled comparison's per-stratum rows (`descriptive`) are no verdicts: its pooled rows are. The interval is the
  paired table's CI (1 - alpha; a pooled row's, its stratified sign flip's), `p_value` the family-adjusted p the
  verdict reads (`p_adj`: the sign flip's, or for an equivalence comparison its TOST's), no e-value;
- sequential design: `better`, `worse`, `equivalent` and `undecided` as `results.sequential.decide` gives them,
  `futile` (stopped for futility) is `futility`; the interval is the confidence sequence at 1 - alpha / (its
  family's rows), the e-value is the test's against 0, no p-value.

`next` says what would decide an undecided verdict: for a fixed design `more seeds: ~N` more (the sign flip's seeds
for 80% power, `results.power.power_rows`, at the row's paired SD, for its MEI or margin, else for the delta
observed, at alpha over its family's rows), for a sequential one the design's next look; `nothing` once decided.

The analysis plan (`analysis_of`) is what decides the verdicts and nothing else: alpha, each comparison's arms,
metric, direction, kind, margin, MEI, family (with its members: a comparison added to a family changes the others'
correction), correction, pooling, cost axis and declared exploratory flag, a sequential design's test and its
prior scale, and the contrasts. It is frozen at a study's first submission, hashed (`plan_hash`); a later change
marks exactly the comparisons it touches exploratory (`plan_status`). Not in the plan: the description, resources,
the grid, the seeds of either design (a sequential design's start, batch and max: its e-process keeps its level
at any stopping time, so more seeds are optional continuation; a fixed design's seed list: `next` asks for more
seeds, and a look repeated with them is what the workspace's ledger of tries counts).
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import numpy as np
import pandas as pd

from reslab.results.collect import usable
from reslab.results.comparison import Comparison
from reslab.results.contrasts import ContrastSpec
from reslab.results.power import power_rows, rows_per_treatment
from reslab.results.sequential import SequentialDesign
from reslab.results.stats import grid_parts

__all__ = ["DECISIONS", "DEFAULT_ALPHA", "Change", "Compute", "PlanStatus", "Verdict", "analysis_changes",
           "analysis_of", "fixed_verdicts", "plan_hash", "plan_status", "sequential_verdicts"]

Decision = Literal["better", "worse", "equivalent", "undecided", "futility"]
DECISIONS: tuple[str, ...] = ("better", "worse", "equivalent", "undecided", "futility")
# `results.stats.compare`'s verdict and `results.sequential.decide`'s decision -> the verdict's word
FIXED_WORDS: dict[str, Decision] = {"better": "better", "worse": "worse", "equivalent": "equivalent",
                                    "inconclusive": "undecided"}
SEQUENTIAL_WORDS: dict[str, Decision] = {"better": "better", "worse": "worse", "equivalent": "equivalent",
                                         "undecided": "undecided", "futile": "futility"}
DEFAULT_ALPHA = 0.05  # the level a study is submitted at (its sequential looks are read at it)
PLAN_FORMAT = 1  # the analysis plan's layout (`analysis_of`)
NOTHING = "nothing"


@dataclass(frozen=True)
class Compute:
    """What the runs a verdict read cost: their number, their training FLOPs (`flops_per_token` x `tokens`, None
    when no run recorded them), their run-hours (each run's wall time; a run on several ranks counts once) and the
    machines they recorded."""

    runs: int
    flops: float | None = None
    run_hours: float | None = None
    machines: tuple[str, ...] = ()


@dataclass(frozen=True, kw_only=True)
class Verdict:
    """One comparison's treatment at one grid point (`point`: axis -> value; `*` for an axis pooled over)."""

    comparison: str
    control: str
    treatment: str
    point: dict[str, str]
    metric: str
    direction: str
    kind: str
    decision: Decision
    estimate: float  # the mean delta, treatment - control
    low: float
    high: float
    level: float  # the interval's coverage
    p_value: float | None
    e_value: float | None
    seeds: tuple[int, ...]  # the paired seeds read
    compute: Compute
    next: str
    exploratory: bool = False
    exploratory_why: str | None = None
    tries: int = 1  # times this comparison was tested in the workspace (the ledger's)
    alpha: float = DEFAULT_ALPHA
    alpha_used: float = math.nan  # after a correction over the tries; default alpha

    def __post_init__(self) -> None:
        if self.decision not in DECISIONS:
            raise ValueError(f"decision {self.decision!r} is not one of {DECISIONS}")
        if math.isnan(self.alpha_used):
            object.__setattr__(self, "alpha_used", self.alpha)

    @property
    def where(self) -> str:
        return ",".join(f"{k}={v}" for k, v in self.point.items())

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe: a NaN or infinite number is null."""
        return {k: _plain(v) for k, v in asdict(self).items()}

    def line(self) -> str:
        """One line: comparison, point, arms, decision, estimate with its interval, p or e, seeds, what decides it
        next, and why it is exploratory."""
        where = f" [{self.where}]" if self.point else ""
        stat = (f", p {self.p_value:.3g}" if self.p_value is not None and math.isfinite(self.p_value) else "") + (
            f", e-value {self.e_value:.3g}" if self.e_value is not None else "")
        interval = (f"[{self.low:.4g}, {self.high:.4g}]" if math.isfinite(self.low) and math.isfinite(self.high)
                    else "unbounded")
        tries = f", tried {self.tries} times (alpha {self.alpha_used:.3g})" if self.tries > 1 else ""
        why = f"; exploratory: {self.exploratory_why}" if self.exploratory else ""
        delta = f"{self.estimate:+.4g}" if math.isfinite(self.estimate) else "n/a"
        return (f"{self.comparison}{where}: {self.treatment} vs {self.control} on {self.metric}: {self.decision}, "
                f"delta {delta} {interval} ({100 * self.level:.4g}%){stat}, {len(self.seeds)} seeds"
                f"{tries}; next: {self.next}{why}")


def _plain(value: Any) -> Any:
    if isinstance(value, float | np.floating):
        return float(value) if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, np.integer):
        return int(value)
    return value


# ----------------------------------------------------------------------------------------- the analysis plan
def _comparison_plan(comp: Comparison, members: list[str]) -> dict[str, Any]:
    return {"control": comp.control, "treatments": list(comp.treatments), "metric": comp.metric,
            "direction": comp.direction, "kind": comp.kind, "margin": comp.margin, "mei": comp.mei,
            "family": comp.family, "family_members": sorted(members), "correction": comp.correction,
            "pool": list(comp.pool), "at": comp.at, "exploratory": comp.exploratory}


def _contrast_plan(c: ContrastSpec) -> dict[str, Any]:
    return {"name": c.name, "metric": c.metric, "weights": [[a, float(w)] for a, w in c.weights],
            "margin": c.margin, "fraction": list(c.fraction) if c.fraction else None}


def analysis_of(comparisons: Iterable[Comparison], *, alpha: float = DEFAULT_ALPHA,
                sequential: SequentialDesign | None = None, contrasts: Iterable[ContrastSpec] = ()) -> dict[str, Any]:
    """The analysis that decides a study's verdicts as plain JSON (module doc): what the plan freezes."""
    comparisons = list(comparisons)
    families: dict[str, list[str]] = {}
    for c in comparisons:
        families.setdefault(c.family, []).append(c.name)
    return {"format": PLAN_FORMAT, "alpha": float(alpha),
            "comparisons": {c.name: _comparison_plan(c, families[c.family]) for c in comparisons},
            "sequential": None if sequential is None else {"test": sequential.test,
                                                           "prior_scale": float(sequential.prior_scale)},
            "contrasts": [_contrast_plan(c) for c in contrasts]}


def plan_hash(analysis: Mapping[str, Any]) -> str:
    """sha256 of the plan's canonical JSON (keys sorted, no spaces)."""
    text = json.dumps(analysis, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return hashlib.sha256(text.encode()).hexdigest()


def _word(value: Any) -> str:
    if value is None:
        return "none"
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, list):
        return "[" + ", ".join(_word(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_word(v)}" for k, v in sorted(value.items())) + "}"
    return str(value).lower() if isinstance(value, bool) else str(value)


def _diff(old: Any, new: Any, prefix: str) -> list[str]:
    """`field old -> new` for each field of two mappings that differs (nested mappings by their dotted path)."""
    if isinstance(old, dict) and isinstance(new, dict):
        return [line for key in sorted(set(old) | set(new)) for line in _diff(old.get(key), new.get(key),
                                                                             f"{prefix}.{key}" if prefix else key)]
    return [] if old == new else [f"{prefix} {_word(old)} -> {_word(new)}"]


def analysis_changes(old: Mapping[str, Any], new: Mapping[str, Any]) -> dict[str, tuple[str, ...]]:
    """Per comparison of `new`, each way its analysis differs from `old` (`field old -> new`): its own fields,
    and for every comparison the study-wide ones (alpha, the sequential design's test and prior scale); a comparison
    `old` lacks was added. Comparisons whose analysis is the same are left out. The contrasts' changes are under
    the key `contrasts`."""
    shared = _diff(old.get("alpha"), new.get("alpha"), "alpha") + _diff(old.get("sequential"), new.get("sequential"),
                                                                        "sequential")
    out: dict[str, tuple[str, ...]] = {}
    before = old.get("comparisons", {})
    for name, plan in new.get("comparisons", {}).items():
        own = _diff(before[name], plan, "") if name in before else ["comparison added"]
        if shared or own:
            out[name] = tuple(shared + own)
    contrasts = _diff({c["name"]: c for c in old.get("contrasts", [])},
                      {c["name"]: c for c in new.get("contrasts", [])}, "")
    if contrasts:
        out["contrasts"] = tuple(contrasts)
    return out


@dataclass(frozen=True)
class Change:
    """How a comparison's analysis differs from the frozen plan, and the finished runs when that was first seen."""

    finished_runs: int
    diffs: tuple[str, ...]

    def why(self) -> str:
        return f"analysis changed after {self.finished_runs} finished runs: {'; '.join(self.diffs)}"


@dataclass(frozen=True)
class PlanStatus:
    """The study's analysis against its frozen plan: `frozen` (False: never submitted, nothing to hold it to), the
    frozen plan's hash and the current analysis's, the versions recorded, and the comparisons that changed."""

    frozen: bool
    current_hash: str
    frozen_hash: str | None = None
    versions: int = 0
    changes: dict[str, Change] = field(default_factory=dict)

    @property
    def state(self) -> str:
        if not self.frozen:
            return "not frozen"
        return "changed" if self.changes else "frozen"

    def change_of(self, comparison: str) -> Change | None:
        return self.changes.get(comparison)

    def to_dict(self) -> dict[str, Any]:
        return {"state": self.state, "frozen_hash": self.frozen_hash, "current_hash": self.current_hash,
                "versions": self.versions,
                "changes": {name: {"finished_runs": c.finished_runs, "diffs": list(c.diffs)}
                            for name, c in self.changes.items()}}


def _baseline(versions: Sequence[Mapping[str, Any]]) -> int:
    """The version the verdicts are held to: the last one recorded before any run had finished (a change nobody
    could have made from a result), else the first."""
    base = 0
    for i, v in enumerate(versions):
        if int(v.get("finished_runs", 0)) > 0:
            break
        base = i
    return base


def _declared_before_its_data(name: str, current: Mapping[str, Any], versions: Sequence[Mapping[str, Any]],
                              by_arm_now: Mapping[str, int] | None) -> bool:
    """Whether comparison `name`'s current analysis was declared while none of its treatments had a finished run:
    at the first version that has it as it is now (now, when none has it yet). No result it decides on existed
    then, as none existed for the frozen plan's own comparisons; so a comparison added, or pointed at a new arm, by
    a loop that re-submits a study whose control has run is not exploratory. Not so when the per-arm counts were
    not recorded (an older workspace): the change stands."""
    plan = current.get("comparisons", {}).get(name)
    declared = next((v for v in versions if name not in analysis_changes(v["analysis"], current)), None)
    by_arm = by_arm_now if declared is None else declared.get("finished_by_arm")
    if plan is None or by_arm is None:
        return False
    return all(int(by_arm.get(t, 0)) == 0 for t in plan.get("treatments", ()))


def plan_status(versions: Sequence[Mapping[str, Any]], current: Mapping[str, Any], finished_now: int,
                finished_by_arm: Mapping[str, int] | None = None) -> PlanStatus:
    """The current analysis against the recorded versions (each `{"hash", "analysis", "finished_runs",
    "finished_by_arm"}`, oldest first; none: not frozen). A comparison whose analysis differs from the baseline
    (`_baseline`) is changed, unless it was declared before any of its treatments had a finished run
    (`_declared_before_its_data`); its finished runs are those when the first version that differed for it was
    recorded (`finished_now` when no recorded version shows the change yet)."""
    now = plan_hash(current)
    if not versions:
        return PlanStatus(False, now)
    base = _baseline(versions)
    baseline = versions[base]["analysis"]
    changes = {}
    for name, diffs in analysis_changes(baseline, current).items():
        if _declared_before_its_data(name, current, versions[base + 1:], finished_by_arm):
            continue
        seen = next((int(v["finished_runs"]) for v in versions[base + 1:]
                     if name in analysis_changes(baseline, v["analysis"])), finished_now)
        changes[name] = Change(seen, diffs)
    return PlanStatus(True, now, str(versions[base]["hash"]), len(versions), changes)


# ------------------------------------------------------------------------------------------------- verdicts
Flops = Mapping[tuple[str, str], float]  # (arm, grid key) -> one run's training FLOPs (`experiments.budget`)


def _compute(runs: pd.DataFrame, run_ids: set[str], flops: Flops | None) -> Compute:
    """The runs' count, FLOPs (each run's from `flops` by its arm and grid point, else its recorded
    `flops_per_token` x `tokens`), run-hours and machines."""
    used = runs[runs["run_id"].isin(run_ids)]
    if used.empty:
        return Compute(0)
    each = pd.Series(np.nan, index=used.index)
    if {"flops_per_token", "tokens"} <= set(used.columns):
        each = used["flops_per_token"] * used["tokens"]
    if flops:
        declared = [flops.get((a, g if isinstance(g, str) else ""), math.nan)
                    for a, g in zip(used["arm"], used["grid_key"], strict=True)]
        each = pd.Series(declared, index=used.index).fillna(each)
    known = each.dropna()
    hours = None
    if "wall_time_s" in used.columns:
        w = used["wall_time_s"].dropna()
        hours = float(w.sum()) / 3600.0 if len(w) else None
    machines = tuple(sorted({str(m) for m in used["machine"].dropna()})) if "machine" in used.columns else ()
    return Compute(len(used), float(known.sum()) if len(known) else None, hours, machines)


def _grid_sizes(runs: pd.DataFrame) -> dict[str, int]:
    values: dict[str, set[str]] = {}
    for key in runs["grid_key"].fillna("").unique():
        for axis, value in grid_parts(str(key)):
            values.setdefault(axis, set()).add(value)
    return {axis: len(v) for axis, v in values.items()}


def _more_seeds(comp: Comparison, row: Mapping[str, Any], family_rows: int, grid_sizes: Mapping[str, int],
                alpha: float) -> str:
    """`more seeds: ~N`: the sign flip's seeds for 80% power at the row's paired SD (`results.power.power_rows`),
    for the comparison's MEI or margin (else the delta observed), at alpha over the family's rows; less the seeds
    read."""
    n, sd = int(row["n"]), float(row["sd"])
    effect = comp.threshold or abs(float(row["mean_delta"]))
    if n < 2 or not math.isfinite(sd) or sd <= 0:
        return f"more seeds: ~{max(2 - n, 1)} (a paired SD needs two pairs)"
    if not math.isfinite(effect) or effect <= 0:
        return "more seeds: unknown (no effect to size for: declare the comparison's mei)"
    own = rows_per_treatment(comp, grid_sizes)[0] * len(comp.treatments)
    sized = power_rows([comp], n, grid_sizes, sd, min(alpha * own / family_rows, 0.5), mei=effect)[0]
    need = sized.seeds_recommended
    if need is None:
        return "more seeds: >10000 (the effect is too small for this spread)"
    what = "its margin" if comp.kind == "equivalence" else "its mei" if comp.threshold else "the delta observed"
    return f"more seeds: ~{max(need - n, 1)} ({need} in all for 80% power at {what}, paired SD {sd:.3g})"


def _pooled_runs(table: pd.DataFrame, row: Mapping[str, Any]) -> set[str]:
    """A pooled row's run ids: its strata's."""
    want = dict(grid_parts(row["grid_key"]))
    strata = table[(table["role"] == "stratum") & (table["comparison"] == row["comparison"])
                   & (table["treatment"] == row["treatment"])]
    ids: set[str] = set()
    for r in strata.to_dict("records"):
        if all(want.get(a) in ("*", v) for a, v in grid_parts(r["grid_key"])):
            ids |= {i for col in ("control_run_ids", "treatment_run_ids") for i in r[col].split(";") if i}
    return ids


def _marks(comp: Comparison, plan: PlanStatus | None) -> tuple[bool, str | None]:
    change = plan.change_of(comp.name) if plan is not None else None
    whys = [change.why()] if change is not None else []
    if comp.exploratory:
        whys.insert(0, "declared exploratory in the study")
    return bool(whys), "; ".join(whys) or None


def fixed_verdicts(table: pd.DataFrame, comparisons: Iterable[Comparison], runs: pd.DataFrame, *,
                   alpha: float = DEFAULT_ALPHA, plan: PlanStatus | None = None, flops: Flops | None = None
                   ) -> list[Verdict]:
    """A fixed design's verdicts from its paired table (`results.stats.compare`), one per row that is tested
    (a pooled comparison's strata are descriptive); `runs` the runs table the table came from and `flops` one run's
    training FLOPs by arm and grid point (their compute)."""
    by_name = {c.name: c for c in comparisons}
    tested = table[table["role"] != "stratum"]
    family_rows = tested.groupby("family").size().to_dict()
    grid_sizes = _grid_sizes(runs)
    out = []
    for r in tested.to_dict("records"):
        comp = by_name[r["comparison"]]
        decision = FIXED_WORDS[r["verdict"]]
        ids = ({i for col in ("control_run_ids", "treatment_run_ids") for i in r[col].split(";") if i}
               if r["role"] == "row" else _pooled_runs(table, r))
        seeds = tuple(int(s) for s in str(r["seeds"]).split(",") if s) if r["seeds"] else ()
        if r["role"] == "pooled":
            seeds = tuple(sorted({int(s) for s in runs[runs["run_id"].isin(ids)]["seed"]}))
        exploratory, why = _marks(comp, plan)
        nxt = NOTHING if decision != "undecided" else _more_seeds(comp, r, family_rows[r["family"]], grid_sizes,
                                                                  alpha)
        p = float(r["p_adj"])
        out.append(Verdict(comparison=comp.name, control=comp.control, treatment=r["treatment"],
                           point=dict(grid_parts(r["grid_key"])), metric=comp.metric, direction=comp.direction,
                           kind=comp.kind, decision=decision, estimate=float(r["mean_delta"]),
                           low=float(r["ci_low"]), high=float(r["ci_high"]), level=1.0 - alpha,
                           p_value=p if math.isfinite(p) else None, e_value=None, seeds=seeds,
                           compute=_compute(runs, ids, flops), next=nxt, exploratory=exploratory, exploratory_why=why,
                           alpha=alpha))
    return out


def _next_look(design: SequentialDesign, n: int, wait: int | None) -> str:
    if wait is not None:
        return f"the rerun of seed {wait} (the sequence reads seeds in order)"
    later = [k for k in design.looks() if k > n]
    return f"the next look: {later[0]} seeds (+{later[0] - n})" if later else NOTHING


def sequential_verdicts(table: pd.DataFrame, comparisons: Iterable[Comparison], runs: pd.DataFrame,
                        design: SequentialDesign, seeds: tuple[int, ...], *, plan: PlanStatus | None = None,
                        flops: Flops | None = None) -> list[Verdict]:
    """A sequential design's verdicts from its table (`results.sequential.sequential_table`): each row's last look,
    its confidence sequence (at alpha / the family's rows) and e-value; `seeds` the study's, in the order the
    sequence reads them."""
    alpha = float(table.attrs.get("alpha", DEFAULT_ALPHA))
    waits = table.attrs.get("waits", {})
    by_name = {c.name: c for c in comparisons}
    finished = runs[usable(runs)]
    out = []
    for r in table.to_dict("records"):
        comp = by_name[r["comparison"]]
        decision = SEQUENTIAL_WORDS[r["decision"]]
        read = tuple(int(s) for s in seeds[:int(r["n"])])
        used = finished[(finished["grid_key"].fillna("") == r["grid_key"]) & finished["seed"].isin(read)
                        & finished["arm"].isin((comp.control, r["treatment"]))]
        exploratory, why = _marks(comp, plan)
        wait = waits.get((r["comparison"], r["grid_key"], r["treatment"]))
        nxt = NOTHING if decision != "undecided" else _next_look(design, int(r["n"]), wait)
        out.append(Verdict(comparison=comp.name, control=comp.control, treatment=r["treatment"],
                           point=dict(grid_parts(r["grid_key"])), metric=comp.metric, direction=comp.direction,
                           kind=comp.kind, decision=decision, estimate=float(r["mean_delta"]),
                           low=float(r["cs_low"]), high=float(r["cs_high"]), level=1.0 - alpha / int(r["rows"]),
                           p_value=None, e_value=float(r["e_value"]), seeds=read,
                           compute=_compute(runs, set(used["run_id"]), flops), next=nxt, exploratory=exploratory,
                           exploratory_why=why, alpha=alpha))
    return out
