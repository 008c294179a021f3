"""A run's checkpoints: one component (`Checkpointer`) that picks its layout once, from the run's `Parallel`.

One process (`distributed.ONE_PROCESS`) writes `run_dir/checkpoint.pt`: one `torch.save` of whole
tensors, the optimizer's state keyed by parameter index, renamed into place through `commit`. Ranks
sharing a process group write `torch.distributed.checkpoint` (DCP) directories, so a checkpoint
written at N ranks, DDP or FSDP, loads at M:

    run_dir/checkpoint.dcp/step-000123/
        .metadata, __<rank>_<i>.distcp   model and optimizer state (`get_state_dict`), DCP's files
        progress.json                    step, config, history, log window, segments, initial loss,
                                         strikes, result and RNG state, written by rank 0
        COMMITTED                        written last, by rank 0, through the `commit` fence

A step directory without `COMMITTED` is never loaded: rank 0 removes every other entry once a newer
checkpoint is committed. Every rank must read and write the same `run_dir` (a shared filesystem
across nodes).

Either layout resumes from the newer of the two (`newer_checkpoint`: `checkpoint.pt` against the
newest committed DCP step, by step; rank 0 decides for every rank), so a run moves between one
process and N ranks: `checkpoint.pt`'s whole tensors are sharded as they load (`load_full`), and a
DCP step loads into one process's model as well as into ranks'.
"""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from reslab.common.errors import RunFailed
from reslab.common.io import write_atomic
from reslab.models.distributed import Parallel
from reslab.models.optim import same_config

CHECKPOINT_NAME = "checkpoint.pt"
DCP_DIR = "checkpoint.dcp"
COMMITTED = "COMMITTED"
PROGRESS = "progress.json"
RNG_KEYS = ("rng_cpu", "rng_cuda")
STEP_RE = re.compile(r"step-\d+")
Commit = Callable[[Callable[[], None]], None]


class CheckpointUnreadable(RunFailed):
    """A checkpoint file exists but cannot be loaded; retrying would fail the same way."""


class Checkpointer:
    """One run's checkpoints under `run_dir` (none without one), in the layout `parallel` fixes here
    and nowhere else: `checkpoint.pt` for one process, `checkpoint.dcp` for ranks (module docstring).

    `resume_from` is the checkpoint to resume (unless `resume` is False): the newer of the two
    layouts, the same one on every rank. `commit(rename)` performs each checkpoint's final rename or
    `COMMITTED` marker (the worker's lease fence)."""

    def __init__(self, run_dir: str | Path | None, parallel: Parallel, *, resume: bool = True,
                 commit: Commit | None = None) -> None:
        self.parallel, self.commit = parallel, commit
        self.sharded = parallel.group
        self.path = None if run_dir is None else Path(run_dir) / (DCP_DIR if self.sharded else CHECKPOINT_NAME)
        self.resume_from: Path | None = None
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        if run_dir is not None and resume:  # rank 0 decides: every rank loads the same one
            found = parallel.broadcast(str(newer_checkpoint(Path(run_dir)) or "") if parallel.is_main else None)
            self.resume_from = Path(found) if found else None

    def save(self, state: dict[str, Any], model: nn.Module, optimizer: torch.optim.Optimizer) -> Path:
        """Checkpoint `state` (the step, the progress, the RNG) with the model and optimizer under the run_dir;
        returns where it went. With ranks, every rank calls it."""
        assert self.path is not None, "a run without a run_dir has no checkpoints"
        if self.sharded:
            return save_sharded(self.path, model, optimizer, state, self.parallel, self.commit)
        _save_atomic({**state, "model": model.state_dict(), "optimizer": optimizer.state_dict()}, self.path,
                     self.commit)
        return self.path

    def restore(self, model: nn.Module, optimizer: torch.optim.Optimizer, device: torch.device,
                config_json: str) -> dict[str, Any]:
        """Load `resume_from` into the model and optimizer (either layout into this one); returns the rest it
        carries (the step, the progress, the RNG states). Refuses a checkpoint of another config."""
        path = self.resume_from
        assert path is not None
        whole = path.name == CHECKPOINT_NAME
        ckpt = load_checkpoint(path, device) if whole else read_progress(path)
        if ckpt["config"] != config_json and not same_config(json.loads(ckpt["config"]), json.loads(config_json)):
            raise RuntimeError(
                f"{path} was written by a different config; refusing to resume it. "
                "Delete the run directory or use a new one."
            )
        if not whole:
            load_sharded(path, model, optimizer)
        elif self.sharded:
            load_full(ckpt, model, optimizer)
        else:
            model.load_state_dict(ckpt["model"])
            optimizer.load_state_dict(ckpt["optimizer"])
        return ckpt


