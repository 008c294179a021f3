"""A simulated trainer for measuring the driver at scale (bench only; `bench/bench_driver_scale.py`).

`$RESLAB_SIMULATE` selects it in the worker (`orchestrator.attempt.worker.execute_run`), e.g.

    RESLAB_SIMULATE="sleep=1,report_every=0.1,metrics=20,eval_every=5,checkpoint_every=5,ckpt_bytes=0"

A run then trains nothing: it sleeps `sleep` seconds in all and reports `metrics` synthetic metrics every
`report_every` seconds (one train log per report; an eval every `eval_every` reports and at the end; a
checkpoint every `checkpoint_every` reports, 0 for none before the end, of `ckpt_bytes` bytes), through the
same callback `train` calls (`hooks.Recorder`: metrics.jsonl, the driver's events, each checkpoint pushed to
run storage), the same lease fence, `summary.json`, status and MLflow path as a real run. Its checkpoint is
`checkpoint.pt` holding a JSON record (not torch's), so storage and resumes treat it like a real one.

A run on N ranks (`--gpus-per-run N`) is simulated in its own task, no ranks started, while the driver counts its
N GPUs. Never used by a study by accident: the simulation applies only to a study whose name starts with
`SIMULATED_PREFIX`; with `$RESLAB_SIMULATE` set, a run of any other study fails (a `ConfigError`, not
retried) instead of training, and without it a `simulated-*` study trains for real. A simulated run says
so: `info["simulated"]` (the spec), which the driver writes as the MLflow tag `reslab.simulated`.
"""

from __future__ import annotations

import json
import math
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from reslab.common.errors import ConfigError
from reslab.common.io import write_atomic

if TYPE_CHECKING:
    from reslab.orchestrator.tasks import RunTask

SIMULATE_ENV = "RESLAB_SIMULATE"
SIMULATED_PREFIX = "simulated-"
CHECKPOINT = "checkpoint.pt"  # `models.checkpoint.CHECKPOINT_NAME`, not imported: that module imports torch
# the train and eval metrics a real run logs, first among the synthetic ones
_TRAIN_KEYS = ("train_loss", "lr", "grad_norm", "tokens_per_s")
_EVAL_KEYS = ("val_loss", "val_loss_tail")


@dataclass
class TrainResult:
    """`models.training.TrainResult`'s fields, without importing torch (a simulated run's worker never does)."""

    summary: dict[str, float]
    history: dict[str, list[dict[str, float]]]
    info: dict[str, Any]


@dataclass(frozen=True)
class Simulation:
    """What `$RESLAB_SIMULATE` asks for (module doc)."""

    sleep: float = 1.0
    report_every: float = 0.1
    metrics: int = 4
    eval_every: int = 0  # reports between evals; 0: one eval, at the end
    checkpoint_every: int = 0  # reports between checkpoints; 0: only the final one
    ckpt_bytes: int = 0

    @property
    def reports(self) -> int:
        return max(1, round(self.sleep / self.report_every))

    def text(self) -> str:
        return ",".join(f"{k}={getattr(self, k):g}" for k in self.__dataclass_fields__)


def parse_simulation(text: str) -> Simulation:
    """`$RESLAB_SIMULATE`'s `key=value,...` as a `Simulation`; a `ConfigError` naming the bad part."""
    fields: dict[str, float] = {}
    allowed = ", ".join(Simulation.__dataclass_fields__)
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = part.partition("=")
        if not sep or key not in Simulation.__dataclass_fields__:
            raise ConfigError(f"${SIMULATE_ENV}: {part!r} is not key=value with a known key; allowed keys: {allowed}")
        try:
            number = float(value)
        except ValueError:
            raise ConfigError(f"${SIMULATE_ENV}: {key}={value!r} is not a number; allowed: a number >= 0") from None
        if not (math.isfinite(number) and number >= 0) or (key == "report_every" and number <= 0):
            raise ConfigError(f"${SIMULATE_ENV}: {key}={value} is not allowed; allowed: a finite number "
                              + ("> 0" if key == "report_every" else ">= 0"))
        fields[key] = number
    counts = ("metrics", "eval_every", "checkpoint_every", "ckpt_bytes")
    values: dict[str, Any] = {k: int(v) if k in counts else v for k, v in fields.items()}
    return Simulation(**values)


class SimulatedTrain:
    """The worker's train function under `$RESLAB_SIMULATE` (`train`'s signature). A run on N ranks runs it in its
    own task too, instead of starting ranks: the driver still counts the run's N GPUs, nothing trains."""

    def __init__(self, task: RunTask, text: str) -> None:
        self.run_id, self.study, self.text = task.run_id, task.run.study, text

    def __call__(self, cfg: Any, run_dir: str | Path | None = None, **kwargs: Any) -> TrainResult:
        sim = check_simulation(self.study, self.text)
        return simulate(sim, self.run_id, Path(run_dir) if run_dir is not None else None, **kwargs)


