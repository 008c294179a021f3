"""A study's records gathered into its readouts (`results.readout.StudyReadout`), for `reslab compare`,
`export` and `report`, the end of `reslab run` and the submission's parent MLflow run.

MLflow records come through `tracking.readers.fetch_study_runs` (or the Parquet cache of the last
collect) and the run directories give the eval curves and the last evaluation's diagnostics, so a report
needs no MLflow metric history. Runs whose directory is gone have no curve.

The study data is filled by a list of readers, one per field (`READERS`); what the readers read they hand to
`results/` as rows (`results.records` aggregates them over seeds). No kind of result is named here outside the
readers: each readout gives its own facts, tables and records.
"""

from __future__ import annotations

import os
import re
import sys
import tempfile
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import numpy as np
import pandas as pd

from reslab.common.errors import ConfigError
from reslab.common.forks import Forked
from reslab.common.io import collector_paused
from reslab.experiments import expand
from reslab.experiments.expand import RunSpec, grid_key_of, rung_keys
from reslab.experiments.spec import Study
from reslab.models.diagnostics import routes_of, routing_matrix
from reslab.models.presets import resolve_model
from reslab.orchestrator.durability.workspace import (
    DIAGNOSTICS_FILE,
    METRICS_FILE,
    RunDir,
    Workspace,
    read_jsonl,
    read_last_row,
    read_metrics,
    read_runs_in_order,
)
from reslab.orchestrator.gathering.analysis import analysis_notes
from reslab.orchestrator.tracking.protocol import DriverTracker
from reslab.orchestrator.tracking.readers import fetch_study_runs
from reslab.results.collect import RECORD_KEYS, collect, load_cached, save_cached, usable
from reslab.results.comparison import Comparison
from reslab.results.gate_results import GatesDesign
from reslab.results.interventions import intervention_values
from reslab.results.ladder import LadderScope
from reslab.results.mechanisms import summary_values
from reslab.results.readout import StudyData, StudyReadout
from reslab.results.readouts.base import EVAL_COLUMNS, Cost, Style, TrainingRecords
from reslab.results.records import FoundProfile, ProfileVector, depth_profiles, profile_vectors, seed_means

__all__ = ["gather", "publish_result", "publish_study_result", "read_records", "study_facts", "study_result",
           "tokens_per_step"]


def tokens_per_step(run: RunSpec) -> int:
    o = run.config.optim
    seq_len = resolve_model(run.config.model, vocab_size=1).seq_len  # the vocab does not change seq_len
    return o.batch_size * o.grad_accum * seq_len


def _read_run_files(study: Study, runs: list[RunSpec], workspace: Workspace
                    ) -> Iterator[tuple[list[dict], dict | None]]:
    """Each run's `metrics.jsonl` eval rows and the last row of its `diagnostics.jsonl` (read from the file's end),
    in run order, the disk read ahead where they are not cached (`workspace.read_runs_in_order`)."""
    study_dir = workspace.study_dir(study.name)
    base = os.fspath(study_dir)  # once: `workspace.run_dir` per run joins it again

    def read(i: int) -> tuple[list[dict], dict | None]:
        folder = os.path.join(base, runs[i].run_id)  # strings: a pathlib join a file was a second at 10^5 runs
        return read_metrics(os.path.join(folder, METRICS_FILE), "eval"), \
            read_last_row(os.path.join(folder, DIAGNOSTICS_FILE))

    return read_runs_in_order(study_dir, [r.run_id for r in runs], (METRICS_FILE, DIAGNOSTICS_FILE), read)


def _depth_profiles(study: Study, found: list[FoundProfile], run_ids: list[str], workspace: Workspace
                    ) -> pd.DataFrame:
    """`results.records.depth_profiles` of the found runs (`run_ids`: theirs, in order): a run whose last row is
    later than the grid point's common step has its rows there read from its whole file."""
    base = os.fspath(workspace.study_dir(study.name))

    def vectors_at(i: int, step: int) -> list[ProfileVector]:
        rows = read_jsonl(os.path.join(base, run_ids[i], DIAGNOSTICS_FILE))
        return [v for d in rows if d["step"] == step for v in profile_vectors(d)]

    return depth_profiles(found, vectors_at)


