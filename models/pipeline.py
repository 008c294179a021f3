"""Pipeline stages (issue 38, the model side): the backbone split at layer boundaries into S stages that
train through `torch.distributed.pipelining`, and the bytes that cross each stage boundary counted.

Stage i runs the sublayers of its layers (`stage_sites`: the L layers as even as they split, the earlier
stages taking one more); the first also embeds the tokens, the last applies the pathway's readout, the
final norm and the LM head, and returns the logits (and the pathway's auxiliary term, if any) to the
schedule's loss. `torch.distributed.pipelining` passes a tuple of tensors from stage to stage and nothing
else to a middle stage (pytorch issue 130055), so the pathway's state travels inside the stage outputs:
each variant defines what crosses (`ResidualPathway.stage_send` / `stage_receive`) and declares its size
(`stage_state_elems`). Every rank builds the whole `Decoder` from the run seed and runs only its part; the
parameters several stages use (the pathway's, whose rows belong to sites on every stage, and the tied
embedding, used by the first stage and the last) have their gradients summed over the stages after each
step (`Pipeline.step`), so each rank holds the one-process gradient of every parameter it uses.

Bytes are counted where the tensors are handed to the P2P calls (`CountingStage`, a `PipelineStage`
whose send ops add up the `nbytes` of what they send): the activations of every micro-batch forward and
their gradients backward, per boundary and step. The shape metadata the stages exchange once, on the
first step, and the gradient sum of the shared parameters (`StepResult.sync_bytes`) are not boundary bytes.

Kimi's cross-stage caching (Block AttnRes; Full AttnRes too) only changes what crosses when one rank runs
several virtual stages of the same micro-batch (interleaved schedules): the rank then still holds the
sources and completed blocks it had at the end of its previous virtual stage, and the hop into its next
one need only carry what was appended since. With one stage per rank (GPipe, 1F1B, what `Pipeline` runs)
every block a later stage reads crosses every boundary with every micro-batch, and caching saves nothing.
The saving is declared in closed form (`stage_state_elems(site, held)`, `declared_bytes(..., virtual=V)`),
not measured: the interleaved schedules with a per-rank cache are not built here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from reslab.common.errors import ConfigError
from reslab.models.backbone import Decoder

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}


@dataclass(frozen=True)
class PipelineOptions:
    """stages: S, the number of stages (one per rank of the pipeline group); schedule: "gpipe" or "1f1b";
    microbatches: how many micro-batches a step's batch is split into (must divide it)."""

    stages: int
    schedule: Literal["gpipe", "1f1b"] = "gpipe"
    microbatches: int = 1


def stage_layers(n_layers: int, stages: int) -> list[range]:
    """The Transformer layers of each stage: consecutive, as even as they split, earlier stages one more."""
    base, extra = divmod(n_layers, stages)
    out, lo = [], 0
    for i in range(stages):
        hi = lo + base + (1 if i < extra else 0)
        out.append(range(lo, hi))
        lo = hi
    return out


def stage_sites(n_layers: int, stages: int) -> list[range]:
    """The sublayers (sites 2l, 2l + 1 of each layer l) each stage runs."""
    return [range(2 * r.start, 2 * r.stop) for r in stage_layers(n_layers, stages)]


def boundaries(n_layers: int, stages: int) -> list[int]:
    """The site before which each of the S - 1 stage boundaries lies."""
    return [r.start for r in stage_sites(n_layers, stages)[1:]]


def check_pipeline(model: Decoder, options: PipelineOptions, batch_size: int | None = None) -> None:
    """Raise a one-line ConfigError for a split this model cannot take (before any rank starts)."""
    s, n_layers = options.stages, model.shape.n_layers
    if options.schedule not in SCHEDULES:
        raise ConfigError(f"pipeline.schedule: {options.schedule!r} is not a schedule; allowed: "
                          f"{', '.join(SCHEDULES)}")
    if not 1 <= s <= n_layers:
        raise ConfigError(f"pipeline.stages: {s} stages for a model of {n_layers} layers (model.n_layers); "
                          f"allowed: 1..{n_layers}, each stage at least one layer")
    if options.microbatches < 1:
        raise ConfigError(f"pipeline.microbatches: {options.microbatches}; allowed: >= 1")
    if batch_size is not None and batch_size % options.microbatches:
        raise ConfigError(f"pipeline.microbatches: {options.microbatches} does not divide the batch of "
                          f"{batch_size} samples; allowed: a divisor of the batch size")
    if model.moe_layers():
        raise ConfigError("model.moe: the MoE layers' balance losses live on every stage and do not reach the "
                          "last stage's loss; allowed: a dense model under pipeline stages")
    pathway = model.pathway
    errors = type(pathway).stage_errors(pathway.config, model.shape, pathway.impl)
    if errors:
        raise ConfigError("; ".join(f"residual.{e}" for e in errors))


