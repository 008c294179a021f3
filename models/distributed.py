"""One run trained by N data-parallel ranks with the maths of one rank (issue 25, the model side).

A step trains the global batch of `B = optim.batch_size * optim.grad_accum` samples, global
sample indices `[s * B, (s + 1) * B)` at step s, whatever the world size N. Rank r takes the
contiguous slice `[s * B + r * B / N, s * B + (r + 1) * B / N)` as `rank_batches` equal
micro-batches, divides each micro-batch's objective by its micro-batch count, and DDP (or FSDP's
reduce-scatter) averages the gradients over the ranks: every micro-batch holds as many samples and
tokens as every other, so the gradient is the mean over the B samples' tokens, as on one rank, up
to the order of float sums. The reported train loss and the validation loss are all-reduced, so
every rank sees the value one rank would, and the divergence rule fires on all ranks together.
(An auxiliary loss computed per micro-batch, such as a load-balancing term, depends on the
micro-batch size, which drops below `optim.batch_size` once `B / N < batch_size`.)

Checkpoints are `torch.distributed.checkpoint` (DCP) directories, so a checkpoint written at N
ranks, DDP or FSDP, loads at M:

    run_dir/checkpoint.dcp/step-000123/
        .metadata, __<rank>_<i>.distcp   model and optimizer state (`get_state_dict`), DCP's files
        progress.json                    step, config, history, log window, segments, initial loss,
                                         strikes, result and RNG state, written by rank 0
        COMMITTED                        written last, by rank 0, through the `commit` fence

A step directory without `COMMITTED` is never loaded: resume takes the newest committed one, and
rank 0 removes every other entry once a newer checkpoint is committed. Every rank must read and
write the same `run_dir` (a shared filesystem across nodes).
"""

from __future__ import annotations

import base64
import contextlib
import copy
import json
import pickle
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn

from reslab.common.io import write_atomic
from reslab.models.config import ConfigError

DCP_DIR = "checkpoint.dcp"
COMMITTED = "COMMITTED"
PROGRESS = "progress.json"
RNG_KEYS = ("rng_cpu", "rng_cuda")
STEP_RE = re.compile(r"step-\d+")
Commit = Callable[[Callable[[], None]], None]


@dataclass(frozen=True)
class Parallel:
    """This process's place in a data-parallel run: `world` ranks, this one `rank`, the model
    replicated (`ddp`) or sharded (`fsdp`, FSDP2's `fully_shard` per sublayer, then the root)."""

    world: int
    rank: int
    sharding: Literal["ddp", "fsdp"] = "ddp"

    def __post_init__(self) -> None:
        if self.sharding not in ("ddp", "fsdp"):
            raise ValueError(f"sharding must be 'ddp' or 'fsdp', got {self.sharding!r}")
        if not 0 <= self.rank < self.world:
            raise ValueError(f"rank {self.rank} is outside a world of {self.world}")

    @classmethod
    def from_process_group(cls, sharding: Literal["ddp", "fsdp"] = "ddp") -> Parallel:
        """The rank and world size of the initialised default process group."""
        return cls(world=dist.get_world_size(), rank=dist.get_rank(), sharding=sharding)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def check_group(self) -> None:
        """Refuse to train without a default process group of this world size."""
        if not dist.is_initialized() or dist.get_world_size() != self.world or dist.get_rank() != self.rank:
            found = f"rank {dist.get_rank()} of {dist.get_world_size()}" if dist.is_initialized() else "none"
            raise RuntimeError(f"{self} needs an initialised default process group of that rank and size; "
                               f"found {found} (torch.distributed.init_process_group)")