def _runs_with(study: Study, runs: list[RunSpec], workspace: Workspace, folder: str
               ) -> Iterator[tuple[RunSpec, RunDir]]:
    """The runs whose run directory holds `folder` (evaluations, interventions), each with its directory: one
    `isdir` of a joined string a run (pathlib's joins alone took seconds at 10^5 runs; issue 39)."""
    base = os.fspath(workspace.study_dir(study.name))
    for run in runs:
        if os.path.isdir(os.path.join(base, run.run_id, folder)):
            yield run, RunDir(Path(base, run.run_id))


def read_records(study: Study, runs: list[RunSpec], workspace: Workspace) -> TrainingRecords:
    """Per-eval curves, depth profiles (at the step they are drawn at: `_depth_profiles`) and
    last-eval diagnostics of the study's runs from their run directories. A run whose last evaluation recorded
    no magnitudes counts as having none (a run records them at every evaluation or at none).

    Routing matrices and concentration profiles are averaged over seeds, per grid point and arm
    (arms at different grid points differ in depth or heads, so they are never pooled); only the
    unnamed (or first) route is drawn."""
    evals: dict[str, list] = {name: [] for name in EVAL_COLUMNS}  # columns: 10^5 runs' evals, no dict per row
    depths: list[dict] = []
    found: list[FoundProfile] = []  # the runs' last rows' profile vectors
    found_ids: list[str] = []
    routing: dict[str, dict[str, list[np.ndarray]]] = {}
    labels: dict[tuple[str, str], list[str]] = {}  # (grid point, arm) -> its sites
    profiles: dict[str, dict[str, list[list[float | None]]]] = {}
    steps_of: dict[tuple[str, str], int] = {}  # a seed sets train.seed alone: one resolved model per arm and point
    for run, (metrics, last) in zip(runs, _read_run_files(study, runs, workspace), strict=True):  # eval rows
        per_step = steps_of.get((run.arm, run.grid_key)) or steps_of.setdefault((run.arm, run.grid_key),
                                                                                 tokens_per_step(run))
        steps = [row["step"] for row in metrics]
        for name, value in (("arm", run.arm), ("grid_key", run.grid_key), ("seed", run.seed)):
            evals[name] += [value] * len(steps)
        evals["step"] += steps
        evals["tokens"] += [step * per_step for step in steps]
        evals["val_loss"] += [float(row["val_loss"]) for row in metrics]
        if last is None:
            continue
        if isinstance(last.get("magnitudes"), dict) or isinstance(last.get("moe"), dict):
            found.append((run.grid_key, run.arm, run.seed, last["step"], profile_vectors(last)))
            found_ids.append(run.run_id)
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
    mean_routing, mean_profiles = seed_means(routing, labels, profiles)
    return TrainingRecords(
        evals=pd.DataFrame(evals, columns=list(EVAL_COLUMNS)),
        depths=pd.DataFrame(depths, columns=["arm", "grid_key", "seed", "d_eff", "f_l"]),
        routing=mean_routing, profiles=mean_profiles,
        depth_profiles=_depth_profiles(study, found, found_ids, workspace),
    )


def task_items(study: Study, runs: list[RunSpec], workspace: Workspace) -> pd.DataFrame:
    """Every evaluated item of the study's runs (`orchestrator.attempt.evaluation.read_items`), for the
    downstream-tasks readout."""
    from reslab.orchestrator.attempt.evaluation import EVALS_DIR, read_items

    rows = [row for run, rd in _runs_with(study, runs, workspace, EVALS_DIR)
            for row in read_items(run, rd, study.evals)]
    return pd.DataFrame(rows, columns=["arm", "grid_key", "seed", "task", "metric", "doc_id", "value"])


def intervention_rows(study: Study, runs: list[RunSpec], workspace: Workspace) -> pd.DataFrame:
    """Every intervention of the study's runs (`orchestrator.attempt.intervention.read_rows`: the study's
    request, or the newest of a study that declares none), for the interventions readout."""
    from reslab.orchestrator.attempt.intervention import INTERVENTIONS_DIR, read_rows

    rows = [row for run, rd in _runs_with(study, runs, workspace, INTERVENTIONS_DIR)
            for row in read_rows(run, rd, study.interventions)]
    columns = ["arm", "grid_key", "seed", "kind", "site", "source", "mode", "loss", "base_loss", "delta", "tokens"]
    return pd.DataFrame(rows, columns=columns)


