"""The summary metrics of a run: the one registry that training, the study spec and results share.

`models.training.train` reports exactly these keys at the end of a run; a study's comparison may
name any of them (`experiments.spec`); `results.collect` tabulates them. Pure Python, no torch,
so results and the spec can import it without importing the model code.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Direction = Literal["minimize", "maximize"]


@dataclass(frozen=True)
class Metric:
    name: str
    direction: Direction  # which way is better
    unit: str
    fmt: str  # a format spec for one value, e.g. ".4f"
    description: str


METRICS: dict[str, Metric] = {m.name: m for m in (
    Metric("val_loss_tail", "minimize", "nats/token", ".4f",
           "the mean held-out loss of the run's last train.tail_k evals (default 1: the final eval alone)"),
    Metric("val_loss", "minimize", "nats/token", ".4f", "held-out loss at the last eval"),
    Metric("train_loss", "minimize", "nats/token", ".4f", "training loss at the last log step"),
    Metric("tokens_per_s", "maximize", "tokens/s", ".0f", "training throughput of this run's steps"),
    Metric("peak_mem_mb", "minimize", "MiB", ".0f", "peak accelerator (or process) memory"),
    Metric("train_time_s", "minimize", "s", ".1f", "time in training steps, evals excluded"),
    Metric("wall_time_s", "minimize", "s", ".1f", "wall time of the whole run"),
    Metric("params_total", "minimize", "parameters", ".0f", "every trainable parameter"),
    Metric("params_residual", "minimize", "parameters", ".0f", "the residual pathway's own parameters"),
    Metric("tokens", "maximize", "tokens", ".0f", "tokens trained on (steps x batch x sequence)"),
)}

SUMMARY_METRICS: tuple[str, ...] = tuple(METRICS)