def rank_batches(global_batch: int, batch_size: int, world: int) -> tuple[int, int]:
    """(micro-batches per rank per step, micro-batch size) for `world` ranks sharing `global_batch`
    samples: the fewest equal micro-batches of at most `batch_size` samples (the memory bound)."""
    if global_batch % world:
        allowed = [n for n in range(1, global_batch + 1) if global_batch % n == 0]
        raise ConfigError(
            f"world size {world}: the global batch optim.batch_size * optim.grad_accum = {global_batch} samples "
            f"cannot be split evenly over {world} ranks; allowed world sizes: {', '.join(map(str, allowed))}"
        )
    share = global_batch // world
    count = -(-share // batch_size)
    while share % count:
        count += 1
    return count, share // count


def rank_sample_ranges(step: int, global_batch: int, world: int, rank: int, micro_batches: int) -> list[range]:
    """The global sample indices `rank` trains at `step`, one range per micro-batch, in order."""
    share = global_batch // world
    first, size = step * global_batch + rank * share, share // micro_batches
    return [range(first + i * size, first + (i + 1) * size) for i in range(micro_batches)]


def rank_device(device: torch.device) -> torch.device:
    """A CUDA device without an index is this rank's current one (Ray Train sets it per worker)."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def wrap_model(model: nn.Module, parallel: Parallel, device: torch.device,
               keep_replica: bool = False) -> tuple[nn.Module, nn.Module | None]:
    """(the module to train through, an unsharded copy or None): DDP around `model`, or `model`
    sharded in place by FSDP2, with a copy kept first when `keep_replica` (rank 0's diagnostics
    read the whole model). Build the optimizer after this: FSDP replaces the parameters."""
    parallel.check_group()
    if parallel.sharding == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        ids = [device.index] if device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=ids), None
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    replica = copy.deepcopy(model) if keep_replica else None
    mesh = init_device_mesh(device.type, (parallel.world,))
    for sublayer in model.sublayers:  # type: ignore[union-attr]
        fully_shard(sublayer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, replica


def grad_sync(wrapped: nn.Module, parallel: Parallel, last: bool) -> contextlib.AbstractContextManager:
    """Reduce gradients over the ranks only in the last micro-batch's backward."""
    if parallel.sharding == "fsdp":
        wrapped.set_requires_gradient_sync(last)  # type: ignore[operator]
        return contextlib.nullcontext()
    return contextlib.nullcontext() if last else wrapped.no_sync()  # type: ignore[operator]


def mean_over_ranks(value: float, device: torch.device) -> float:
    """The mean of `value` over the ranks, the same float on every rank."""
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return t.item() / dist.get_world_size()


def total_norm(norm: torch.Tensor) -> float:
    """`clip_grad_norm_`'s result as a float; under FSDP a DTensor to reduce over the ranks."""
    full = getattr(norm, "full_tensor", None)
    return float(full() if full is not None else norm)


@torch.no_grad()
def evaluate_split(model: nn.Module, batches, parallel: Parallel, device: torch.device, autocast) -> float:
    """`training.evaluate` with rank r scoring batches r, r + N, ...: the row-weighted loss sums
    are all-reduced in float64, so every rank returns the 1-rank value up to summation order.
    Under FSDP every forward is a collective, so a rank without a batch in a round runs one it
    discards."""
    model.eval()
    sums = torch.zeros(2, dtype=torch.float64, device=device)  # [loss * rows, rows]
    for first in range(0, len(batches), parallel.world):
        k = first + parallel.rank
        if k >= len(batches) and parallel.sharding == "ddp":
            continue
        x, y = batches[k if k < len(batches) else 0]
        with autocast():
            loss = model(x.to(device), y.to(device)).loss.item()
        if k < len(batches):
            sums += torch.tensor([loss * len(x), len(x)], dtype=torch.float64, device=device)
    model.train()
    dist.all_reduce(sums)
    return (sums[0] / sums[1]).item()


def computed_on_main(fn: Callable[[nn.Module], Any], model: nn.Module, replica: nn.Module | None,
                     parallel: Parallel) -> Any:
    """`fn(whole model)` computed on rank 0 and broadcast to every rank. Under FSDP the full
    weights are gathered (a collective) into rank 0's `replica` first; under DDP `model` is whole."""
    if parallel.sharding == "fsdp":
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if parallel.is_main:
            if replica is None:
                raise RuntimeError("computed_on_main under FSDP needs rank 0's replica (wrap_model keep_replica)")
            replica.load_state_dict(full)
            model = replica
    box = [fn(model) if parallel.is_main else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _portable(exc: BaseException) -> BaseException:
    """`exc` if it survives pickling unchanged in type and message, else a RuntimeError saying what it was."""
    try:
        back = pickle.loads(pickle.dumps(exc))
        if type(back) is type(exc) and str(back) == str(exc):
            return exc
    except Exception:  # noqa: S110 - any pickling failure means: send a description instead
        pass
    return RuntimeError(f"rank 0 raised {type(exc).__name__}: {exc}")


def raise_from_main(fn: Callable[[], None], parallel: Parallel) -> None:
    """Run `fn` on rank 0 only and raise what it raised on every rank (rank 0 the original), so
    the ranks stop together instead of deadlocking in the next collective."""
    caught: BaseException | None = None
    if parallel.is_main:
        try:
            fn()
        except BaseException as exc:
            caught = exc
    box: list[BaseException | None] = [_portable(caught) if caught is not None else None]
    dist.broadcast_object_list(box, src=0)
    if parallel.is_main and caught is not None:
        raise caught
    if box[0] is not None:
        raise box[0]


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
    dist.barrier()
    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=path)
    if parallel.is_main:
        write_atomic(path / PROGRESS, _encode(progress))
    dist.barrier()

    def mark() -> None:
        write_atomic(path / COMMITTED, f"{progress['step']}\n")

    raise_from_main(lambda: mark() if commit is None else commit(mark), parallel)
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