def mechanism_values(study: Study, runs: list[RunSpec], workspace: Workspace, table: pd.DataFrame) -> pd.DataFrame:
    """Every run's mechanism values, long: its training summaries' (`results.mechanisms.summary_values`) and, for
    a run intervened on, its interventions' (`results.interventions.intervention_values`: imbalance, stream
    knock-outs)."""
    frames = [summary_values(table), intervention_values(intervention_rows(study, runs, workspace))]
    return pd.concat([f for f in frames if not f.empty], ignore_index=True) if any(not f.empty for f in frames) \
        else frames[0]


def _where(runs: list[RunSpec], study: Study) -> str:
    """The grid points that `runs` cover, or the arms (at a grid point) where only some arms are in."""
    all_arms = {a.name for a in study.arms}
    arms_at: dict[str, set[str]] = {}
    for run in runs:
        arms_at.setdefault(run.grid_key, set()).add(run.arm)
    places: list[str] = []
    for point, arms in sorted(arms_at.items()):
        if point and arms == all_arms:
            places.append(point)
        else:
            places += [f"{arm} at {point}" if point else arm for arm in sorted(arms)]
    return ", ".join(places)


def _over_runs(study: Study, runs: list[RunSpec], describe: Callable[[RunSpec], str]) -> str:
    """One fact over every run: its value when all runs share it, else each value with where it holds. `describe`
    reads what a seed does not change (a seed sets train.seed alone), so it is called once per arm and grid point."""
    by_value: dict[str, list[RunSpec]] = {}
    described: dict[tuple[str, str], str] = {}
    for run in runs:
        key = (run.arm, run.grid_key)
        value = described.get(key)
        if value is None:
            value = described[key] = describe(run)
        by_value.setdefault(value, []).append(run)
    if len(by_value) == 1:
        return next(iter(by_value))
    return "; ".join(f"{value} [{_where(rs, study)}]" for value, rs in by_value.items())


def _model(run: RunSpec) -> str:
    shape = resolve_model(run.config.model, vocab_size=1)  # the vocabulary does not change these sizes
    return (f"{run.config.model.preset}: d_model {shape.d_model}, {shape.n_layers} layers, {shape.n_heads} heads, "
            f"seq_len {shape.seq_len}")


def study_facts(study: Study, runs: list[RunSpec], finished_seeds: Iterable[int] = ()) -> list[tuple[str, str]]:
    """What was run, over every run of the study: a fact that differs between grid points (or arms)
    lists each value with the grid points (or arms) it holds for. A sequential study's seeds are the
    ones with a finished run (`finished_seeds`), out of its design's maximum. The kinds of result add theirs,
    then the comparisons and code versions follow (`results.readout.StudyReadout.facts`)."""
    arms = ", ".join(f"{a.name} ({a.residual})" for a in study.arms)
    grid = "; ".join(f"{a.path} = {', '.join(map(str, a.values))}" for a in study.grid) or "none"
    seeds = ", ".join(map(str, study.seeds))
    if study.sequential is not None:
        d, ran = study.sequential, [s for s in study.seeds if s in set(finished_seeds)]
        seeds = (f"sequential: {d.start}, +{d.batch} per look, at most {d.max}; {len(ran)} run "
                 f"({', '.join(map(str, ran)) or 'none yet'})")
    facts = [("arms", arms), ("seeds", seeds), ("grid", grid)]
    if (placed := _resources(study)) is not None:
        facts.append(("resources", placed))
    if runs:
        facts += [
            ("corpus", _over_runs(study, runs, lambda r: f"{r.config.data.corpus} ({r.config.data.tokenizer} "
                                                         "tokenizer)")),
            ("model", _over_runs(study, runs, _model)),
            ("tokens per run", _over_runs(study, runs, lambda r: f"{r.config.train.steps * tokens_per_step(r):,} "
                                                                 f"({r.config.train.steps} steps)")),
        ]
    return facts


