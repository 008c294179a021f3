"""A study's records from its run directories (the runs' own files, so no MLflow metric history is
needed): per-eval curves and last-eval diagnostics, for the report's plots (`orchestrator.report`) and
for comparisons at equal cost (`orchestrator.readout`). Runs whose directory is gone have no curve.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from reslab.experiments.expand import RunSpec
from reslab.experiments.spec import Study
from reslab.models.diagnostics import routes_of, routing_matrix
from reslab.models.presets import resolve_model
from reslab.orchestrator.workspace import Workspace

__all__ = ["StudyRecords", "study_records", "tokens_per_step"]


@dataclass(frozen=True)
class StudyRecords:
    evals: pd.DataFrame  # one row per eval: arm, grid_key, seed, step, tokens, val_loss
    depths: pd.DataFrame  # one row per run with a last-eval D_eff: arm, grid_key, seed, d_eff, f_l
    # grid point -> arm -> seed-mean last-eval routing (NaN: no source), grid points in study order
    routing: dict[str, dict[str, tuple[np.ndarray, list[str]]]]
    profiles: dict[str, dict[str, list[float | None]]]  # grid point -> arm -> seed-mean concentration per layer


def tokens_per_step(run: RunSpec) -> int:
    o = run.config.optim
    seq_len = resolve_model(run.config.model, vocab_size=1).seq_len  # the vocab does not change seq_len
    return o.batch_size * o.grad_accum * seq_len


def _mean_profile(profiles: list[list[float | None]]) -> list[float | None]:
    out: list[float | None] = []
    for values in zip(*profiles, strict=True):
        present = [v for v in values if v is not None]
        out.append(sum(present) / len(present) if present else None)
    return out


def study_records(study: Study, runs: list[RunSpec], workspace: Workspace) -> StudyRecords:
    """Per-eval curves and last-eval diagnostics of the study's runs from their run directories.

    Routing matrices and concentration profiles are averaged over seeds, per grid point and arm
    (arms at different grid points differ in depth or heads, so they are never pooled); only the
    unnamed (or first) route is drawn."""
    evals, depths = [], []
    routing: dict[str, dict[str, list[np.ndarray]]] = {}
    labels: dict[tuple[str, str], list[str]] = {}  # (grid point, arm) -> its sites
    profiles: dict[str, dict[str, list[list[float | None]]]] = {}
    for run in runs:
        rd = workspace.run_dir(study.name, run.run_id)
        per_step = tokens_per_step(run)
        for row in rd.metrics():
            if row["kind"] == "eval":
                evals.append({"arm": run.arm, "grid_key": run.grid_key, "seed": run.seed, "step": row["step"],
                              "tokens": row["step"] * per_step, "val_loss": float(row["val_loss"])})
        diagnostics = rd.diagnostics()
        if not diagnostics:
            continue
        last = diagnostics[-1]
        depth = last.get("effective_depth")
        if isinstance(depth, dict):
            depths.append({"arm": run.arm, "grid_key": run.grid_key, "seed": run.seed, "d_eff": depth["d_eff"],
                           "f_l": depth["f_l"]})
        route = last.get("routing") or {}
        if route.get("sites"):
            matrix, rows = routing_matrix(route, routes_of(route)[0])
            routing.setdefault(run.grid_key, {}).setdefault(run.arm, []).append(matrix)
            labels[run.grid_key, run.arm] = rows
            profiles.setdefault(run.grid_key, {}).setdefault(run.arm, []).append(route["concentration_by_layer"])
    return StudyRecords(
        evals=pd.DataFrame(evals, columns=["arm", "grid_key", "seed", "step", "tokens", "val_loss"]),
        depths=pd.DataFrame(depths, columns=["arm", "grid_key", "seed", "d_eff", "f_l"]),
        routing={point: {a: (np.stack(ms).mean(axis=0), labels[point, a]) for a, ms in arms.items()}
                 for point, arms in routing.items()},
        profiles={point: {a: _mean_profile(ps) for a, ps in arms.items()} for point, arms in profiles.items()},
    )