def check_simulation(study: str, text: str) -> Simulation:
    """The simulation `text` asks for, for a study named `study`: a `ConfigError` unless the study is a
    simulation (`simulated-*`) and `text` parses. The driver checks it before dispatch, the worker again."""
    if not study.startswith(SIMULATED_PREFIX):
        raise ConfigError(f"${SIMULATE_ENV} is set but study {study!r} is not a simulation (its name must "
                          f"start with {SIMULATED_PREFIX!r}); unset ${SIMULATE_ENV} to train it")
    return parse_simulation(text)


def simulated_train_fn(task: RunTask) -> SimulatedTrain | None:
    """The worker's train function for `task` under `$RESLAB_SIMULATE`; None when it is unset. A run of a study
    not named `simulated-*` gets one that fails with a `ConfigError` (module doc)."""
    text = os.environ.get(SIMULATE_ENV)
    return SimulatedTrain(task, text) if text else None


def _read_step(run_dir: Path | None) -> tuple[int, dict[str, Any] | None]:
    """The step and result of the run's simulated checkpoint (0, None without one)."""
    path = run_dir / CHECKPOINT if run_dir is not None else None
    if path is None or not path.is_file():
        return 0, None
    try:
        state = json.loads(path.read_bytes().split(b"\n", 1)[0])
    except ValueError:
        raise ConfigError(f"{path}: not a simulated checkpoint; move the run directory away to simulate it") from None
    return int(state["step"]), state.get("result")


def _save(run_dir: Path | None, step: int, size: int, commit: Any, result: dict[str, Any] | None = None) -> Path | None:
    if run_dir is None:
        return None
    path, tmp = run_dir / CHECKPOINT, run_dir / (CHECKPOINT + ".tmp")
    head = json.dumps({"simulated": True, "step": step, "result": result}).encode() + b"\n"
    write_atomic(tmp, head + os.urandom(size))  # random bytes: storage cannot compress them
    if commit is not None:
        commit(lambda: os.replace(tmp, path))
    else:
        os.replace(tmp, path)
    return path


def simulate(sim: Simulation, run_id: str, run_dir: Path | None, *, resume: bool = True, **hooks: Any) -> TrainResult:
    """`models.training.train`'s contract, simulated: its hooks (`callback`, `on_step`, `log`, `commit`; the others
    ignored), checkpoints, resume from the run's checkpoint (a finished one returns its stored result)."""
    callback, on_step, log, commit = (hooks.get(k) for k in ("callback", "on_step", "log", "commit"))
    start, stored = _read_step(run_dir) if resume else (0, None)
    if stored is not None:
        return TrainResult(summary=stored["summary"], history={"train": [], "eval": []}, info=stored["info"])
    rng = random.Random(f"{run_id}:{start}")
    info: dict[str, Any] = {"start_step": start, "simulated": sim.text()}
    if callback is not None:
        callback.on_start(info)
    history: dict[str, list[dict[str, float]]] = {"train": [], "eval": []}
    wall, loss = time.perf_counter(), 5.0 + rng.random()
    next_at = time.monotonic()
    for done in range(start + 1, sim.reports + 1):
        next_at += sim.report_every
        time.sleep(max(0.0, next_at - time.monotonic()))
        loss *= 0.99
        values = [loss, 1e-3, 1.0 + rng.random(), 1e4, *(rng.random() for _ in range(sim.metrics))]
        keys = [*_TRAIN_KEYS, *(f"sim/m{i}" for i in range(sim.metrics))]
        metrics = dict(zip(keys[:max(sim.metrics, 1)], values, strict=False))  # the first `metrics` of them
        history["train"].append({"step": done, **metrics})
        if callback is not None:
            callback.on_log(done, metrics)
        if (sim.eval_every and done % sim.eval_every == 0) or done == sim.reports:
            evals = {"val_loss": loss + 0.1, "val_loss_tail": loss + 0.1}
            history["eval"].append({"step": done, **evals})
            if callback is not None:
                callback.on_eval(done, evals, {})
        if sim.checkpoint_every and done % sim.checkpoint_every == 0 and done != sim.reports:
            path = _save(run_dir, done, sim.ckpt_bytes, commit)
            if callback is not None and path is not None:
                callback.on_checkpoint(done, path)
        if on_step is not None:
            on_step(done)
    seconds = time.perf_counter() - wall
    summary = {"val_loss": loss + 0.1, "val_loss_tail": loss + 0.1, "train_loss": loss, "train_time_s": seconds,
               "wall_time_s": seconds, "tokens_per_s": 1e4, "tokens": float(sim.reports * 1000)}
    info["segments"] = [{"start_step": start, "end_step": sim.reports, "train_time_s": seconds, "wall_time_s": seconds}]
    path = _save(run_dir, sim.reports, sim.ckpt_bytes, commit, {"summary": summary, "info": info})
    if callback is not None and path is not None:
        callback.on_checkpoint(sim.reports, path)
    if log is not None:
        log(f"done: simulated {sim.reports} reports in {seconds:.1f}s ({sim.text()})")
    return TrainResult(summary=summary, history=history, info=info)