class ContiguousGrad(torch.autograd.Function):
    """The identity, whose gradient is made contiguous: gloo sends and receives only contiguous tensors, and a
    received state's gradient may come out strided (hyper-connections' streams, read through an einsum)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        return grad.contiguous()


class StageModule(nn.Module):
    """Stage `index` of `stages` over the whole `Decoder` (every rank builds it from the seed): runs the
    sublayers `sites`; the first stage takes the token ids, the others the tensors `stage_send` made."""

    def __init__(self, model: Decoder, index: int, stages: int):
        super().__init__()
        self.model, self.index, self.stages = model, index, stages
        self.sites = stage_sites(model.shape.n_layers, stages)[index]

    @property
    def is_last(self) -> bool:
        return self.index == self.stages - 1

    def forward(self, *inputs: Tensor) -> Any:
        model, pathway = self.model, self.model.pathway
        if self.index == 0:
            idx = inputs[0]
            positions = torch.arange(idx.shape[1], device=idx.device).expand(idx.shape[0], -1)
            state = pathway.resume(pathway.start(model.embed(idx)), None, positions)
        else:
            state = pathway.stage_receive([ContiguousGrad.apply(t) for t in inputs], self.sites.start)
        state = model.run_sites(state, self.sites)
        if not self.is_last:
            return tuple(t.contiguous() for t in pathway.stage_send(state, self.sites.stop))
        logits = model.logits(state)
        aux = model._aux_loss(state)
        # [1], not a scalar: the schedule concatenates the micro-batches' outputs along dim 0
        return logits if aux is None else (logits, aux.reshape(1))

    def owned(self) -> list[Tensor]:
        """The parameters this stage uses: its sublayers and norms, the embedding (first; last when tied),
        the final norm and an untied head (last), and every pathway parameter (their sites span the stages)."""
        m = self.model
        params: list[Tensor] = []
        for site in self.sites:
            params += [*m.sublayers[site].parameters(), *m.norms[site].parameters()]
        if self.index == 0 or (self.is_last and m.lm_head is None):
            params.append(m.embed.weight)
        if self.is_last:
            params += [*m.final_norm.parameters(), *([] if m.lm_head is None else [m.lm_head.weight])]
        return params + list(m.pathway.parameters())


def objective(output: Any, targets: Tensor) -> Tensor:
    """Mean next-token cross-entropy of one micro-batch, plus the pathway's auxiliary term (what training
    minimises, `models.training`)."""
    logits, aux = (output, None) if isinstance(output, Tensor) else output
    loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
    return loss if aux is None else loss + aux.sum()


class CountingStage(PipelineStage):
    """A `PipelineStage` that adds up the bytes of the tensors its P2P send ops carry: `sent_fwd`, the
    activations to the next stage; `sent_bwd`, the gradients to the previous one (reset by the caller)."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.sent_fwd = 0
        self.sent_bwd = 0

    def get_fwd_send_ops(self, fwd_chunk_id: int) -> list[dist.P2POp]:
        ops = super().get_fwd_send_ops(fwd_chunk_id)
        self.sent_fwd += sum(op.tensor.nbytes for op in ops)
        return ops

    def get_bwd_send_ops(self, bwd_chunk_id: int) -> list[dist.P2POp]:
        ops = super().get_bwd_send_ops(bwd_chunk_id)
        self.sent_bwd += sum(op.tensor.nbytes for op in ops)
        return ops


@dataclass
class StepResult:
    """One training step: the mean LM loss over the micro-batches, without the pathway's auxiliary term (every
    rank gets the last stage's), the bytes
    sent forward and backward across each of the S - 1 boundaries, and the bytes of the shared gradients'
    sum per rank (not boundary bytes)."""

    loss: float
    bytes_fwd: list[int] = field(default_factory=list)
    bytes_bwd: list[int] = field(default_factory=list)
    sync_bytes: int = 0