def _resources(study: Study) -> str | None:
    """How each run was placed, where the study says (`resources:`): ranks, sharding, pipeline stages and their
    schedule; None where it leaves placement to the command line's defaults (one rank a run)."""
    res = study.resources
    pipe = res.pipeline
    if res.gpus_per_run is None and res.sharding is None and pipe.stages == 1:
        return None
    parts = [f"{res.gpus_per_run or 1} rank(s) per run"]
    if pipe.stages > 1:
        parts.append(f"pipeline: {pipe.stages} stages x {res.replicas} replica(s), {pipe.schedule}, "
                     f"{pipe.microbatches} micro-batch(es)"
                     + (f", {pipe.virtual_stages} virtual stages per rank" if pipe.virtual_stages > 1 else "")
                     + (", cross-stage cache" if pipe.cache else ""))
    elif res.sharding is not None:
        parts.append(f"sharding: {res.sharding}")
    return "; ".join(parts)


_STATED = {"steps": re.compile(r"\b(\d[\d,]*)\s+(?:training\s+)?steps\b"), "seeds": re.compile(r"\b(\d+)\s+seeds\b")}


def described(study: Study, runs: list[RunSpec]) -> str:
    """The study file's description, and where it states a step or seed count this study did not run (a `--set`
    override, a shrunk copy of a study), what was run: the description is the file's own words, written once."""
    text = study.description
    if not text or not runs:
        return text
    ran = {"steps": {r.config.train.steps for r in runs}, "seeds": {len(study.seeds)}}
    if study.sequential is not None:  # a sequential design's seed count is decided as it runs
        ran["seeds"] = set()
    stated = {k: {int(n.replace(",", "")) for n in pattern.findall(text)} for k, pattern in _STATED.items()}
    differ = [f"{'/'.join(map(str, sorted(ran[k])))} {k}" for k in _STATED if ran[k] and stated[k] - ran[k]]
    if not differ:
        return text
    sets = " ".join(f"--set {k}={v}" for k, v in study.overrides)
    return f"{text} [the study file's description; as run: {', '.join(differ)}{f' ({sets})' if sets else ''}]"


def _runs_table(study: Study, runs: list[RunSpec], workspace: Workspace, tracking_uri: str,
                cached: bool) -> pd.DataFrame:
    """The study's runs table: from MLflow, or from the Parquet cache of the last collect with `cached`."""
    if cached:
        table = load_cached(study.name, workspace.cache)
        return table[table["run_id"].isin({r.run_id for r in runs})].reset_index(drop=True)
    if tracking_uri == workspace.default_tracking_uri() and not workspace.mlflow_db.is_file():
        raise ConfigError(f"--workspace: no MLflow store at {workspace.mlflow_db}: nothing has run in workspace "
                          f"{workspace.root}; pass the workspace `reslab run` used (--workspace or "
                          "$RESLAB_WORKSPACE) or --tracking-uri")
    return collect(study.name, fetch_study_runs(tracking_uri, study.name, params=False, keys=RECORD_KEYS),
                   expected=runs)


def _costs(study: Study, runs: list[RunSpec]) -> dict[tuple[str, str], Cost]:
    """(arm, grid key) -> one run's training FLOPs, parameters and steps (`experiments.budget`), for a study
    whose readouts need them: a ladder, or a comparison at equal FLOPs or wall-clock."""
    if not study.ladder and all(c.at == "tokens" for c in study.comparisons):
        return {}
    from reslab.experiments.budget import budgets_by_point

    steps = {(r.arm, r.grid_key): r.config.train.steps for r in reversed(runs)}  # the first run's
    return {key: Cost(b.flops, float(b.params), steps[key]) for key, (b, _) in budgets_by_point(runs).items()}


FORKED_READ_RUNS = 2_000  # fewer runs read here: ~0.2 s, about what a fork and its answer's pickling cost


