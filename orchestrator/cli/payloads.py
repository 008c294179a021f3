"""The `--json` payloads of the study commands (`validate`, `plan`, `status`; `cli/study.py`), each built from the
values the command's text formats, never from its text. Their schemas are `schemas/<command>.v1.json`
(`cli/jsonout.py` writes them).

A leaf of the command modules: they import it, it imports none of them.
"""

from __future__ import annotations

import math
import re
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Iterable

    from reslab.experiments.budget import RunBudget
    from reslab.experiments.expand import RunSpec
    from reslab.experiments.spec import Study
    from reslab.orchestrator.driving.gates import GatesStatus
    from reslab.orchestrator.driving.plan import PlanEntry
    from reslab.orchestrator.driving.progress import StudyStatus
    from reslab.orchestrator.driving.sequential import SequentialStatus
    from reslab.results.power import Attainable


def study_summary(study: Study, runs: int) -> dict[str, Any]:
    """What `validate`'s first line and its indented lines say of the study: arms, seeds, grid, ladder, runs, the
    sequential design and the comparisons."""
    d = study.sequential
    return {
        "name": study.name, "path": str(study.path), "arms": [a.name for a in study.arms], "seeds": list(study.seeds),
        "grid": [{"path": a.path, "values": len(a.values)} for a in study.grid],
        "ladder": {"paths": [a.path for a in study.ladder], "rungs": len(study.rungs())} if study.ladder else None,
        "runs": runs,
        "sequential": None if d is None else {"start": d.start, "batch": d.batch, "max": d.max, "looks": d.looks(),
                                              "test": d.test, "prior_scale": d.prior_scale},
        "comparisons": [comparison(c) for c in study.comparisons],
    }


def comparison(c: Any) -> dict[str, Any]:
    """A declared comparison, as `Comparison.describe` words it."""
    return {"name": c.name, "control": c.control, "treatments": list(c.treatments), "metric": c.metric,
            "kind": c.kind, "direction": c.direction, "mei": c.mei, "margin": c.margin, "family": c.family,
            "correction": c.correction, "pool": list(c.pool), "at": c.at, "exploratory": c.exploratory,
            "describe": c.describe()}


_FIELD = re.compile(r"[A-Za-z_][\w-]*(\[\d+\])*(\.[A-Za-z_][\w-]*(\[\d+\])*)*")


def problem(message: str, spec: str) -> dict[str, Any]:
    """A refusal as `validate --json` lists it: the one-line message and the field path it starts with (after the
    study file's name), or None when it names none (a flag, a corpus, the budget as a whole)."""
    rest = message[len(spec) + 2:] if message.startswith(f"{spec}: ") else message
    head, sep, _ = rest.partition(": ")
    return {"field": head if sep and _FIELD.fullmatch(head) else None, "message": message}


def gates_payload(status: SequentialStatus | GatesStatus | None) -> dict[str, Any] | None:
    """Where a gates study stands (`GatesStatus.lines` as data): each decision so far with k's bounds at its last
    look, the look in progress, and the runs it and later looks may still run."""
    from reslab.orchestrator.driving.gates import GatesStatus

    if not isinstance(status, GatesStatus):
        return None
    g = status.gates
    outcomes = [{"gate": g.plan.gates[o.gate].name, "treatment": o.treatment, "decision": o.decision,
                 "seeds": o.seeds, "flops": o.compute, "points": [float(x) for x in o.last.points],
                 "k": [_finite(float(x)) for x in o.last.k], "low": [_finite(float(x)) for x in o.last.low],
                 "high": [_finite(float(x)) for x in o.last.high]} for o in g.outcomes]
    return {"gates": [x.name for x in g.plan.gates], "looks": list(g.plan.looks), "current": status.current,
            "outcomes": outcomes, "stopped": g.stopped or None, "pending": len(status.pending),
            "later": len(status.later), "most": status.most, "done": status.current is None}


def looks_payload(status: SequentialStatus | GatesStatus | None) -> dict[str, Any] | None:
    """Where a sequential study's looks stand (`SequentialStatus.lines` as data); None for any other study (a
    gates study's are `gates_payload`)."""
    from reslab.orchestrator.driving.sequential import SequentialStatus

    if not isinstance(status, SequentialStatus):
        return None
    rows = [] if status.table is None else [
        {"comparison": r["comparison"], "grid_key": r["grid_key"], "control": r["control"],
         "treatment": r["treatment"], "decision": r["decision"], "seeds": r["n"], "mean_delta": r["mean_delta"]}
        for r in status.table.to_dict("records")]
    return {"looks": status.looks, "read": status.read, "current": status.current, "rows": rows,
            "pending": len(status.pending), "later": len(status.later), "most": status.most,
            "done": status.current is None}