def _save_atomic(obj: dict, path: Path, commit: Commit | None = None) -> None:
    """Write a sibling, then rename it over `path`; `commit` wraps the rename (the worker's lease fence)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    torch.save(obj, tmp)
    try:
        if commit is None:
            os.replace(tmp, path)
        else:
            commit(lambda: os.replace(tmp, path))
    finally:
        tmp.unlink(missing_ok=True)


def load_checkpoint(path: Path, device: torch.device) -> dict[str, Any]:
    try:
        ckpt = torch.load(path, map_location=device, weights_only=True)
    except Exception as exc:  # torch raises many types for a damaged zip/pickle
        raise CheckpointUnreadable(
            f"{path} cannot be loaded ({type(exc).__name__}: {str(exc).splitlines()[0][:200]}); move it away "
            "to restart the run from step 0"
        ) from None
    if not isinstance(ckpt, dict) or not {"model", "optimizer", "step", "config"} <= set(ckpt):
        raise CheckpointUnreadable(f"{path} is not a reslab checkpoint; move it away to restart the run from step 0")
    return ckpt


def newer_checkpoint(run_dir: Path) -> Path | None:
    """The run's newest checkpoint of either layout: `checkpoint.pt` (one process) or the newest committed
    `checkpoint.dcp` step (ranks), by step; None without one."""
    found = committed(run_dir / DCP_DIR)
    dcp_step = int(found[-1].name.removeprefix("step-")) if found else -1
    pt = run_dir / CHECKPOINT_NAME
    try:  # the step only: mmap reads no tensor
        pt_step = int(torch.load(pt, mmap=True, weights_only=True)["step"]) if pt.exists() else -1
    except Exception:  # a damaged file: `load_checkpoint` says so when it is the one resumed
        pt_step = 0
    if max(dcp_step, pt_step) < 0:
        return None
    return pt if pt_step >= dcp_step else found[-1]


def committed(root: Path) -> list[Path]:
    """The committed step directories under `root`, oldest first."""
    if not root.is_dir():
        return []
    steps = [d for d in root.iterdir() if STEP_RE.fullmatch(d.name) and (d / COMMITTED).is_file()]
    return sorted(steps, key=lambda d: int(d.name.removeprefix("step-")))


def _encode(progress: dict[str, Any]) -> str:
    return json.dumps({k: base64.b64encode(v.numpy().tobytes()).decode() if k in RNG_KEYS else v
                       for k, v in progress.items()})


def read_progress(path: Path) -> dict[str, Any]:
    """The checkpoint's `progress.json`, with its RNG states as tensors again."""
    progress = json.loads((path / PROGRESS).read_text())
    for key in RNG_KEYS:
        if key in progress:
            progress[key] = torch.frombuffer(bytearray(base64.b64decode(progress[key])), dtype=torch.uint8)
    return progress


def save_sharded(root: Path, model: nn.Module, optimizer: torch.optim.Optimizer, progress: dict[str, Any],
                 parallel: Parallel, commit: Commit | None = None) -> Path:
    """Write the checkpoint of `progress["step"]` (every rank calls this) and commit it; returns its directory.

    DCP writes each rank's part; rank 0 writes `progress.json`, and after a barrier the
    `COMMITTED` marker through `commit` (the worker's lease fence), then removes every other entry
    of `root`. A fence that refuses raises on every rank."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    path = root / f"step-{progress['step']:06d}"
    if parallel.is_main:
        shutil.rmtree(path, ignore_errors=True)  # a leftover of an attempt that died before committing
        path.mkdir(parents=True)
    parallel.barrier()
    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=path)
    if parallel.is_main:
        write_atomic(path / PROGRESS, _encode(progress))
    parallel.barrier()

    def mark() -> None:
        write_atomic(path / COMMITTED, f"{progress['step']}\n")

    parallel.raise_from_main(lambda: mark() if commit is None else commit(mark))
    if parallel.is_main:
        for old in root.iterdir():
            if old == path:
                continue
            if old.is_dir():
                shutil.rmtree(old)
            else:
                old.unlink()
    return path


def load_sharded(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Load a checkpoint's model and optimizer state into this rank's (possibly sharded) model; without a
    process group, into one process's model (a run that moves from N ranks to one)."""
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.filterwarnings("ignore", message=".*load in a single process")
        dcp.load({"model": model_state, "optim": optim_state}, checkpoint_id=path)  # in place
    set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optim_state)


def load_full(ckpt: dict[str, Any], model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """A one-process checkpoint (`checkpoint.pt`: whole tensors, the optimizer's state keyed by parameter
    index) into this rank's possibly sharded model and optimizer (a run that moves from one process to N
    ranks): the indices become the names of the parameters the optimizer holds in that order, the form
    `set_state_dict` takes, which shards whole tensors as the model is sharded."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    names = {id(p): n for n, p in model.named_parameters()}
    order = [names[id(p)] for group in optimizer.param_groups for p in group["params"]]
    saved = ckpt["optimizer"]
    optim_state: dict[str, Any] = {"state": {order[int(i)]: s for i, s in saved["state"].items()},
                                   "param_groups": [{**g, "params": [order[int(i)] for i in g["params"]]}
                                                    for g in saved["param_groups"]]}
    set_state_dict(model, optimizer, model_state_dict=ckpt["model"], optim_state_dict=optim_state,
                   options=StateDictOptions(full_state_dict=True))
