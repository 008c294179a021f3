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

A world of one is a `Parallel` too (`ONE_PROCESS`, as torchtitan's `ParallelDims`): rank 0 of 1,
no process group, and every collective (all-reduce, broadcast, barrier), the model's wrapping and
the gradient sync are identities, so the training loop never asks whether it is distributed.
Checkpoints, in either layout, are `models.checkpoint`'s.
"""

from __future__ import annotations

import contextlib
import copy
import pickle
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol, cast

import torch
import torch.distributed as dist
from torch import nn

from reslab.models.config import ConfigError

if TYPE_CHECKING:
    from reslab.models.backbone import Decoder
    from reslab.models.pipeline import PipelineOptions


@dataclass(frozen=True)
class StepInputs:
    """What a training step reads besides this process's place in the run: the whole `model` (what the optimizer
    steps), the module the step trains through (`wrapped`: DDP, FSDP or the model; `forward`: it compiled where
    `train.compile`), `batches(first, count)`: the samples [first, first + count) of the run's stream on the
    device, and the step's shape (`optim.batch_size`, `optim.grad_accum`, the sequence length)."""

    model: nn.Module
    wrapped: nn.Module
    forward: Callable[..., Any]
    batches: Callable[[int, int], tuple[torch.Tensor, torch.Tensor]]
    autocast: Callable[[], contextlib.AbstractContextManager]
    batch_size: int
    grad_accum: int
    seq_len: int


class Steps(Protocol):
    """How this process trains its part of each step (`Parallel.steps`): the data-parallel micro-batch loop
    (`ReplicatedSteps`), or this rank's pipeline stage (`models.staged.StagedRun`). The training loop asks it
    and never which it is."""

    def forward_backward(self, step: int) -> float:
        """Accumulate the gradients of this process's share of `step`; returns its mean LM loss."""
        ...

    def clip(self, max_norm: float) -> float:
        """Clip the whole model's gradient to `max_norm`; returns its norm before clipping."""
        ...

    def sum_sites(self, sums: torch.Tensor) -> None:
        """Sum per-site gradient statistics in place over the ranks that hold parts of them."""
        ...

    def gather(self) -> None:
        """Make this rank's model whole and current (before an evaluation or a checkpoint)."""
        ...

    def metrics(self) -> dict[str, float]:
        """What the last step logs besides the loss (the bytes across pipeline boundaries)."""
        ...

    def summary(self) -> dict[str, float]:
        """What the run's summary records of how it was placed."""
        ...