class Pipeline:
    """This rank's stage of a pipelined `Decoder`: build once per run, then `step` per batch (the gradients
    accumulate into the model's parameters as `loss.backward()` would; the caller's optimizer steps
    `parameters()`, zeroes them, and repeats). The default process group holds the S stages, rank i stage i,
    unless `group` is given."""

    def __init__(self, model: Decoder, options: PipelineOptions, group: dist.ProcessGroup | None = None):
        check_pipeline(model, options)
        self.options, self.group = options, group
        self.index = dist.get_rank(group)
        if dist.get_world_size(group) != options.stages:
            raise ConfigError(f"pipeline.stages: {options.stages} stages on a process group of "
                              f"{dist.get_world_size(group)} ranks; allowed: one rank per stage")
        self.module = StageModule(model, self.index, options.stages)
        device = model.embed.weight.device
        self.stage = CountingStage(self.module, self.index, options.stages, device, group=group)
        self.schedule = SCHEDULES[options.schedule](self.stage, options.microbatches, loss_fn=self.objective)
        self.aux: list[Tensor] = []  # the last stage's auxiliary term of each micro-batch of the step

    def objective(self, output: Any, targets: Tensor) -> Tensor:
        """`objective` (what the schedule's backward starts from), keeping each micro-batch's auxiliary term, which
        the loss `step` reports leaves out (the LM loss alone, as one process reports it)."""
        if not isinstance(output, Tensor):
            self.aux.append(output[1].detach().sum())
        return objective(output, targets)

    def parameters(self) -> list[Tensor]:
        """What this rank's optimizer steps: the parameters its stage uses (`StageModule.owned`)."""
        return self.module.owned()

    def step(self, idx: Tensor, targets: Tensor) -> StepResult:
        """One step over the batch `idx`, `targets` [B, T] (every rank passes the same; the first stage reads
        the tokens, the last the targets), the micro-batches as the schedule orders them."""
        if idx.shape[0] % self.options.microbatches:
            check_pipeline(self.module.model, self.options, idx.shape[0])
        self.stage.sent_fwd = self.stage.sent_bwd = 0
        self.aux = []
        losses: list[Tensor] = []
        if self.index == 0:
            self.schedule.step(idx)
        elif self.module.is_last:
            self.schedule.step(target=targets, losses=losses)
        else:
            self.schedule.step()
        sync = self.sync_grads()
        return self.gather(losses, sync)

    def sync_grads(self) -> int:
        """Sum the gradients of the parameters several stages use over the stages; returns the bytes summed."""
        m = self.module.model
        shared = [*m.pathway.parameters(), m.embed.weight]
        if self.options.stages == 1 or not shared:
            return 0
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten() for p in shared])
        dist.all_reduce(flat, group=self.group)
        for p, g in zip(shared, flat.split([p.numel() for p in shared]), strict=True):
            if p.grad is None:
                p.grad = g.view_as(p).clone()
            else:
                p.grad.copy_(g.view_as(p))
        return flat.nbytes

    def gather(self, losses: list[Tensor], sync: int) -> StepResult:
        """The loss and the bytes of every stage, on every rank."""
        s = self.options.stages
        loss = torch.stack(losses).detach().double().mean() if losses else torch.zeros((), dtype=torch.float64)
        if self.aux and losses:  # the LM loss: each micro-batch's objective less its auxiliary term (the last
            # len(losses) calls: on its first step the schedule also calls the loss on placeholder tensors first)
            loss = loss - torch.stack(self.aux[-len(losses):]).double().mean()
        mine = torch.tensor([float(self.stage.sent_fwd), float(self.stage.sent_bwd), loss.item()],
                            dtype=torch.float64)
        every = [torch.zeros_like(mine) for _ in range(s)]
        dist.all_gather(every, mine, group=self.group)
        return StepResult(loss=float(every[-1][2]), bytes_fwd=[int(every[i][0]) for i in range(s - 1)],
                          bytes_bwd=[int(every[i + 1][1]) for i in range(s - 1)], sync_bytes=sync)


def declared_bytes(model: Decoder, options: PipelineOptions, batch: tuple[int, int], virtual: int = 1) -> list[int]:
    """The bytes one step sends across each boundary in one direction, from the pathway's declaration
    (`stage_state_elems`): per micro-batch, its tokens times the elements per token plus the elements per
    micro-batch, in the parameters' dtype, times the micro-batches. The gradients backward are the same.

    `virtual` > 1: Kimi's cross-stage caching with the S stages laid out interleaved on S / virtual ranks (stage
    k on rank k mod P, as the interleaved schedules place them): the rank receiving at the boundary into stage
    k has run stage k - P of the same micro-batch and keeps what it held at its end (`held`), so a variant
    whose state only appends (the AttnRes family) sends only what was appended since. Declared, not measured:
    `Pipeline` runs one stage per rank."""
    b, t = batch
    size = model.embed.weight.element_size()
    starts = [r.start for r in stage_sites(model.shape.n_layers, options.stages)] + [model.shape.n_sites]
    ranks = options.stages // virtual
    if virtual < 1 or ranks * virtual != options.stages or (virtual > 1 and ranks < 2):
        raise ConfigError(f"virtual: {virtual} virtual stages per rank do not divide {options.stages} stages; "
                          "allowed: a divisor of the stages that leaves at least 2 ranks")
    out = []
    for k, site in enumerate(starts[1:-1], start=1):
        held = starts[k - ranks + 1] if virtual > 1 and k >= ranks else None
        per_token, per_mb = model.pathway.stage_state_elems(site, held)
        out.append(options.microbatches * ((b // options.microbatches) * t * per_token + per_mb) * size)
    return out


def pipeline_step(pipeline: Pipeline, idx: Tensor, targets: Tensor) -> tuple[float, list[int], list[int]]:
    """(loss, bytes forward, bytes backward per boundary) of one step: `Pipeline.step` for a training loop."""
    result = pipeline.step(idx, targets)
    return result.loss, result.bytes_fwd, result.bytes_bwd
