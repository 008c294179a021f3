"""The training loop's side of pipeline stages (issue 38): one run's `Trainer` on S ranks, V stages each.

`models.pipeline.Pipeline` runs the schedule; this holds what a training step needs around it
(`StagedRun`). Every rank builds the whole model from the seed and its optimizer holds every parameter, as in
one process; a step's backward leaves gradients only on the parameters this rank's stage uses (the pathway's
and the tied embedding's summed over the stages by `Pipeline.step`, so every rank steps those alike), and
AdamW skips a parameter without a gradient. The step's batch is the whole `optim.batch_size * grad_accum`
samples, cut into `microbatches * grad_accum` micro-batches: the schedule's mean over equal micro-batches is
the one-process loop's mean over its `grad_accum` micro-batches, so the gradient is the same up to the order
of float sums. The gradient norm (for clipping and the log) is the whole model's: each stage's own
parameters' squares summed over the ranks, the shared ones counted once.
The train loss reported is the schedule's objective: for a variant with an auxiliary loss (delta_attnres's,
when on) it includes that term, where one process reports the LM loss alone (`Pipeline.step` returns the sum).

Before an evaluation and a checkpoint, `gather` broadcasts each stage's own parameters from its rank, so
every rank holds the whole, current model: evaluation, diagnostics and the serving cost read it as in one
process, and the checkpoint (DCP, as for data-parallel ranks) holds the one-process model. Its optimizer
state is the union of the ranks' (each parameter's moments from the rank that steps it: DCP keeps one copy of
a key several ranks save, and the shared parameters' moments are the same on each), so the checkpoint moves
between stages, one process and data-parallel ranks like any other.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from torch import Tensor

from reslab.models.backbone import Decoder
from reslab.models.pipeline import Pipeline, PipelineOptions, StepResult, declared_bytes, rank_parameters


class StagedRun:
    """This rank's stage of a run (module docstring): `step` per optimizer step, `clip` before the optimizer,
    `gather` before reading the whole model; `metrics` and `summary` the bytes that crossed."""

    def __init__(self, model: Decoder, options: PipelineOptions, grad_accum: int, batch: tuple[int, int]):
        self.model = model
        self.options = dataclasses.replace(options, microbatches=options.microbatches * grad_accum)
        self.pipeline = Pipeline(model, self.options)
        shared = {id(p) for p in self.shared()}
        self.own = [[p for p in rank_parameters(model, options, i) if id(p) not in shared]
                    for i in range(options.stages)]
        self.declared = declared_bytes(model, self.options, batch)
        self.last: StepResult | None = None

    def shared(self) -> list[Tensor]:
        """The parameters several stages use (their gradients are summed over the stages by `Pipeline.step`)."""
        return [*self.model.pathway.parameters(), self.model.embed.weight]

    def step(self, idx: Tensor, targets: Tensor) -> float:
        """Forward and backward of the step's whole batch through the stages; the mean loss, on every rank."""
        self.last = self.pipeline.step(idx, targets)
        return self.last.loss

    @torch.no_grad()
    def clip(self, max_norm: float) -> float:
        """`clip_grad_norm_` over the whole model's gradient, which the stages hold in parts; returns its norm."""
        mine = self.own[self.pipeline.index]
        sq = torch.zeros((), dtype=torch.float64, device=self.model.embed.weight.device)
        for p in mine:
            if p.grad is not None:
                sq += p.grad.double().pow(2).sum()
        dist.all_reduce(sq)
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
        """Every stage's own parameters, broadcast from its rank: every rank then holds the whole current model."""
        for rank, params in enumerate(self.own):
            flat = torch.cat([p.detach().flatten() for p in params])
            dist.broadcast(flat, src=rank)
            if rank != self.pipeline.index:
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
