"""A workspace of N finished runs, built cheaply (issue 39): the records `reslab compare`, `status`, `report`
and `plan` read, written directly, for timing the readouts at 10^4-10^6 runs without training any.

    python bench/make_scale_workspace.py DIR [--runs 100000] [--points 50] [--no-params] [--no-diagnostics]

writes `DIR/scale<N>.yaml` (2 arms, prenorm and attnres, x `--points` values of `optim.lr` x N / (2 x points)
seeds, the tiny preset, one exploratory comparison) and the workspace `DIR/ws` as `reslab run` leaves it
after every run succeeded:

- each run's directory (`orchestrator.durability.workspace.RunDir`): `spec.json` (`RunSpec.to_dict`), a
  SUCCESS `status`, `summary.json` (every training summary metric), `metrics.jsonl` (4 train rows and
  2 evals) and `diagnostics.jsonl`: the one a real run of its arm wrote (`real_diagnostics`: the arm's first
  run trained once, 40 steps of the tiny preset: 2 rows of routing, effective depth and magnitudes, ~2.6 KB
  for prenorm, ~9.5 KB for attnres; `--no-diagnostics` leaves the file out);
- the workspace's MLflow SQLite store, its schema made by MLflow (`tracking.client.StoreClient`, as the
  driver opens it) and the study's experiment by the driver's own call; then one submission parent and one
  FINISHED child per run inserted in bulk with the tags the writer sets (`tracking.writer.run_tags`, the
  summary tags, `state`, `mlflow.runName`, `mlflow.parentRunId`), the params it logs (`config_params`:
  the flattened config, ~70 per run; `--no-params` leaves them out) and each run's last train and eval
  metrics (`metrics` and `latest_metrics`; the writer logs every step, which the readouts never read).

Values: val_loss = 3.0 - 0.1 x lr index / points - 0.02 for attnres + N(0, 0.05) per seed and arm,
seeded, so the comparison has an effect to find. `build(directory, runs, points)` returns (spec path,
workspace path) for other benches (`bench_driver_scale.py`).
"""

from __future__ import annotations

import argparse
import json
import sqlite3
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np

STUDY = """
study: scale{runs}
base:
  model: {{preset: tiny}}
  optim: {{batch_size: 4, warmup_steps: 2}}
  train: {{steps: 40, eval_every: 20, eval_windows: 8}}
arms:
  control: prenorm
  attnres: {{residual: attnres}}
seeds: {seeds}
limits: {{max_runs: 1000000}}
grid:
  optim.lr: [{lrs}]
comparisons:
  - {{control: control, exploratory: true}}
"""


def write_spec(directory: Path, runs: int, points: int) -> Path:
    seeds = runs // (2 * points)
    if seeds < 1 or seeds * 2 * points != runs:
        raise SystemExit(f"--runs {runs}: must be a multiple of 2 x --points ({2 * points})")
    path = directory / f"scale{runs}.yaml"
    lrs = ", ".join(f"{1e-3 * (i + 1):.4g}" for i in range(points))
    path.write_text(STUDY.format(runs=runs, seeds=seeds, lrs=lrs))
    return path


def _summary(val: float, rng: np.random.Generator) -> dict[str, float]:
    from reslab.common.metrics import SUMMARY_METRICS

    out = {name: float(rng.uniform(1, 2)) for name in SUMMARY_METRICS}
    out.update(val_loss=val, val_loss_tail=val + 0.01, train_loss=val - 0.05, tokens=40 * 4 * 64.0)
    return out


def real_diagnostics(study: Any) -> dict[str, bytes]:
    """arm -> the `diagnostics.jsonl` its first run writes, each arm's first run trained once (seconds)."""
    import tempfile

    from reslab.experiments.expand import iter_runs
    from reslab.models.training import train
    from reslab.orchestrator.attempt.hooks import dumps_row

    class Rows:  # the diagnostics rows the worker's recorder writes (`orchestrator.attempt.hooks.Recorder`)
        def __init__(self) -> None:
            self.text = ""

        def on_eval(self, step: int, metrics: dict, diagnostics: dict) -> None:
            if diagnostics:
                self.text += dumps_row({"step": step, **diagnostics})

        def on_start(self, *_: Any) -> None: ...
        def on_log(self, *_: Any) -> None: ...
        def on_checkpoint(self, *_: Any) -> None: ...

    out: dict[str, bytes] = {}
    for run in iter_runs(study):
        if run.arm not in out:
            rows = Rows()
            with tempfile.TemporaryDirectory() as tmp:
                train(run.config, run_dir=tmp, callback=rows, log=lambda *_: None)
            out[run.arm] = rows.text.encode()
        if len(out) == len(study.arms):
            return out
    return out


def add_diagnostics(spec: Path, workspace_root: Path) -> None:
    """Write each run's `diagnostics.jsonl` (`real_diagnostics`) into an existing workspace of `build`."""
    from reslab.experiments import load_study
    from reslab.experiments.expand import iter_runs

    study = load_study(spec)
    files = real_diagnostics(study)
    for run in iter_runs(study):
        (workspace_root / "runs" / study.name / run.run_id / "diagnostics.jsonl").write_bytes(files[run.arm])


