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

Virtual stages (`PipelineOptions.virtual_stages` V): the model splits into S V stage modules, stage k on rank
k mod S (rank r holds r, r + S, ...), under LoopedBFS ("gpipe": every micro-batch through a stage before the
next) or Interleaved 1F1B ("1f1b"; its micro-batch count M must be a multiple of max(1, M // S)). Each stage
module wraps the whole model, so the schedule's own 1/M scaling (which divides every parameter of each stage's
module) is off and `Pipeline.step` takes the mean once per rank.

Kimi's cross-stage caching (`cross_stage_cache`, V >= 2): when micro-batch m enters rank r's stage k + S, the
rank still holds what its stage k sent at its end; what crosses into stage k + S need only be what was
appended since. What the rank holds is found by identity on a one-token template walk (`held_pairs`: the
tensors of the state at the later boundary that are the very tensors of the state at the earlier one), so
the AttnRes family keeps its sources and completed blocks and a state rewritten at every site (prenorm, MGR)
keeps nothing: its cache is a no-op. `StageCache` keeps, per (stage, micro-batch), the detached tensors;
the later stage rebuilds its state from them as fresh leaves plus what it received. The gradient the later
stage puts on a kept tensor reaches the earlier stage's backward through `Attach`, an identity on the earlier
stage's outputs that also takes the kept tensors: its backward hands them the leaves' `.grad`. The order is
safe under any schedule: stage k's backward for m needs its outputs' gradient, which stage k + 1 sends only
after its own backward, which needs stage k + 2's, ..., stage k + S's; and since the later stage reads
detached leaves, no graph is walked by two backward passes (torchtitan issue 3029's cache met "backward
through the graph a second time" under real schedules). The
bytes counted then equal the cached declaration (`stage_state_elems(site, held)`, `declared_bytes`); a
variant that keeps tensors but declares its state whole (DAR's embedding, DenseFormer's and DeltaAttnRes's
histories) is refused (`cache_error`). The zero-bubble schedules (separate input and weight backward, through
`autograd.grad` on the inputs only) would not fill the leaves' gradients and are not offered.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleLoopedBFS,
)

from reslab.common.errors import ConfigError
from reslab.models.backbone import Decoder

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}
# the same two orders with several (virtual) stages per rank: GPipe's all-forwards-first is LoopedBFS's
# breadth-first order; 1F1B interleaved
INTERLEAVED = {"gpipe": ScheduleLoopedBFS, "1f1b": ScheduleInterleaved1F1B}


@dataclass(frozen=True)
class PipelineOptions:
    """stages: S, the number of ranks of the pipeline group; schedule: "gpipe" or "1f1b" (with virtual stages
    LoopedBFS or Interleaved 1F1B); microbatches: how many micro-batches a step's batch is split into (must
    divide it); virtual_stages: V, the stages each rank runs (the model split into S V stages, stage k on rank
    k mod S); cross_stage_cache: Kimi's cross-stage caching (V >= 2: a rank keeps the state it held at the end
    of its previous virtual stage of a micro-batch, and only what was appended since crosses into the next)."""

    stages: int
    schedule: Literal["gpipe", "1f1b"] = "gpipe"
    microbatches: int = 1
    virtual_stages: int = 1
    cross_stage_cache: bool = False

    @property
    def modules(self) -> int:
        """The stage modules the model splits into, S V."""
        return self.stages * self.virtual_stages


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
    error = virtual_error(n_layers, options) or cache_error(model.pathway, n_layers, options)
    if error:
        raise ConfigError(f"pipeline.{error}")
    if model.moe_layers():
        raise ConfigError("model.moe: the MoE layers' balance losses live on every stage and do not reach the "
                          "last stage's loss; allowed: a dense model under pipeline stages")
    pathway = model.pathway
    errors = type(pathway).stage_errors(pathway.config, model.shape, pathway.impl)
    if errors:
        raise ConfigError("; ".join(f"residual.{e}" for e in errors))