def run_fields(run: RunSpec) -> dict[str, Any]:
    return {"run_id": run.run_id, "arm": run.arm, "grid_key": run.grid_key, "seed": run.seed, "label": run.label}


def plan_entry(e: PlanEntry) -> dict[str, Any]:
    """One line of `reslab plan --ids`: the run, its action (run, skip, busy), why, and its run directory's state."""
    return {**run_fields(e.run), "action": e.action.value, "reason": e.reason, "state": e.state,
            "checkpoint_step": e.checkpoint_step}


def attainable_row(a: Attainable) -> dict[str, Any]:
    """A `power:` line of `reslab plan`: the smallest attainable p of a comparison at the study's seeds."""
    c = a.comparison
    return {"comparison": c.name, "kind": c.kind, "exploratory": c.exploratory, "family": c.family,
            "family_size": a.family_size, "correction": c.correction, "pairs_per_row": a.n_pairs,
            "attainable_p": a.p, "alpha": a.alpha, "reachable": a.reachable}


def budget_row(b: RunBudget, runs: int) -> dict[str, Any]:
    """A row of `reslab plan`'s budget table."""
    return {"label": b.label, "corpus": b.corpus, "params": b.params, "total_params": b.total_params,
            "tokens_per_run": b.tokens, "tokens_per_param": b.tokens_per_param, "passes": b.passes,
            "over_budget": b.over_budget, "flops_per_run": b.flops, "gpu_hours_per_run": b.gpu_hours,
            "throughput": b.throughput.factor, "throughput_source": b.throughput.source, "runs": runs,
            "flops": b.flops * runs, "gpu_hours": b.gpu_hours * runs}


def ladder_rung(label: str, budgets: Iterable[tuple[RunBudget, int]]) -> dict[str, Any]:
    """A row of `reslab plan`'s ladder table: the rung's runs and what they cost."""
    budgets = list(budgets)
    return {"label": label, "runs": sum(n for _, n in budgets),
            "params": [min(b.params for b, _ in budgets), max(b.params for b, _ in budgets)],
            "flops_per_run": [min(b.flops for b, _ in budgets), max(b.flops for b, _ in budgets)],
            "gpu_hours": sum(b.gpu_hours * n for b, n in budgets), "flops": sum(b.flops * n for b, n in budgets)}


def plan_costs(budgets: list[tuple[RunBudget, int]], rungs: list[tuple[str, list[tuple[RunBudget, int]]]] | None,
               gpus: bool, gpus_per_run: int, cluster_gpus: int | None) -> dict[str, Any]:
    """The budget table, the ladder's rungs and the placement of `reslab plan`, as data. `rungs` None: no ladder
    (the placement then sizes the study's runs as one rung, as the text does)."""
    from reslab.experiments.budget import wall_clock_hours

    placement = None
    if gpus:
        at_once = cluster_gpus // gpus_per_run if cluster_gpus is not None else None
        groups = rungs if rungs is not None else [("study", budgets)]
        placement = {"gpus_per_run": gpus_per_run, "cluster_gpus": cluster_gpus, "runs_at_once": at_once,
                     "rungs": None if not at_once else [
                         {"label": label, "runs": sum(n for _, n in b),
                          "wall_clock_hours": wall_clock_hours(b, gpus_per_run, at_once)} for label, b in groups]}
    return {"on_gpus": gpus, "budget": [budget_row(b, n) for b, n in budgets],
            "total_gpu_hours": sum(b.gpu_hours * n for b, n in budgets) if gpus else None,
            "total_flops": sum(b.flops * n for b, n in budgets),
            "ladder": None if rungs is None else [ladder_rung(label, b) for label, b in rungs],
            "placement": placement}


def status_payload(study: Study, status: StudyStatus) -> dict[str, Any]:
    """`reslab.status/1`: the counts by state, the ETA, a sequential study's looks, and every run's state."""
    runs = [{**run_fields(r.entry.run), "state": r.state, "step": r.step, "steps": r.entry.run.config.train.steps,
             "train_loss": r.train_loss, "val_loss": r.val_loss, "reason": r.entry.reason} for r in status.runs]
    return {"study": study.name, "total": len(status.runs), "counts": status.counts(),
            "eta_s": _finite(status.eta_s),
            "eta_most_s": _finite(status.eta_most_s) if status.sequential is not None else None,
            "sequential": looks_payload(status.sequential), "gates": gates_payload(status.sequential), "runs": runs}


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None