def _run_dir(path: Path, run: Any, summary: dict[str, float], now: float) -> None:
    path.mkdir(parents=True)
    (path / "spec.json").write_text(json.dumps(run.to_dict()))
    (path / "status").write_text(json.dumps({"state": "SUCCESS", "checkpoint_step": 40, "host": "bench",
                                              "updated": now}))
    (path / "summary.json").write_text(json.dumps({"summary": summary, "info": {}}))
    rows = [{"kind": "train", "step": s, "train_loss": summary["train_loss"] + (40 - s) / 100, "time": now + s}
            for s in (10, 20, 30, 40)]
    rows += [{"kind": "eval", "step": s, "val_loss": summary["val_loss"] + (40 - s) / 100, "time": now + s}
             for s in (20, 40)]
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def build(directory: Path, runs: int, points: int = 50, params: bool = True, diagnostics: bool = True
          ) -> tuple[Path, Path]:
    """The study file and its workspace of `runs` finished runs (module docstring)."""
    from reslab.experiments import load_study
    from reslab.experiments.expand import iter_runs
    from reslab.orchestrator.attempt.envinfo import submission_code
    from reslab.orchestrator.durability.workspace import Workspace
    from reslab.orchestrator.tracking.client import StoreClient
    from reslab.orchestrator.tracking.layout import KIND_SUBMISSION, SUMMARY_TAG
    from reslab.orchestrator.tracking.writer import config_params, run_tags

    directory.mkdir(parents=True, exist_ok=True)
    spec = write_spec(directory, runs, points)
    study = load_study(spec)
    workspace = Workspace(directory / "ws")
    store = StoreClient(workspace.default_tracking_uri(), workspace)
    experiment = int(store.experiment(study.name))
    code = submission_code()
    rng = np.random.default_rng(0)
    now = time.time()
    ms = int(now * 1000)
    db = sqlite3.connect(workspace.mlflow_db)
    parent = uuid.uuid4().hex
    db.execute("INSERT INTO runs VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
               (parent, "submission bench", "LOCAL", "", "", "bench", "FINISHED", ms, ms + 1, "", "active",
                f"{workspace.artifacts.as_uri()}/{parent}", experiment, None))
    db.executemany("INSERT INTO tags VALUES (?,?,?)",
                   [("reslab_kind", KIND_SUBMISSION, parent), ("study", study.name, parent)])
    lr_index = {f"optim.lr={v}": i for i, v in enumerate(study.grid[0].values)}
    batch: dict[str, list[tuple]] = {"runs": [], "tags": [], "params": [], "metrics": [], "latest_metrics": []}
    for n, run in enumerate(iter_runs(study)):
        val = 3.0 - 0.1 * lr_index.get(run.grid_key, 0) / points - (0.02 if run.arm == "attnres" else 0.0) \
            + float(rng.normal(0, 0.05))
        summary = _summary(val, rng)
        _run_dir(workspace.run_dir(study.name, run.run_id).path, run, summary, now)
        mid = uuid.uuid4().hex
        batch["runs"].append((mid, run.label, "LOCAL", "", "", "bench", "FINISHED", ms + n, ms + n + 60_000, "",
                              "active", f"{workspace.artifacts.as_uri()}/{mid}", experiment, None))
        tags = {**run_tags(run, code), **{f"{SUMMARY_TAG}{k}": repr(v) for k, v in summary.items()},
                "state": "SUCCESS", "error": "", "mlflow.runName": run.label, "mlflow.parentRunId": parent}
        batch["tags"] += [(k, v, mid) for k, v in tags.items()]
        if params:
            batch["params"] += [(k, str(v)[:6000], mid) for k, v in config_params(run).items()]
        for key, value in (("train_loss", summary["train_loss"]), ("val_loss", summary["val_loss"])):
            batch["metrics"].append((key, value, ms + n, mid, 40, 0))
            batch["latest_metrics"].append((key, value, ms + n, 40, 0, mid))
        if len(batch["runs"]) >= 5000:
            _flush(db, batch)
    _flush(db, batch)
    db.close()
    if diagnostics:
        add_diagnostics(spec, workspace.root)
    return spec, workspace.root


def _flush(db: sqlite3.Connection, batch: dict[str, list[tuple]]) -> None:
    for table, rows in batch.items():
        if rows:
            db.executemany(f"INSERT INTO {table} VALUES ({','.join('?' * len(rows[0]))})", rows)
        rows.clear()
    db.commit()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory", type=Path)
    parser.add_argument("--runs", type=int, default=100_000)
    parser.add_argument("--points", type=int, default=50, help="values of the grid axis optim.lr")
    parser.add_argument("--no-params", action="store_true", help="leave the children's params out of MLflow")
    parser.add_argument("--no-diagnostics", action="store_true", help="no diagnostics.jsonl in the run folders")
    parser.add_argument("--add-diagnostics", action="store_true",
                        help="only write the diagnostics into DIR's existing workspace of --runs runs")
    args = parser.parse_args()
    start = time.perf_counter()
    if args.add_diagnostics:
        spec = args.directory / f"scale{args.runs}.yaml"
        if not spec.is_file() or not (args.directory / "ws").is_dir():
            parser.error(f"--add-diagnostics: no workspace of {args.runs} runs in {args.directory} (no {spec.name} "
                         "or ws/); build it first without --add-diagnostics")
        add_diagnostics(spec, args.directory / "ws")
        print(f"diagnostics written in {time.perf_counter() - start:.0f}s")
        return 0
    spec, ws = build(args.directory, args.runs, args.points, params=not args.no_params,
                     diagnostics=not args.no_diagnostics)
    print(f"{spec} and workspace {ws}: {args.runs:,} finished runs in {time.perf_counter() - start:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
