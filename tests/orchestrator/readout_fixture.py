"""A study with every kind of result (a ladder, contrasts, a comparison at equal FLOPs, sequential seeds and
declared costs) and a workspace that holds its records without training: run directories with eval curves and
diagnostics, and the Parquet runs table `reslab run` caches. The values are synthetic and deterministic (numpy's
PCG64 from a fixed seed), so the rendered readouts are the same on every machine. The cost metrics come from
a generator of their own, so adding them left every other number as it was.

Used by `test_readout_golden.py`, which renders every readout of this study and compares it with the
files under `golden/readouts/`, written by the renderer before the readouts were redesigned.
"""

from __future__ import annotations

import base64
import json
import re
import struct
from pathlib import Path

import numpy as np

from reslab.experiments import expand, load_study
from reslab.experiments.expand import RunSpec
from reslab.experiments.spec import Study
from reslab.orchestrator.durability.workspace import Workspace
from reslab.results.collect import collect

STUDY = """\
study: golden
description: every readout on synthetic records
base:
  model: {preset: tiny, n_heads: 2, n_kv_heads: 2, seq_len: 32}
  optim: {batch_size: 4, warmup_steps: 2, lr: 3.0e-3}
  train: {eval_every: 2, log_every: 1, eval_windows: 8, tail_k: 1}
arms:
  control: prenorm
  attnres: {residual: attnres}
  block: {residual: block_attnres}
seeds: {sequential: {start: 3, batch: 2, max: 7}}
ladder:
  model.d_model: [16, 24, 32]
  model.n_layers: [2, 3, 4]
  model.ffn_hidden: [32, 48, 64]
  train.steps: [4, 6, 8]
comparisons:
  - {name: main, control: control, treatments: [attnres, block], metric: val_loss, mei: 0.02}
  - {name: per-flop, control: control, treatments: [attnres], metric: val_loss, at: flops, exploratory: true}
contrasts:
  - {name: gain, metric: val_loss, weights: {attnres: 1, control: -1}}
  - {name: block-keeps, fraction: {control: control, full: attnres, cheaper: block}}
costs: [decode_tps, decode_state_bytes]
"""
PLANNED_SEEDS = 5  # the looks at 3 and 5 seeds ran; seeds 5 and 6 were never released
GAIN = {"control": 0.0, "attnres": -0.05, "block": -0.035,
        # arms sharing a prefix, named as a user names them (test_report_layout_browser.py)
        "prenorm_adamw": 0.0, "prenorm_warmup": 0.01, "attnres_full_history": -0.05}
FAILED_RUN = ("block", 1)  # (arm, seed) at the smallest rung: a run that diverged
SPEED = {"control": 1.0, "attnres": 0.86, "block": 0.95, "prenorm_adamw": 1.0, "prenorm_warmup": 1.0,
         "attnres_full_history": 0.86}  # decode tokens/s relative to the control


def _state_bytes(arm: str, n_layers: int, d_model: int) -> float:
    """Decode state per token, float32: the KV cache, plus Full AttnRes's depth history (every sublayer's
    output) or Block AttnRes's block summaries (two blocks) and partial block."""
    extra = {"control": 0, "attnres": 2 * n_layers + 1, "block": 3, "prenorm_adamw": 0, "prenorm_warmup": 0,
             "attnres_full_history": 2 * n_layers + 1}[arm]
    return float(4 * d_model * (2 * n_layers + extra))


def _routing(n_layers: int, rng: np.random.Generator) -> dict:
    sites = []
    for site in range(2 * n_layers + 1):
        weights = rng.dirichlet(np.ones(site + 1))
        sites.append({"route": "", "site": site, "weights": [float(w) for w in weights]})
    concentration = [float(c) for c in rng.uniform(0.1, 0.9, n_layers + 1)]
    return {"n_layers": n_layers, "sites": sites, "concentration_by_layer": concentration}