def virtual_error(n_layers: int, options: PipelineOptions) -> str | None:
    """Why these virtual stages cannot run ("<field>: ...; allowed: ..."), or None: S V <= L stage modules of at
    least one layer each, S >= 2 ranks, and Interleaved 1F1B's micro-batches a multiple of its rounds
    (max(1, M // S)); caching needs V >= 2 (with one stage per rank no rank holds anything of a later stage)."""
    s, v, m = options.stages, options.virtual_stages, options.microbatches
    if v < 1:
        return f"virtual_stages: {v}; allowed: >= 1"
    if v > 1 and s < 2:
        return f"virtual_stages: {v} virtual stages on {s} rank; allowed: stages >= 2 with virtual_stages > 1"
    if v > 1 and s * v > n_layers:
        return (f"virtual_stages: {s} stages x {v} virtual stages = {s * v} stage modules for a model of "
                f"{n_layers} layers; allowed: stages x virtual_stages <= {n_layers}, each at least one layer")
    rounds = max(1, m // s)
    if v > 1 and options.schedule == "1f1b" and m % rounds:
        return (f"microbatches: {m} micro-batches under Interleaved 1F1B on {s} ranks, not a multiple of its "
                f"{rounds} rounds (max(1, M // S)); allowed: M < 2 S, or a multiple of M // S")
    if options.cross_stage_cache and v < 2:
        return ("cross_stage_cache: caching needs virtual_stages >= 2 (with one stage per rank nothing a rank "
                "holds is read by a later stage on it); allowed: virtual_stages >= 2, or no cache")
    return None


def cache_error(pathway: Any, n_layers: int, options: PipelineOptions) -> str | None:
    """Why this variant's state cannot be cached across virtual stages, or None. What a rank keeps is found by
    identity (`held_pairs`: the tensors of the state a later stage receives that are the very tensors it
    received or made at the end of its previous virtual stage); that must be what the variant declares
    (`stage_state_elems(site, held)`), so only a state that is appended to, never rewritten, is cached (the
    AttnRes family); a state rewritten at every site (prenorm, MGR) holds nothing and the cache is a no-op."""
    if not options.cross_stage_cache or options.virtual_stages < 2:
        return None
    starts, s = stage_starts(n_layers, options.modules), options.stages
    for k in range(s, options.modules):
        site, held = starts[k], starts[k - s + 1]
        after = template_send(pathway, site)
        kept = {i for i, _ in held_pairs(pathway, site, held)}
        elems = sum(t.numel() for i, t in enumerate(after) if i not in kept)
        if (elems, 0) != pathway.stage_state_elems(site, held):
            return (f"cross_stage_cache: {pathway.name}'s state keeps tensors across a boundary (before site "
                    f"{site}) but is declared whole (rewritten, not only appended to), so a rank cannot keep "
                    "part of it; allowed: no cache, or a variant whose state only appends (the AttnRes family)")
    return None


def stage_starts(n_layers: int, stages: int) -> list[int]:
    """The first site of each stage, then the number of sites."""
    return [r.start for r in stage_sites(n_layers, stages)] + [2 * n_layers]


@torch.no_grad()
def _walk(pathway: Any, state: Any, sites: range) -> Any:
    """`state` through `sites` of a one-token forward with zero sublayer outputs (`boundary_template`'s walk)."""
    like = next(iter(pathway.parameters()), None)
    dtype = torch.get_default_dtype() if like is None else like.dtype
    for site in sites:
        state = pathway.update(pathway.prepare(state, site), site,
                               torch.zeros(1, 1, pathway.shape.d_model, dtype=dtype))
    return state


def template_send(pathway: Any, site: int) -> tuple[Tensor, ...]:
    """What crosses before `site` on a one-token template (`boundary_template`)."""
    return tuple(pathway.stage_send(pathway.boundary_template(site), site))


def held_pairs(pathway: Any, site: int, held: int) -> list[tuple[int, int]]:
    """The tensors of what crosses before `site` that are the same tensors as crossed before `held` (< site), on
    a one-token template walk: (index in what crosses at `site`, index in what crossed at `held`). A rank that
    ran the stage ending at `held` still holds them; with caching they are not sent again."""
    state = pathway.boundary_template(held)
    before = pathway.stage_send(state, held)
    after = pathway.stage_send(_walk(pathway, state, range(held, site)), site)
    index = {id(t): j for j, t in enumerate(before)}
    return [(i, index[id(t)]) for i, t in enumerate(after) if id(t) in index]


class ContiguousGrad(torch.autograd.Function):
    """The identity, whose gradient is made contiguous: gloo sends and receives only contiguous tensors, and a
    received state's gradient may come out strided (hyper-connections' streams, read through an einsum)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        return grad.contiguous()


@dataclass
class Held:
    """What a rank keeps of one micro-batch's state for its later virtual stage: `values`, the tensors (detached)
    that crossed at the end of its earlier stage; `leaves`, the leaves the later stage's forward made of them,
    whose `.grad` the later stage's backward fills."""

    values: list[Tensor]
    leaves: list[Tensor] | None = None


class Attach(torch.autograd.Function):
    """The identity on the tensors a stage sends, made to depend on the tensors it keeps for its later virtual
    stage (`held`): the backward returns to those the gradient the later stage's backward left on their leaves.
    The later stage's backward on this rank runs first (the earlier stage's needs the gradient of its outputs,
    which the stages between send back only after the later one's), so the gradient is there; and the later
    stage reads detached leaves, so no backward walks the earlier stage's graph twice."""

    @staticmethod
    def forward(ctx: Any, held: Held, n: int, *tensors: Tensor) -> tuple[Tensor, ...]:
        ctx.held, ctx.kept = held, len(tensors) - n
        return tuple(t.view_as(t) for t in tensors[:n])

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> Any:
        leaves = ctx.held.leaves or [None] * ctx.kept
        return (None, None, *grads, *(None if leaf is None else leaf.grad for leaf in leaves))


class StageCache:
    """Kimi's cross-stage caching on one rank of S, for the S V stage modules that start at `starts`: per
    micro-batch, what the rank's stage k sent (the state at the end of stage k) is kept for its stage k + S, and
    the boundary into stage k + S carries only the tensors the rank does not hold (`held_pairs`). Keyed by
    (stage, micro-batch); `clear` after each step."""

    def __init__(self, pathway: Any, starts: list[int], ranks: int):
        self.ranks = ranks
        self.pairs = {k: held_pairs(pathway, starts[k], starts[k - ranks + 1]) for k in range(ranks, len(starts) - 1)}
        self.kept: dict[tuple[int, int | None], Held] = {}

    def clear(self) -> None:
        self.kept.clear()

    def join(self, stage: int, chunk: int | None, received: list[Tensor]) -> list[Tensor]:
        """What crossed into `stage` whole: the tensors this rank holds (as fresh leaves) in their places, the
        received ones in the others."""
        pairs = self.pairs.get(stage)
        if not pairs:
            return received
        held = self.kept[(stage, chunk)]
        grad = torch.is_grad_enabled()
        held.leaves = [v.detach().requires_grad_(grad and v.is_floating_point()) for v in held.values]
        out: list[Tensor | None] = [None] * (len(received) + len(pairs))
        for (i, _), leaf in zip(pairs, held.leaves, strict=True):
            out[i] = leaf
        rest = iter(received)
        return [next(rest) if t is None else t for t in out]

    def split(self, stage: int, chunk: int | None, sent: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
        """What `stage` sends of the state `sent` at its end: the tensors the receiving rank does not hold,
        attached (`Attach`) to those this rank keeps for its stage `stage` + S."""
        drop = {i for i, _ in self.pairs.get(stage + 1, [])}
        new = [t for i, t in enumerate(sent) if i not in drop]
        if not new:
            raise RuntimeError(f"stage {stage} would send nothing with cross-stage caching")
        keep = self.pairs.get(stage + self.ranks)
        if not keep:
            return tuple(new)
        held = Held([sent[j].detach() for _, j in keep])
        self.kept[(stage + self.ranks, chunk)] = held
        return tuple(Attach.apply(held, len(new), *new, *(sent[j] for _, j in keep)))


class StageModule(nn.Module):
    """Stage `index` of `stages` over the whole `Decoder` (every rank builds it from the seed): runs the
    sublayers `sites`; the first stage takes the token ids, the others the tensors `stage_send` made (with a
    `cache`, only those this rank does not hold; `chunk`, the micro-batch, is set by `CountingStage`)."""

    def __init__(self, model: Decoder, index: int, stages: int, cache: StageCache | None = None):
        super().__init__()
        self.model, self.index, self.stages = model, index, stages
        self.sites = stage_sites(model.shape.n_layers, stages)[index]
        self.cache = cache
        self.chunk: int | None = None

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
            received = [ContiguousGrad.apply(t) for t in inputs]
            if self.cache is not None:
                received = self.cache.join(self.index, self.chunk, received)
            state = pathway.stage_receive(received, self.sites.start)
        state = model.run_sites(state, self.sites)
        if not self.is_last:
            sent = tuple(t.contiguous() for t in pathway.stage_send(state, self.sites.stop))
            return sent if self.cache is None else self.cache.split(self.index, self.chunk, sent)
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


def rank_parameters(model: Decoder, options: PipelineOptions, rank: int) -> list[Tensor]:
    """The parameters rank `rank`'s stages use (its V virtual stages, k = rank + v S), each once."""
    out: dict[int, Tensor] = {}
    for v in range(options.virtual_stages):
        for p in StageModule(model, rank + v * options.stages, options.modules).owned():
            out.setdefault(id(p), p)
    return list(out.values())


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

    def forward_one_chunk(self, fwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        module = self.submod
        assert isinstance(module, StageModule)  # noqa: S101
        module.chunk = fwd_chunk_id  # the micro-batch, for the stage's cross-stage cache
        try:
            return super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)
        finally:
            module.chunk = None

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
    rank gets the last stage's), the bytes sent forward and backward across each of the S V - 1 boundaries, and
    the bytes of the shared gradients'
    sum per rank (not boundary bytes)."""

    loss: float
    bytes_fwd: list[int] = field(default_factory=list)
    bytes_bwd: list[int] = field(default_factory=list)
    sync_bytes: int = 0


class Pipeline:
    """This rank's stages of a pipelined `Decoder`: build once per run, then `step` per batch (the gradients
    accumulate into the model's parameters as `loss.backward()` would; the caller's optimizer steps
    `parameters()`, zeroes them, and repeats). The default process group holds the S ranks, rank r stages
    r, r + S, ..., r + (V - 1) S, unless `group` is given."""

    def __init__(self, model: Decoder, options: PipelineOptions, group: dist.ProcessGroup | None = None):
        check_pipeline(model, options)
        self.options, self.group, self.model = options, group, model
        self.index = dist.get_rank(group)
        if dist.get_world_size(group) != options.stages:
            raise ConfigError(f"pipeline.stages: {options.stages} stages on a process group of "
                              f"{dist.get_world_size(group)} ranks; allowed: one rank per stage")
        n, device = options.modules, model.embed.weight.device
        starts = stage_starts(model.shape.n_layers, n)
        self.cache = StageCache(model.pathway, starts, options.stages) if options.cross_stage_cache else None
        self.modules = [StageModule(model, self.index + v * options.stages, n, self.cache)
                        for v in range(options.virtual_stages)]
        self.stages = [CountingStage(m, m.index, n, device, group=group) for m in self.modules]
        # the schedule's own mean over the micro-batches divides every parameter of each stage's module (the whole
        # model) once per stage, V times on this rank: `step` divides this rank's gradients once instead
        self.schedule: Any
        if options.virtual_stages == 1:
            self.schedule = SCHEDULES[options.schedule](self.stages[0], options.microbatches, loss_fn=self.objective,
                                                        scale_grads=False)
        else:
            self.schedule = INTERLEAVED[options.schedule](self.stages, options.microbatches, loss_fn=self.objective,
                                                          scale_grads=False)
        self.aux: list[Tensor] = []  # the last stage's auxiliary term of each micro-batch of the step

    def objective(self, output: Any, targets: Tensor) -> Tensor:
        """`objective` (what the schedule's backward starts from), keeping each micro-batch's auxiliary term, which
        the loss `step` reports leaves out (the LM loss alone, as one process reports it)."""
        if not isinstance(output, Tensor):
            self.aux.append(output[1].detach().sum())
        return objective(output, targets)

    @property
    def is_last(self) -> bool:
        return self.modules[-1].is_last

    def parameters(self) -> list[Tensor]:
        """What this rank's optimizer steps: the parameters its stages use (`rank_parameters`)."""
        return rank_parameters(self.model, self.options, self.index)

    def step(self, idx: Tensor, targets: Tensor) -> StepResult:
        """One step over the batch `idx`, `targets` [B, T] (every rank passes the same; the first stage reads
        the tokens, the last the targets), the micro-batches as the schedule orders them."""
        if idx.shape[0] % self.options.microbatches:
            check_pipeline(self.model, self.options, idx.shape[0])
        for stage in self.stages:
            stage.sent_fwd = stage.sent_bwd = 0
        self.aux = []
        losses: list[Tensor] = []
        try:
            if self.index == 0:
                self.schedule.step(idx)
            elif self.is_last:
                self.schedule.step(target=targets, losses=losses)
            else:
                self.schedule.step()
        finally:
            if self.cache is not None:
                self.cache.clear()
        self.mean_grads()
        sync = self.sync_grads()
        return self.gather(losses, sync)

    @torch.no_grad()
    def mean_grads(self) -> None:
        """The micro-batches' gradients summed by the backward passes, made their mean (each parameter once)."""
        if self.options.microbatches > 1:
            for p in self.parameters():
                if p.grad is not None:
                    p.grad.div_(self.options.microbatches)

    def sync_grads(self) -> int:
        """Sum the gradients of the parameters several stages use over the ranks; returns the bytes summed."""
        m = self.model
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
        """The loss and the bytes of every stage, on every rank: boundary k - 1 (into stage k) carries stage
        k - 1's sends forward and stage k's backward; stage k runs on rank k mod S."""
        s, v = self.options.stages, self.options.virtual_stages
        loss = torch.stack(losses).detach().double().mean() if losses else torch.zeros((), dtype=torch.float64)
        if self.aux and losses:  # the LM loss: each micro-batch's objective less its auxiliary term (the last
            # len(losses) calls: on its first step the schedule also calls the loss on placeholder tensors first)
            loss = loss - torch.stack(self.aux[-len(losses):]).double().mean()
        mine = torch.tensor([*(float(st.sent_fwd) for st in self.stages), *(float(st.sent_bwd) for st in self.stages),
                             loss.item()], dtype=torch.float64)
        every = [torch.zeros_like(mine) for _ in range(s)]
        dist.all_gather(every, mine, group=self.group)
        fwd = [int(every[k % s][k // s]) for k in range(s * v)]
        bwd = [int(every[k % s][v + k // s]) for k in range(s * v)]
        return StepResult(loss=float(every[s - 1][2 * v]), bytes_fwd=fwd[:-1], bytes_bwd=bwd[1:], sync_bytes=sync)


def declared_bytes(model: Decoder, options: PipelineOptions, batch: tuple[int, int]) -> list[int]:
    """The bytes one step sends across each of the S V - 1 boundaries in one direction, from the pathway's
    declaration (`stage_state_elems`): per micro-batch, its tokens times the elements per token plus the
    elements per micro-batch, in the parameters' dtype, times the micro-batches. The gradients backward are
    the same.

    With `cross_stage_cache` (V >= 2, stage k on rank k mod S, as the interleaved schedules place them): the
    rank receiving at the boundary into stage k >= S ran stage k - S of the same micro-batch and keeps what it
    held at its end (`held`, the start of stage k - S + 1), so a variant whose state only appends (the AttnRes
    family) sends only what was appended since."""
    b, t = batch
    size = model.embed.weight.element_size()
    starts = stage_starts(model.shape.n_layers, options.modules)
    s, cached = options.stages, options.cross_stage_cache and options.virtual_stages > 1
    out = []
    for k in range(1, options.modules):
        held = starts[k - s + 1] if cached and k >= s else None
        per_token, per_mb = model.pathway.stage_state_elems(starts[k], held)
        out.append(options.microbatches * ((b // options.microbatches) * t * per_token + per_mb) * size)
    return out


def pipeline_step(pipeline: Pipeline, idx: Tensor, targets: Tensor) -> tuple[float, list[int], list[int]]:
    """(loss, bytes forward, bytes backward per boundary) of one step: `Pipeline.step` for a training loop."""
    result = pipeline.step(idx, targets)
    return result.loss, result.bytes_fwd, result.bytes_bwd
