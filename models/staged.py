"""The training loop's side of pipeline stages (issue 38): one run's `Trainer` on S x D ranks, D replicas of S
ranks (pipeline x data parallelism; D = 1: one replica), each rank running V virtual stages.

Layout: global rank r is stage r % S of replica r // S, so a replica's stages are consecutive ranks (on one node
when a node holds S or more). Each replica's S ranks form the process group its pipeline's P2P, the
shared-gradient sum, the loss gather and the parameter broadcast run on (`replica_group`); the D ranks of each
stage form the group the data-parallel gradient all-reduce runs on (`stage_group`). Every rank creates every
group, in the same order (`torch.distributed.new_group` is collective); with D = 1 there is one replica on the
default group and no stage group.

`models.pipeline.Pipeline` runs the schedule; this holds what a training step needs around it
(`StagedRun`). Every rank builds the whole model from the seed and its optimizer holds every parameter, as in
one process; a step's backward leaves gradients only on the parameters this rank's stage uses (the pathway's
and the tied embedding's summed over the stages by `Pipeline.step`, so every rank steps those alike), and
AdamW skips a parameter without a gradient. The step's global batch is `B = optim.batch_size * grad_accum`
samples; replica k trains the contiguous share `[s * B + k * B / D, s * B + (k + 1) * B / D)` at step s (the
slice data-parallel rank k takes, `models.distributed.rank_sample_ranges`), cut into `microbatches *
grad_accum` micro-batches. After the pipeline's shared-parameter sum, each rank all-reduces the gradients of
the parameters its stage uses over its stage group and divides by D: the mean over D replicas of the mean over
equal micro-batches is the one-process loop's mean over its `grad_accum` micro-batches, so the gradient is the
same up to the order of float sums, and every replica steps the same parameters alike. The reported loss is
each replica's mean, which the trainer averages over the world (each replica's S ranks report the same). The
gradient norm (for clipping and the log) is the whole model's: each stage's own parameters' squares summed
over its replica's ranks, the shared ones counted once.
The train loss reported is the LM loss alone, as one process reports it: `Pipeline.step` leaves out the
auxiliary term (delta_attnres's, when on) the schedule's objective trains on.

Before an evaluation and a checkpoint, `gather` broadcasts each stage's own parameters from its rank to the
other ranks of its replica, so every rank holds the whole, current model: evaluation, diagnostics and the
serving cost read it as in one process, and the checkpoint (DCP, as for data-parallel ranks) holds the
one-process model. Its optimizer state is the union of the ranks' (each parameter's moments from the rank
that steps it: DCP keeps one copy of a key several ranks save, and the shared parameters' moments, like every
replica's, are the same on each), so the checkpoint moves between stages (any replica count), one process and
data-parallel ranks like any other.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor

from reslab.common.errors import ConfigError
from reslab.models.backbone import Decoder
from reslab.models.pipeline import Pipeline, PipelineOptions, StepResult, declared_bytes, rank_parameters


def replica_groups(stages: int) -> tuple[dist.ProcessGroup | None, dist.ProcessGroup | None]:
    """(this rank's replica group, its stage group) in the default group of S x D ranks (module docstring):
    (None, None) when D = 1, the replica then the default group. Every rank calls it at the same point."""
    world, rank = dist.get_world_size(), dist.get_rank()
    replicas = world // stages
    if replicas * stages != world:
        raise ConfigError(f"pipeline.stages: {stages} stages do not divide the {world} ranks; allowed: "
                          "stages x data-parallel degree = the world size")
    if replicas == 1:
        return None, None
    mine: list[dist.ProcessGroup | None] = [None, None]
    for k in range(replicas):
        group = dist.new_group(list(range(k * stages, (k + 1) * stages)))
        if rank // stages == k:
            mine[0] = group
    for s in range(stages):
        group = dist.new_group(list(range(s, world, stages)))
        if rank % stages == s:
            mine[1] = group
    return mine[0], mine[1]


class StagedRun:
    """This rank's stage of a run (module docstring): `step` per optimizer step, `clip` before the optimizer,
    `gather` before reading the whole model; `metrics` and `summary` the bytes that crossed."""

    def __init__(self, model: Decoder, options: PipelineOptions, grad_accum: int, batch: tuple[int, int],
                 batches: Callable[[int, int], tuple[Tensor, Tensor]] | None = None):
        """`batch`: (the global batch `optim.batch_size * grad_accum`, the sequence length); `batches(first,
        count)`: the run's samples [first, first + count) on the device, which `forward_backward` trains on."""
        self.model, self.batches = model, batches
        self.options = dataclasses.replace(options, microbatches=options.microbatches * grad_accum)
        self.replicas = dist.get_world_size() // options.stages
        self.replica = dist.get_rank() // options.stages
        self.share = batch[0] // self.replicas
        if self.share * self.replicas != batch[0] or self.share % self.options.microbatches:
            raise ConfigError(f"pipeline.microbatches: {options.microbatches} micro-batches (x grad_accum "
                              f"{grad_accum}) do not divide each of {self.replicas} replicas' share of the "
                              f"{batch[0]}-sample batch; allowed: optim.batch_size a multiple of microbatches x "
                              "the data-parallel degree")
        self.group, self.stage_group = replica_groups(options.stages)
        self.pipeline = Pipeline(model, self.options, group=self.group)
        shared = {id(p) for p in self.shared()}
        self.own = [[p for p in rank_parameters(model, options, i) if id(p) not in shared]
                    for i in range(options.stages)]
        self.declared = declared_bytes(model, self.options, (self.share, batch[1]))
        self.last: StepResult | None = None

    def samples(self, step: int) -> tuple[int, int]:
        """(the first global sample index, the count) this rank's replica trains at `step` (module docstring)."""
        return step * self.share * self.replicas + self.replica * self.share, self.share

    def shared(self) -> list[Tensor]:
        """The parameters several stages use (their gradients are summed over the stages by `Pipeline.step`)."""
        return [*self.model.pathway.parameters(), self.model.embed.weight]

    def forward_backward(self, step: int) -> float:
        """`step` on the replica's share of the step's batch, read through `batches` (`models.distributed.Steps`)."""
        assert self.batches is not None, "StagedRun.forward_backward needs the run's batches"
        first, count = self.samples(step)
        return self.step(*self.batches(first, count))

    def step(self, idx: Tensor, targets: Tensor) -> float:
        """Forward and backward of the replica's share of the step's batch through the stages, then the gradients
        averaged over the replicas; the replica's mean loss, on each of its ranks."""
        self.last = self.pipeline.step(idx, targets)
        self.average_replicas()
        return self.last.loss

    @torch.no_grad()
    def average_replicas(self) -> None:
        """The gradients of the parameters this rank's stage uses, averaged over the D replicas of its stage
        (the shared ones already summed over the stages by `Pipeline.step`); nothing when D = 1."""
        if self.stage_group is None:
            return
        params = [p for p in [*self.own[self.pipeline.index], *self.shared()] if p.grad is not None]
        if not params:
            return
        flat = torch.cat([p.grad.flatten() for p in params])  # type: ignore[union-attr]
        dist.all_reduce(flat, group=self.stage_group)
        flat /= self.replicas
        for p, g in zip(params, flat.split([p.numel() for p in params]), strict=True):
            p.grad.copy_(g.view_as(p))  # type: ignore[union-attr]

    def sum_over_stages(self, t: Tensor) -> None:
        """Sum `t` in place over this replica's stages (each holds its own sites' part; replicas hold the same)."""
        dist.all_reduce(t, group=self.group)

    def sum_sites(self, sums: Tensor) -> None:
        """Per-site gradient statistics: each stage holds its own sites', every replica the same."""
        self.sum_over_stages(sums)

    @torch.no_grad()
    def clip(self, max_norm: float) -> float:
        """`clip_grad_norm_` over the whole model's gradient, which the stages hold in parts; returns its norm."""
        mine = self.own[self.pipeline.index]
        sq = torch.zeros((), dtype=torch.float64, device=self.model.embed.weight.device)
        for p in mine:
            if p.grad is not None:
                sq += p.grad.double().pow(2).sum()
        self.sum_over_stages(sq)
        for p in self.shared():
            if p.grad is not None:
                sq += p.grad.double().pow(2).sum()
        norm = float(sq.sqrt())
        coef = max_norm / (norm + 1e-6)
        if coef < 1.0:
            for p in [*mine, *self.shared()]:
                if p.grad is not None:
                    p.grad.mul_(coef)
        return norm

    @torch.no_grad()
    def gather(self) -> None:
        """Every stage's own parameters, broadcast from its rank in this replica: every rank then holds the whole
        current model."""
        for index, params in enumerate(self.own):
            flat = torch.cat([p.detach().flatten() for p in params])
            dist.broadcast(flat, src=self.replica * self.options.stages + index, group=self.group)
            if index != self.pipeline.index:
                for p, value in zip(params, flat.split([p.numel() for p in params]), strict=True):
                    p.copy_(value.view_as(p))

    def metrics(self) -> dict[str, float]:
        """The last step's bytes across each boundary, forward and backward: `pipe/bytes_fwd/bNN`, `.../bytes_bwd/`."""
        if self.last is None:
            return {}
        out: dict[str, float] = {}
        for k, (fwd, bwd) in enumerate(zip(self.last.bytes_fwd, self.last.bytes_bwd, strict=True)):
            out[f"pipe/bytes_fwd/b{k:02d}"] = float(fwd)
            out[f"pipe/bytes_bwd/b{k:02d}"] = float(bwd)
        return out

    def summary(self) -> dict[str, float]:
        """`pipe_bytes_per_step`: the last step's bytes across every boundary, both directions (every step sends
        the same); `pipe_bytes_declared`: the same from the variant's declaration (`declared_bytes`, both ways)."""
        out = {"pipe_bytes_declared": float(2 * sum(self.declared))}
        if self.last is not None:
            out["pipe_bytes_per_step"] = float(sum(self.last.bytes_fwd) + sum(self.last.bytes_bwd))
        return out