@dataclass(frozen=True)
class Parallel:
    """This process's place in a data-parallel run: `world` ranks, this one `rank`, the model
    replicated (`ddp`) or sharded (`fsdp`, FSDP2's `fully_shard` per sublayer, then the root).

    `group` says whether the ranks share torch's default process group; only `ONE_PROCESS`, a
    world of one without one, has it False, and there every method below is an identity.
    `pipeline`: the ranks are D = world / S replicas of the run's S pipeline stages instead, rank r stage r % S
    of replica r // S (`models.staged`): the model is not wrapped, and a replica's ranks train the same share
    of the batch."""

    world: int
    rank: int
    sharding: Literal["ddp", "fsdp"] = "ddp"
    group: bool = True
    pipeline: PipelineOptions | None = None

    def __post_init__(self) -> None:
        if self.sharding not in ("ddp", "fsdp"):
            raise ValueError(f"sharding must be 'ddp' or 'fsdp', got {self.sharding!r}")
        if not 0 <= self.rank < self.world:
            raise ValueError(f"rank {self.rank} is outside a world of {self.world}")
        if not self.group and self.world != 1:
            raise ValueError(f"a world of {self.world} ranks needs a process group")

    @classmethod
    def from_process_group(cls, sharding: Literal["ddp", "fsdp"] = "ddp",
                           pipeline: PipelineOptions | None = None) -> Parallel:
        """The rank and world size of the initialised default process group."""
        return cls(world=dist.get_world_size(), rank=dist.get_rank(), sharding=sharding, pipeline=pipeline)

    @property
    def data_world(self) -> int:
        """The data-parallel degree: the ranks, or under pipeline stages the replicas, that share each batch."""
        return self.world if self.pipeline is None else self.world // self.pipeline.stages

    @property
    def stages(self) -> int:
        """The pipeline stages the run is split into; 1 when it is not."""
        return 1 if self.pipeline is None else self.pipeline.stages

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def layout(self) -> dict[str, Any]:
        """World size and sharding as a run records them (its info and each segment); nothing for one process."""
        if self.pipeline is not None:
            p = self.pipeline
            virtual = ({"pipeline_virtual_stages": p.virtual_stages, "pipeline_cache": p.cross_stage_cache}
                       if p.virtual_stages > 1 else {})
            return {"world_size": self.world, "pipeline_stages": p.stages, "pipeline_schedule": p.schedule,
                    "microbatches": p.microbatches, **virtual, **({"pipeline_replicas": self.data_world}
                                                                  if self.data_world > 1 else {})}
        return {"world_size": self.world, "sharding": self.sharding} if self.group else {}

    def check_group(self) -> None:
        """Refuse to train without a default process group of this world size."""
        if not self.group:
            return
        if not dist.is_initialized() or dist.get_world_size() != self.world or dist.get_rank() != self.rank:
            found = f"rank {dist.get_rank()} of {dist.get_world_size()}" if dist.is_initialized() else "none"
            raise RuntimeError(f"{self} needs an initialised default process group of that rank and size; "
                               f"found {found} (torch.distributed.init_process_group)")

    def device(self, device: torch.device) -> torch.device:
        """A CUDA device without an index is this rank's current one (Ray Train sets it per worker)."""
        if self.group and device.type == "cuda" and device.index is None:
            return torch.device("cuda", torch.cuda.current_device())
        return device

    def wrap(self, model: nn.Module, device: torch.device,
             keep_replica: bool = False) -> tuple[nn.Module, nn.Module | None]:
        """(the module to train through, an unsharded copy or None): DDP around `model`, or `model`
        sharded in place by FSDP2, with a copy kept first when `keep_replica` (rank 0's diagnostics
        read the whole model). Build the optimizer after this: FSDP replaces the parameters."""
        self.check_group()
        if not self.group or self.pipeline is not None:
            return model, None
        if self.sharding == "ddp":
            from torch.nn.parallel import DistributedDataParallel

            ids = [device.index] if device.type == "cuda" else None
            return DistributedDataParallel(model, device_ids=ids), None
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        replica = copy.deepcopy(model) if keep_replica else None
        mesh = init_device_mesh(device.type, (self.world,))
        for sublayer in model.sublayers:  # type: ignore[union-attr]
            fully_shard(sublayer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, replica

    def grad_sync(self, wrapped: nn.Module, last: bool) -> contextlib.AbstractContextManager:
        """Reduce gradients over the ranks only in the last micro-batch's backward."""
        if not self.group:
            return contextlib.nullcontext()
        if self.sharding == "fsdp":
            wrapped.set_requires_gradient_sync(last)  # type: ignore[operator]
            return contextlib.nullcontext()
        return contextlib.nullcontext() if last else wrapped.no_sync()  # type: ignore[operator]

    def all_reduce(self, t: torch.Tensor) -> None:
        """Sum `t` over the ranks, in place."""
        if self.group:
            dist.all_reduce(t)

    def barrier(self) -> None:
        if self.group:
            dist.barrier()

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's `obj`, on every rank."""
        if not self.group:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def mean(self, value: float, device: torch.device) -> float:
        """The mean of `value` over the ranks, the same float on every rank."""
        if not self.group:
            return value
        t = torch.tensor([value], dtype=torch.float64, device=device)
        self.all_reduce(t)
        return t.item() / self.world

    def computed_on_main(self, fn: Callable[[nn.Module], Any], model: nn.Module, replica: nn.Module | None) -> Any:
        """`fn(whole model)` computed on rank 0 and broadcast to every rank. Under FSDP the full
        weights are gathered (a collective) into rank 0's `replica` first; under DDP `model` is whole."""
        if self.sharding == "fsdp":
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

            full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
            if self.is_main:
                if replica is None:
                    raise RuntimeError("computed_on_main under FSDP needs rank 0's replica (wrap keep_replica)")
                replica.load_state_dict(full)
                model = replica
        return self.broadcast(fn(model) if self.is_main else None)

    def steps(self, inputs: StepInputs) -> Steps:
        """How this process trains its part of each step: its pipeline stage (`models.staged.StagedRun`) when the
        run is split into stages, else its micro-batches of the data-parallel share (`ReplicatedSteps`)."""
        if self.pipeline is None:
            return ReplicatedSteps(self, inputs)
        from reslab.models.staged import StagedRun  # imported here: torch's pipelining is for staged runs only

        return StagedRun(cast("Decoder", inputs.model), self.pipeline, inputs.grad_accum,
                         (inputs.batch_size * inputs.grad_accum, inputs.seq_len), inputs.batches)

    def raise_from_main(self, fn: Callable[[], None]) -> None:
        """Run `fn` on rank 0 only and raise what it raised on every rank (rank 0 the original), so
        the ranks stop together instead of deadlocking in the next collective."""
        if not self.group:
            fn()
            return
        caught: BaseException | None = None
        if self.is_main:
            try:
                fn()
            except BaseException as exc:
                caught = exc
        raised = self.broadcast(_portable(caught) if caught is not None else None)
        if self.is_main and caught is not None:
            raise caught
        if raised is not None:
            raise raised


ONE_PROCESS = Parallel(world=1, rank=0, group=False)


class ReplicatedSteps:
    """A step of one process, or of one of N data-parallel ranks (module docstring): this rank's share of the
    global batch as `rank_batches` equal micro-batches, each objective divided by their count, the gradient
    synchronised in the last one's backward."""

    def __init__(self, parallel: Parallel, inputs: StepInputs) -> None:
        self.parallel, self.inputs = parallel, inputs
        self.global_batch = inputs.batch_size * inputs.grad_accum
        self.micro_batches = rank_batches(self.global_batch, inputs.batch_size, parallel.data_world)[0]

    def forward_backward(self, step: int) -> float:
        """The mean LM loss of this rank's micro-batches (the aux loss is trained on but not reported)."""
        p, run = self.parallel, self.inputs
        micros = rank_sample_ranges(step, self.global_batch, p.world, p.rank, self.micro_batches)
        loss_sum = 0.0
        for i, samples in enumerate(micros):
            x, y = run.batches(samples.start, len(samples))
            with p.grad_sync(run.wrapped, i == len(micros) - 1):
                with run.autocast():
                    out = run.forward(x, y)
                    objective = out.loss if out.aux_loss is None else out.loss + out.aux_loss
                (objective / len(micros)).backward()
            loss_sum += out.loss.item()
        return loss_sum / len(micros)

    def clip(self, max_norm: float) -> float:
        return total_norm(nn.utils.clip_grad_norm_(self.inputs.model.parameters(), max_norm))

    def sum_sites(self, sums: torch.Tensor) -> None:
        """DDP's gradients are already the ranks' mean; FSDP's are shards, whose squares are summed here."""
        if self.parallel.sharding == "fsdp":
            self.parallel.all_reduce(sums)

    def gather(self) -> None:
        pass  # every rank's model is whole (FSDP's is read through `computed_on_main`)

    def metrics(self) -> dict[str, float]:
        return {}

    def summary(self) -> dict[str, float]:
        return {}


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


def total_norm(norm: torch.Tensor) -> float:
    """`clip_grad_norm_`'s result as a float; under FSDP a DTensor to reduce over the ranks."""
    full = getattr(norm, "full_tensor", None)
    return float(full() if full is not None else norm)


def _portable(exc: BaseException) -> BaseException:
    """`exc` if it survives pickling unchanged in type and message, else a RuntimeError saying what it was."""
    try:
        back = pickle.loads(pickle.dumps(exc))
        if type(back) is type(exc) and str(back) == str(exc):
            return exc
    except Exception:  # noqa: S110 - any pickling failure means: send a description instead
        pass
    return RuntimeError(f"rank 0 raised {type(exc).__name__}: {exc}")