def _write_run(workspace: Workspace, run: RunSpec, rng: np.random.Generator, cost_rng: np.random.Generator) -> dict:
    """The run's directory (status, eval curve, diagnostics) and its MLflow-shaped record."""
    rd = workspace.run_dir(run.study, run.run_id)
    rd.path.mkdir(parents=True)
    steps, n_layers = run.config.train.steps, run.config.model.n_layers
    size = run.config.model.d_model / 16
    final = 4.0 / size ** 0.3 + GAIN[run.arm] + rng.normal(0, 0.01)
    failed = (run.arm, run.seed) == FAILED_RUN and n_layers == 2
    rows = [{"kind": "eval", "step": step, "val_loss": float(final + 0.5 * (steps - step) / steps), "time": 1.0}
            for step in range(2, steps + 1, 2)]
    rd.metrics_file.write_text("".join(json.dumps(r) + "\n" for r in rows))
    if not run.arm.startswith(("control", "prenorm")):
        diag = {"step": steps, "routing": _routing(n_layers, rng),
                "effective_depth": {"d_eff": float(rng.uniform(1.2, 1.8)), "f_l": 2 * n_layers / (n_layers + 1)}}
        rd.diagnostics_file.write_text(json.dumps(diag) + "\n")
    rd.set_status("FAILED" if failed else "SUCCESS", **({"error": "diverged at step 3"} if failed else {}))
    summary = {"val_loss": final, "val_loss_tail": final, "train_loss": final + 0.1,
               "tokens_per_s": float(rng.uniform(900, 1100)) / size, "train_time_s": float(steps * size),
               "params_total": float(1000 * size ** 2), "tokens": float(steps * 128),
               "decode_tps": float(400 / size * SPEED[run.arm] * np.exp(cost_rng.normal(0, 0.03))),
               "decode_state_bytes": _state_bytes(run.arm, n_layers, run.config.model.d_model)}
    tags = {"run_id": run.run_id, "study": run.study, "arm": run.arm, "grid_key": run.grid_key,
            "seed": str(run.seed), "pair_key": run.pair_key, "residual": run.config.residual.name,
            "code_version": "0123abc", "results_version": "1"}
    if failed:
        tags["error"] = "diverged at step 3"
    else:
        tags.update({f"summary/{k}": repr(v) for k, v in summary.items()})
    return {"mlflow_run_id": f"mlflow-{run.run_id}", "status": "FAILED" if failed else "FINISHED", "tags": tags,
            "metrics": {}, "start_time": 1_700_000_000_000 + run.seed, "end_time": 1_700_000_100_000 + run.seed}


def build(directory: Path, study_text: str = STUDY) -> tuple[Study, list[RunSpec], Workspace]:
    """The study file, its runs (every seed of the design) and a workspace holding the planned ones.
    `study_text`: another study whose arms are among `GAIN`'s (`test_report_layout_browser.py`)."""
    spec = directory / "golden.yaml"
    spec.write_text(study_text)
    study = load_study(spec)
    runs = expand(study)
    workspace = Workspace(directory / "ws")
    workspace.root.mkdir(parents=True)
    rng, cost_rng = np.random.default_rng(20261202), np.random.default_rng(20260611)
    planned = [r for r in runs if r.seed < PLANNED_SEEDS]
    records = [_write_run(workspace, run, rng, cost_rng) for run in planned]
    collect(study.name, records, expected=planned, cache_dir=workspace.cache)
    return study, runs, workspace


def _png_size(match: re.Match[str]) -> str:
    header = base64.b64decode(match.group(1)[:44])  # the signature and the IHDR chunk: width, height at 16..24
    width, height = struct.unpack(">II", header[16:24])
    return f'src="png {width}x{height}"'


def normalized(text: str, directory: Path, runs: list[RunSpec]) -> str:
    """A rendering with the temporary directory's path and the run ids replaced (a run id hashes
    `RESULTS_VERSION`, which a change of numbers bumps; here it is `run-<n>`, n its place in the
    expansion), and each inlined PNG replaced by its size (matplotlib's pixels may differ between builds
    of its renderer; the figure's size does not)."""
    text = text.replace(str(directory), "<tmp>")
    for n, run in enumerate(runs):
        text = text.replace(run.run_id, f"run-{n}").replace(run.run_id.replace("_", r"\_"), f"run-{n}")  # LaTeX
    return re.sub(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"', _png_size, text)


def snapshot(rendered: Path, directory: Path, runs: list[RunSpec]) -> dict[str, str]:
    """Every file under `rendered` as normalized text, by its relative path; a PNG as its size."""
    out = {}
    for path in sorted(p for p in rendered.rglob("*") if p.is_file()):
        name = str(path.relative_to(rendered))
        if path.suffix == ".png":
            width, height = struct.unpack(">II", path.read_bytes()[16:24])
            out[name] = f"png {width}x{height}\n"
        else:
            out[name] = normalized(path.read_text(encoding="utf-8"), directory, runs)
    return out