def _gates(study: Study) -> GatesDesign | None:
    """A gates study's plan, arms, metric and targets (`experiments.gates.GatesSpec`) with its ladder's rungs and
    one run's FLOPs at every (arm, rung), the rungs no look reached included (the saving prices the full ladder)."""
    spec = study.gates
    if spec is None:
        return None
    from reslab.experiments.budget import budgets_by_point

    keys = tuple(rung_keys(study, study.scope_points()[0]))
    flops = {key: b.flops for key, (b, _) in budgets_by_point(expand(study, study.seeds[:1])).items()}
    return GatesDesign(spec.plan, spec.control, spec.treatments, keys, spec.metric, spec.targets, spec.max_decades,
                       flops=flops)


def _comparisons(study: Study) -> tuple[Comparison, ...]:
    """The study's comparisons; a study that declares none, no contrasts and no gates has nothing to compare."""
    if not study.comparisons and not study.contrasts and study.gates is None:
        raise ConfigError(f"{study.path}: comparisons: none declared; add a `comparisons:` list to compare arms")
    return tuple(study.comparisons)


@dataclass(frozen=True)
class Sources:
    """What the readers read: the study, its runs, the workspace, the runs table (MLflow's or the cache's), the
    level of the readouts' intervals, and the training records when a forked copy reads them (`study_data`)."""

    study: Study
    runs: list[RunSpec]
    workspace: Workspace
    table: pd.DataFrame
    alpha: float
    records: Forked[TrainingRecords] | None = None

    def spec(self) -> str:
        sets = " ".join(f"--set {k}={v}" for k, v in self.study.overrides)
        return f"{self.study.path}{' ' + sets if sets else ''}"

    def code_versions(self) -> tuple[str, ...]:
        codes = self.table["code_version"].dropna() if "code_version" in self.table else ()  # a hand-made cache
        return tuple(sorted({c for c in codes if c}))

    def finished_seeds(self) -> list[int]:
        return self.table[usable(self.table)]["seed"].dropna().astype(int).tolist()


# One reader per field of `results.readouts.base.StudyData` (`tests/orchestrator/test_gather_readers.py`): a new
# input a readout needs is a field there and a line here. A `read_*` field is read on first use.
READERS: dict[str, Callable[[Sources], Any]] = {
    "name": lambda s: s.study.name,
    "runs": lambda s: s.table,
    "comparisons": lambda s: _comparisons(s.study),
    "alpha": lambda s: s.alpha,
    "description": lambda s: described(s.study, s.runs),
    "reproduce": lambda s: (f"reslab run {s.spec()}", f"reslab compare {s.spec()}",
                            f"reslab report {s.spec()} -o report.html"),
    "seeds": lambda s: tuple(s.study.seeds),
    "grid_axes": lambda s: tuple(a.path for a in s.study.grid),
    "contrasts": lambda s: tuple(s.study.contrasts),
    "sequential": lambda s: s.study.sequential,
    "ladder": lambda s: tuple(LadderScope(grid_key_of(p), tuple(rung_keys(s.study, p)))
                              for p in s.study.scope_points()) if s.study.ladder else (),
    "gates": lambda s: _gates(s.study),
    "costs": lambda s: _costs(s.study, s.runs),
    "cost_metrics": lambda s: s.study.costs,
    "mechanism_metrics": lambda s: s.study.mechanisms,
    "intervention_plan": lambda s: s.study.interventions.describe() if s.study.interventions is not None else "",
    "code_versions": Sources.code_versions,
    "analysis_notes": lambda s: analysis_notes(s.study, s.workspace, s.alpha, s.table),
    "read_records": lambda s: s.records.value if s.records is not None else
    lambda: read_records(s.study, s.runs, s.workspace),
    "read_facts": lambda s: lambda: study_facts(s.study, s.runs, s.finished_seeds()),
    "read_task_items": lambda s: lambda: task_items(s.study, s.runs, s.workspace),
    "read_mechanisms": lambda s: lambda: mechanism_values(s.study, s.runs, s.workspace, s.table),
    "read_interventions": lambda s: lambda: intervention_rows(s.study, s.runs, s.workspace),
}


