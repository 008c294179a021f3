"""What a run's checkpoint carries besides the weights and the optimizer (`RunProgress`), written into the
checkpoint's state (`checkpoint_state`) and read back with the RNG (`restore_progress`); the layout (pt or
DCP) is `models.checkpoint.Checkpointer`'s."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from reslab.models.checkpoint import Checkpointer


def empty_window() -> dict[str, float]:
    return {"loss": 0.0, "steps": 0, "time": 0.0}


@dataclass
class RunProgress:
    """What a checkpoint carries besides the weights, the optimizer and the RNG: the step the run
    resumes from (`start_step`), the curve so far (`history`), the open train-loss log `window` (a
    mean over the steps since the last log line, kept whole across a resume), the `segments`
    earlier processes trained, the divergence rule's `initial_loss` and `strikes`, and the stored
    result (`finished`) of a run that ended."""

    start_step: int = 0
    history: dict[str, list[dict[str, float]]] = field(default_factory=lambda: {"train": [], "eval": []})
    window: dict[str, float] = field(default_factory=empty_window)
    segments: list[dict[str, Any]] = field(default_factory=list)
    initial_loss: float | None = None
    strikes: int = 0
    finished: dict[str, Any] | None = None


def restore_progress(checkpointer: Checkpointer, model: nn.Module, optimizer: torch.optim.Optimizer,
                     device: torch.device, config_json: str) -> RunProgress:
    """Load the checkpoint into the model, optimizer and RNG; return the progress it carries.
    A data-parallel run's world size and sharding may differ from the checkpoint's."""
    ckpt = checkpointer.restore(model, optimizer, device, config_json)
    torch.set_rng_state(ckpt["rng_cpu"])
    if device.type == "cuda" and "rng_cuda" in ckpt:
        torch.cuda.set_rng_state(ckpt["rng_cuda"])
    return RunProgress(
        start_step=ckpt["step"],
        history=json.loads(ckpt["history"]),
        window=json.loads(ckpt["log_window"]),
        segments=json.loads(ckpt.get("segments", "[]")),
        initial_loss=ckpt.get("initial_loss"),
        strikes=int(ckpt.get("strikes", 0)),
        finished=json.loads(ckpt["result"]) if "result" in ckpt else None,
    )


def checkpoint_state(step: int, progress: RunProgress, config_json: str, device: torch.device,
                     segments: list[dict[str, Any]], result: dict[str, Any] | None = None) -> dict[str, Any]:
    """The checkpoint's state at `step` besides the weights and the optimizer: the progress, the RNG, the config,
    the `segments` trained so far and, at the run's end, its `result`."""
    state: dict[str, Any] = {
        "step": step, "rng_cpu": torch.get_rng_state(), "config": config_json,
        "history": json.dumps(progress.history), "log_window": json.dumps(progress.window),
        "segments": json.dumps(segments), "strikes": progress.strikes,
    }
    if progress.initial_loss is not None:
        state["initial_loss"] = progress.initial_loss
    if result is not None:
        state["result"] = json.dumps(result)
    if device.type == "cuda":
        state["rng_cuda"] = torch.cuda.get_rng_state()
    return state
