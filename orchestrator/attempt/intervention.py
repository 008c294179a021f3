"""Interventions: work after training, one unit per (run, request), kept whole in the run directory.

A unit's content id is `experiments.interventions.intervention_id` (the run id, which carries the code
version, and the request's settings). Its records live in the run directory:

    interventions/<id>.jsonl   one row per intervention (`models.interventions.effects`: kind, site, source,
                               mode, loss, base_loss, delta, tokens) with the run id and the unit's id; written
                               under a temporary name and renamed into place
    interventions/<id>.json    the request's settings and the rows' count; written last, so it marks the unit done
    interventions/.lock        held while intervening: a second worker on the same run waits, then finds the
                               unit done and skips it

So a request is carried out once per run: a finished unit is skipped (`pending` reads the marker), an
interrupted one left no marker and runs again from its start. The worker loads the run's final checkpoint
(`models.evals.run_model.intervene_run`) and knocks out each source on the same held-out eval windows training
evaluated on (`train.eval_windows`), in the run's dtype. Only runs whose training finished, of the arms the
request names, are intervened on. The task that carries it is a task of work after training
(`orchestrator.attempt.after`).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from reslab.common.io import file_lock, write_atomic
from reslab.experiments.expand import RunSpec
from reslab.experiments.interventions import InterventionSpec, intervention_id
from reslab.orchestrator.durability.workspace import RunDir, UnitFiles

INTERVENTIONS_DIR = "interventions"
ROW_KEYS = ("kind", "site", "source", "mode", "loss", "base_loss", "delta", "tokens")


@dataclass(frozen=True)
class InterventionUnit(UnitFiles):
    """One (run, request): where its records go."""

    run: RunSpec
    intervention_id: str
    directory: Path
    records_suffix = ".jsonl"

    @property
    def stem(self) -> str:
        return self.intervention_id


def unit_of(run: RunSpec, rd: RunDir, spec: InterventionSpec) -> InterventionUnit:
    return InterventionUnit(run, intervention_id(run.run_id, spec), rd.path / INTERVENTIONS_DIR)


def pending(run: RunSpec, rd: RunDir, spec: InterventionSpec) -> InterventionUnit | None:
    """The run's unit when it is still to do: its training finished, its arm is asked for, no marker."""
    if not spec.applies(run.arm) or not rd.complete():
        return None
    unit = unit_of(run, rd, spec)
    return None if unit.done() else unit


def metric_key(row: dict[str, Any]) -> str:
    """`knockout/<mode>/<site>/<source>` (site `all` for a whole stream or a gate pinned at every site): the
    MLflow metric that holds the row's delta."""
    site = "all" if row.get("site") is None else row["site"]
    return f"knockout/{row['mode']}/{site}/{row['source']}"


def metrics_of(rows: list[dict[str, Any]]) -> dict[str, float]:
    """The unit's MLflow metrics: each row's delta (`metric_key`), finite ones only."""
    return {metric_key(r): float(r["delta"]) for r in rows if math.isfinite(float(r["delta"]))}


def _write(unit: InterventionUnit, rows: list[dict[str, Any]], spec: InterventionSpec) -> None:
    unit.directory.mkdir(parents=True, exist_ok=True)
    tmp = unit.records.with_name(f".{unit.records.name}.tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tmp.replace(unit.records)
    write_atomic(unit.marker, json.dumps({"run_id": unit.run.run_id, "intervention_id": unit.intervention_id,
                                          "settings": spec.settings(), "rows": len(rows)}, indent=2) + "\n")


def intervene(run: RunSpec, rd: RunDir, spec: InterventionSpec, *,
              device: str | None = None) -> tuple[InterventionUnit, list[dict[str, Any]] | None]:
    """Carry out the run's request (when pending) and write its records; returns the unit with its rows, or
    None for rows when it was done already (skipped)."""
    from reslab.experiments.interventions import resolve
    from reslab.models.evals.run_model import intervene_run

    with file_lock(rd.path / INTERVENTIONS_DIR / ".lock"):
        unit = unit_of(run, rd, spec)
        if unit.done():
            return unit, None
        effects = intervene_run(run.config, rd.path, resolve(spec, run.config), device=device)
        rows = [{**{k: r[k] for k in ROW_KEYS}, "run_id": run.run_id, "intervention_id": unit.intervention_id}
                for r in effects]
        _write(unit, rows, spec)
        return unit, rows


def read_rows(run: RunSpec, rd: RunDir, spec: InterventionSpec | None) -> list[dict[str, Any]]:
    """The run's intervention rows with its arm, grid point and seed: under the study's request when it declares
    one (that unit only), else the newest unit's."""
    folder = rd.path / INTERVENTIONS_DIR
    if spec is not None:
        records = unit_of(run, rd, spec).records
        paths = [records] if records.with_suffix(".json").is_file() else []
    else:
        markers = sorted(folder.glob("*.json"), key=lambda p: p.stat().st_mtime) if folder.is_dir() else []
        paths = [markers[-1].with_suffix(".jsonl")] if markers else []
    rows: list[dict[str, Any]] = []
    for path in paths:
        if path.is_file():
            rows += [{"arm": run.arm, "grid_key": run.grid_key, "seed": run.seed, **json.loads(line)}
                     for line in path.read_text().splitlines() if line.strip()]
    return rows