def study_data(study: Study, runs: list[RunSpec], workspace: Workspace, tracking_uri: str, *,
               cached: bool = False, alpha: float = 0.05, workers: int = 1) -> StudyData:
    """The study as its readouts take it (`results.readouts.base.StudyData`), each field from its reader
    (`READERS`). Reads only: the workspace's SQLite store is never created by a read. With `workers` > 1 (a
    caller that may fork and will draw the report) and `FORKED_READ_RUNS` runs or more, the run folders' records
    are read by a forked copy (`common.forks.Forked`) while this process reads the store and computes the
    statistics: at 10^5 runs, ~8 s of a report's ~34 on 2 cores (issue 39)."""
    _comparisons(study)  # before anything is read
    forked = workers > 1 and len(runs) >= FORKED_READ_RUNS
    records = Forked(lambda: read_records(study, runs, workspace)) if forked else None
    try:
        table = _runs_table(study, runs, workspace, tracking_uri, cached)
    except BaseException:
        if records is not None:
            records.cancel()
        raise
    sources = Sources(study, runs, workspace, table, alpha, records)
    return StudyData(**{name: read(sources) for name, read in READERS.items()})


def gather(study: Study, runs: list[RunSpec], workspace: Workspace, tracking_uri: str, *, cached: bool = False,
           alpha: float = 0.05, write_cache: bool = False, workers: int = 1) -> StudyReadout:
    """The study's readouts. The Parquet cache is written only with `write_cache` (the end of `reslab run`),
    into an existing workspace, so a read-only workspace serves `compare`, `export` and `report`. `workers`:
    see `study_data`."""
    readout = StudyReadout(study_data(study, runs, workspace, tracking_uri, cached=cached, alpha=alpha,
                                      workers=workers))
    if write_cache and not cached and workspace.root.is_dir():
        save_cached(study.name, readout.runs, workspace.cache)
    return readout


def publish_study_result(readout: StudyReadout, tracker: DriverTracker, key: str | None = None) -> str:
    """Put the study's result on this submission's parent MLflow run: every readout's files (the paired
    table, its plots, a ladder's and contrasts' tables, a sequential study's path), `report.html`, the
    MLflow tables and metric series; then, with `key` (the finished runs it came from), mark the
    publication whole (`DriverTracker.mark_published`), its last step. Idempotent: a publication cut
    short is completed by the next. Returns the parent's MLflow id."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        parent = tracker.log_study_result(readout.publish(out), out)
    if key is not None:
        tracker.mark_published(key)
    return parent


def publish_result(study: Study, runs: list[RunSpec], workspace: Workspace, tracker: DriverTracker,
                   key: str) -> StudyReadout:
    """The study's result gathered and published whole on the submission's parent run (`publish_study_result`):
    what `reslab run` sets as its tracker's `publisher`, which `driving.submit.submit` calls before it ends the
    parent run, so the parent is FINISHED only with its result on it. Returns the readout, which `study_result`
    prints. Gathered with the cyclic collector paused (`common.io.collector_paused`), as the read commands are."""
    with collector_paused():
        readout = gather(study, runs, workspace, tracker.uri, write_cache=True)
        publish_study_result(readout, tracker, key)
    return readout


def study_result(study: Study, runs: list[RunSpec], workspace: Workspace, tracker: DriverTracker, *, publish: bool,
                 stream: TextIO | None = None, readout: StudyReadout | None = None) -> None:
    """What `reslab run` prints after its runs: every readout (rich on a terminal), the arms' tuned configs
    when they came from `--from-tune`, and (when `publish`, i.e. this submission has a parent run) the same
    result put on that parent run for the dashboard. `readout`: the one `publish_result` already published
    (then it is printed, and `publish` only says where it is)."""
    stream = stream or sys.stdout
    published, readout = readout is not None, readout or gather(study, runs, workspace, tracker.uri, write_cache=True)
    style: Style = "rich" if stream.isatty() else "plain"
    readout.print(stream, style)
    tuned = [f"{a.name}: " + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in a.tuned)
             for a in study.arms if a.tuned]
    if tuned:
        stream.write("arms at their tuned configs: " + "; ".join(tuned) + "\n")
    if publish:
        if not published:
            publish_study_result(readout, tracker)
        stream.write(f"{study.name}: paired table, plots and report.html are on the submission's MLflow run "
                     "(`reslab dashboard`)\n")
