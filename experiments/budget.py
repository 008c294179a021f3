"""What a run costs before it runs: tokens, passes over its corpus, FLOPs and GPU-hours.

    tokens per run   steps x batch_size x grad_accum x seq_len
    passes           samples per run / windows per epoch (the train split, from its manifest, cut into
                     windows of seq_len that share no target token: `epoch_tokens`)
    FLOPs            6 N T + 12 L d_attn S T   (PaLM, arXiv 2204.02311, appendix B)
    GPU-hours        FLOPs / (peak x MFU x throughput factor) / 3600

N counts every parameter a token's matmuls touch (a MoE model's active ones: top_k of each layer's
routed experts, `experiments.size.backbone_active_params`): the backbone (the tied embedding once, as
the LM head), the norms and the residual pathway's extra parameters (`experiments.size`, which
also refuses a model no run can hold); T is tokens per run, L layers, d_attn = n_heads x
head_dim, S the sequence length. The attention term counts the full S x S score matrix, as the
PaLM formula does.

MFU: anchored to a measured figure (`ANCHOR`): compiled pre-norm at gpt2-124m (d768 L12, vocab
50304, B16 x T1024) trained at about 408k tokens/s in bf16 on one H200 (issue 20's measurement;
bench/RESULTS.md has no GPU table yet: `bench/bench_training.py throughput` prints it), which is
35.3% of peak under this module's own FLOP count. The MFU at the studies' shapes is taken to be
the anchor's. Peak is the dense BF16 tensor-core rate of one H100 or H200 SXM (989 TFLOP/s; the
H200 has the H100's compute and more memory).

Throughput factor (`throughput`): an arm's training tokens/s relative to compiled pre-norm of the
same shape, and its source. Routing over depth adds under 1% of 6N in FLOPs but is memory-bound:
MHAR (arXiv 2607.27230, variants.md 2.4) trains at 0.88/0.71/0.55x the baseline's throughput with
fused kernels (0.54/0.32/0.23x through torch.compile, what `residual.impl: reference` gets) at
100M/350M/1B, i.e. 12, 24 and 36 layers; Full AttnRes is MHAR at H=1 and reads the same history.
Another depth read takes MHAR's figure at the nearest depth and scales the routing time (1/f - 1
of a pre-norm step) by its floor traffic relative to Full AttnRes's at the arm's depth: (3N + 2)
tensor rows per read of N sources, forward and backward (bench/traffic_model.py's floor), twice N
where the keys are not the values (DAR). Every other variant is assumed at 1.00x: its extra work
is matmuls the FLOP count includes (Highway, Review, seq_swa's projections; its window scores, O(w d)
per token, are left out), or it is neither measured nor modelled here
(DenseFormer, HC, mHC, MGR, DDL: hours are then a lower bound). No bench result measures a
variant on a GPU yet; a measured row would replace these figures.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from reslab.experiments.expand import RunSpec
from reslab.experiments.size import backbone_active_params, backbone_params, check_model_size, residual_params
from reslab.models.config import ConfigError, DataConfig, ModelConfig, ResidualConfig, RunConfig, load
from reslab.models.data.prepare import (
    Meta,
    cache_root,
    missing_corpus_message,
    prepare_command,
    prepare_stdlib,
    prepared_meta,
)
from reslab.models.presets import ModelShape, resolve_model

PEAK_BF16_FLOPS = 989e12  # one H100/H200 SXM, dense BF16
CHINCHILLA_TOKENS_PER_PARAM = 20


def run_tokens(cfg: RunConfig, shape: ModelShape) -> int:
    """Tokens one run trains on: steps x batch_size x grad_accum x seq_len."""
    return cfg.train.steps * cfg.optim.batch_size * cfg.optim.grad_accum * shape.seq_len


def tokenizer_vocab(cfg: RunConfig, meta: Meta | None) -> int:
    """The tokenizer's vocabulary: the prepared corpus's, else what the config asks for."""
    if meta is not None:
        return meta.vocab_size
    if cfg.data.tokenizer == "hf":  # a checkpoint's tokenizer: its model fixes model.vocab_size
        return cfg.model.vocab_size or 257
    return cfg.data.bpe_vocab_size if cfg.data.tokenizer == "bpe" else 257


def train_flops(shape: ModelShape, params: int, tokens: int) -> float:
    """6 N T + 12 L d_attn S T: the matmuls forward and backward plus the attention scores."""
    d_attn = shape.n_heads * shape.head_dim
    return 6.0 * params * tokens + 12.0 * shape.n_layers * d_attn * shape.seq_len * tokens


@dataclass(frozen=True)
class Anchor:
    """A measured training throughput of compiled pre-norm that fixes the MFU of every budget."""

    tokens_per_s: float
    preset: str
    vocab_size: int
    source: str

    @property
    def mfu(self) -> float:
        """The measured tokens/s times this module's FLOPs per token of pre-norm, over the peak."""
        shape = resolve_model(ModelConfig(preset=self.preset), vocab_size=self.vocab_size)
        return self.tokens_per_s * train_flops(shape, backbone_params(shape), 1) / PEAK_BF16_FLOPS

    def describe(self) -> str:
        return (f"{self.mfu:.1%}, anchored to a measured {self.tokens_per_s / 1e3:.0f}k tokens/s of {self.source}, "
                "under this FLOP count; taken as the MFU at every shape")


ANCHOR = Anchor(tokens_per_s=408e3, preset="gpt2-124m", vocab_size=50304,
                source="compiled pre-norm, gpt2-124m (d768 L12, vocab 50304, B16 x T1024), bf16, one H200 "
                       "(issue 20's measurement; bench/RESULTS.md has no GPU table yet)")
DEFAULT_MFU = ANCHOR.mfu  # 0.353


def gpu_hours(flops: float, mfu: float = DEFAULT_MFU, peak: float = PEAK_BF16_FLOPS, factor: float = 1.0) -> float:
    """Hours on one GPU at ``mfu`` of ``peak``, slowed to ``factor`` of pre-norm's throughput."""
    if not 0 < mfu <= 1:
        raise ConfigError(f"mfu: must be in (0, 1], got {mfu}")
    if not 0 < factor <= 1:
        raise ValueError(f"throughput factor must be in (0, 1], got {factor}")
    return flops / (peak * mfu * factor) / 3600.0


@dataclass(frozen=True)
class Throughput:
    """Training tokens/s of an arm relative to compiled pre-norm of the same shape, and where it comes from."""

    factor: float
    source: str


# MHAR (arXiv 2607.27230, variants.md 2.4), training throughput relative to the baseline:
# (scale, layers, fused Triton kernels, torch.compile)
MHAR_THROUGHPUT = (("100M", 12, 0.88, 0.54), ("350M", 24, 0.71, 0.32), ("1B", 36, 0.55, 0.23))


def depth_reads(cfg: ResidualConfig, n_layers: int) -> list[tuple[int, int]] | None:
    """(sources, tensors per source) of every depth read of one forward pass; None without a depth history:
    what the variant declares (`ResidualPathway.depth_reads`) for its knobs."""
    from reslab.models.residual import get_variant, resolve_residual

    variant = get_variant(cfg.name)
    return variant.depth_reads(load(variant.Config, resolve_residual(cfg).options), n_layers)


def _floor_traffic(reads: Iterable[tuple[int, int]]) -> int:
    """Tensor rows the reads move at the floor: N (times keys) read forward and backward, one gradient
    written per source tensor, one output written and one dout read per read."""
    return sum(3 * n * per_source + 2 for n, per_source in reads)


def throughput(cfg: ResidualConfig, shape: ModelShape) -> Throughput:
    """The arm's training throughput relative to compiled pre-norm at ``shape`` (module docstring)."""
    from reslab.models.residual import get_variant
    from reslab.models.residual.base import full_sources

    variant = get_variant(cfg.name)
    if variant.control:
        return Throughput(1.0, "pre-norm: 1.00x, the anchor's own variant")
    reads = depth_reads(cfg, shape.n_layers)
    if reads is None:
        why = variant.throughput_note or ("no bench result or paper figure, no depth read modelled: hours are a "
                                          "lower bound")
        return Throughput(1.0, f"{cfg.name}: assumed 1.00x ({why})")
    scale, layers, fused, compiled = min(MHAR_THROUGHPUT, key=lambda m: (abs(m[1] - shape.n_layers), -m[1]))
    figure, path = (compiled, "torch.compile") if cfg.impl == "reference" else (fused, "fused kernels")
    ratio = _floor_traffic(reads) / _floor_traffic((n, 1) for n in full_sources(2 * shape.n_layers + 1))
    factor = 1.0 / (1.0 + ratio * (1.0 / figure - 1.0))
    mhar = f"MHAR arXiv 2607.27230 ({path}): {figure:.2f}x pre-norm at {scale} ({layers} layers)"
    if math.isclose(ratio, 1.0, rel_tol=1e-9):
        return Throughput(factor, f"{mhar}, a full depth history")
    return Throughput(factor, f"{mhar} for a full depth history, its routing time scaled by this arm's "
                              f"floor traffic, {ratio:.2f}x Full AttnRes's (bench/traffic_model.py's floor)")


@dataclass(frozen=True, kw_only=True)
class RunBudget:
    """The cost of one run; every seed of an (arm, grid point) has the same one."""

    label: str
    corpus: str
    params: int
    tokens: int
    flops: float
    gpu_hours: float
    corpus_tokens: int | None  # the train split's
    seq_len: int
    max_epochs: float
    throughput: Throughput = Throughput(1.0, "pre-norm: 1.00x, the anchor's own variant")
    # a MoE model's every parameter, where `params` (FLOPs, tokens/param) counts the active ones; None: dense
    total_params: int | None = None
    # the tokens of the stream before the run's first sample (`train.data_offset` samples x seq_len): a run that
    # continues a checkpoint of N steps starts where it stopped, and the two together read the stream that far
    offset_tokens: int = 0

    @property
    def passes(self) -> float | None:
        """Passes over the train split the data stream has made by the run's last sample: its offset
        (`train.data_offset`, what the run it continues read) plus its own tokens."""
        if self.corpus_tokens is None:
            return None
        return (self.offset_tokens + self.tokens) / epoch_tokens(self.corpus_tokens, self.seq_len)

    @property
    def tokens_per_param(self) -> float:
        return self.tokens / self.params

    @property
    def over_budget(self) -> bool:
        return self.passes is not None and self.passes > self.max_epochs * (1 + 1e-9)


def run_budget(cfg: RunConfig, label: str, meta: Meta | None, mfu: float = DEFAULT_MFU) -> RunBudget:
    shape = resolve_model(cfg.model, vocab_size=tokenizer_vocab(cfg, meta))
    check_model_size(shape, None, label)
    extra = residual_params(cfg, shape)
    check_model_size(shape, backbone_params(shape) + extra, label)
    params = backbone_active_params(shape) + extra  # a MoE model's FLOPs and tokens/param: active parameters
    tokens = run_tokens(cfg, shape)
    flops = train_flops(shape, params, tokens)
    speed = throughput(cfg.residual, shape)
    return RunBudget(
        label=label, corpus=cfg.data.corpus, params=params, tokens=tokens, flops=flops,
        gpu_hours=gpu_hours(flops, mfu, factor=speed.factor), throughput=speed,
        corpus_tokens=None if meta is None else meta.n_train_tokens, seq_len=shape.seq_len,
        max_epochs=cfg.data.max_epochs, total_params=None if shape.moe is None else backbone_params(shape) + extra,
        offset_tokens=cfg.train.data_offset * shape.seq_len,
    )


def epoch_tokens(n_train_tokens: int, seq_len: int) -> int:
    """The target tokens one epoch trains on: the train split cut into windows that share no target
    (`models.data.dataset`), so passes = samples / windows per epoch, exactly."""
    return (n_train_tokens - 1) // seq_len * seq_len


def _corpus_meta(data: DataConfig, prepare_stdlib_corpus: bool) -> Meta | None:
    meta = prepared_meta(data)
    if meta is None and data.corpus == "stdlib" and prepare_stdlib_corpus:
        _, meta = prepare_stdlib(
            cache_root() / "data", tokenizer=data.tokenizer, bpe_vocab_size=data.bpe_vocab_size,
            val_fraction=data.val_fraction, include_tests=data.include_tests, tokenizer_path=data.tokenizer_path,
        )
    return meta


def budgets_by_point(
    runs: Sequence[RunSpec], mfu: float = DEFAULT_MFU, *, prepare_stdlib_corpus: bool = False
) -> dict[tuple[str, str], tuple[RunBudget, int]]:
    """(arm, grid key) -> its budget and its number of runs (seeds), in run order.

    A corpus that is not prepared has unknown passes, except that with `prepare_stdlib_corpus`
    (what `run` asks) the stdlib corpus is prepared into the cache first, as the first run would.
    """
    groups: dict[tuple[str, str], list[RunSpec]] = {}
    for run in runs:
        groups.setdefault((run.arm, run.grid_key), []).append(run)
    metas: dict[str, Meta | None] = {}
    out = {}
    for (arm, grid_key), members in groups.items():
        cfg = members[0].config
        data_key = repr(cfg.data)
        if data_key not in metas:
            metas[data_key] = _corpus_meta(cfg.data, prepare_stdlib_corpus)
        label = f"{arm} @ {grid_key}" if members[0].grid else arm
        out[arm, grid_key] = (run_budget(cfg, label, metas[data_key], mfu), len(members))
    return out


def study_budget(
    runs: Sequence[RunSpec], mfu: float = DEFAULT_MFU, *, prepare_stdlib_corpus: bool = False
) -> list[tuple[RunBudget, int]]:
    """One budget per (arm, grid point), with its number of runs (seeds), in run order (see
    `budgets_by_point`)."""
    return list(budgets_by_point(runs, mfu, prepare_stdlib_corpus=prepare_stdlib_corpus).values())


def _span(values: Sequence[float], show: Callable[[float], str]) -> str:
    low, high = show(min(values)), show(max(values))
    return low if low == high else f"{low}-{high}"


def format_ladder(rungs: Sequence[tuple[str, Sequence[tuple[RunBudget, int]]]], gpus: bool = True) -> str:
    """The ladder's cost per rung for `reslab plan`: params, tokens and training FLOPs per run
    (the range over arms and grid points: routing adds parameters and FLOPs), runs and GPU-hours
    of the rung, and the running total (a ladder's top rung usually costs most of it); FLOPs in
    place of GPU-hours for a study that trains on CPUs (not `gpus`)."""
    w = max([len(label) for label, _ in rungs] + [4])
    cost, show = ("GPU-h", _hours) if gpus else ("FLOPs", lambda f: f"{f:.3g}")
    lines = [f"{'rung':<{w}} {'params':>15} {'tokens/run':>10} {'FLOPs/run':>17} {'runs':>5} {cost:>9} "
             f"{'cumulative':>10}"]
    total = 0.0
    for label, budgets in rungs:
        spent = sum((b.gpu_hours if gpus else b.flops) * n for b, n in budgets)
        total += spent
        lines.append(
            f"{label:<{w}} {_span([b.params for b, _ in budgets], _tokens):>15} "
            f"{_span([b.tokens for b, _ in budgets], _tokens):>10} "
            f"{_span([b.flops for b, _ in budgets], lambda f: f'{f:.3g}'):>17} {sum(n for _, n in budgets):>5} "
            f"{show(spent):>9} {show(total):>10}")
    return "\n".join(lines)


def _makespan(hours: list[float], slots: int) -> float:
    """Hours until the last of runs of these durations ends on `slots` parallel slots, longest first onto the
    least busy slot (LPT: within 4/3 of the best schedule). Slots beyond the runs stay idle, so at most one
    per run is kept (a cluster of 10^6 GPUs costs no more than its runs)."""
    busy = [0.0] * max(1, min(slots, len(hours)))  # a heap: the least busy slot first
    for h in sorted(hours, reverse=True):
        heapq.heapreplace(busy, busy[0] + h)
    return max(busy)


def wall_clock_hours(budgets: Sequence[tuple[RunBudget, int]], gpus_per_run: int, at_once: int) -> float:
    """Hours the runs of `budgets` take on a cluster that holds `at_once` of them, each run's GPU-hours spread over
    its `gpus_per_run` ranks at linear scaling (`format_placement`'s wall-clock)."""
    return _makespan([b.gpu_hours / gpus_per_run for b, n in budgets for _ in range(n)], at_once)


def format_placement(rungs: Sequence[tuple[str, Sequence[tuple[RunBudget, int]]]], gpus_per_run: int,
                     cluster_gpus: int | None) -> str:
    """How the runs sit on a cluster for `reslab plan`: GPUs (ranks) per run and, for a cluster of
    `cluster_gpus`, the runs at once (whole runs only: a run's ranks start together) and the wall-clock
    per rung (the study's runs when it has no ladder), each run's GPU-hours spread over its ranks at
    linear data-parallel scaling (`bench/bench_ddp.py` measures the real factor)."""
    mode = "one process" if gpus_per_run == 1 else f"{gpus_per_run} data-parallel ranks (Ray Train; DDP or FSDP2)"
    lines = [f"placement: each run on {gpus_per_run} GPU(s) as {mode}"]
    if cluster_gpus is None:
        return "\n".join(lines + ["(--cluster-gpus N sizes the wall-clock for a cluster of N GPUs)"])
    at_once = cluster_gpus // gpus_per_run
    if at_once == 0:
        return "\n".join(lines + [f"a cluster of {cluster_gpus} GPU(s) cannot hold one run of {gpus_per_run} GPUs; "
                                  "lower --gpus-per-run or raise --cluster-gpus"])
    lines.append(f"cluster of {cluster_gpus} GPU(s): {at_once} run(s) at once "
                 f"({cluster_gpus - at_once * gpus_per_run} GPU(s) idle); wall-clock at linear scaling:")
    w = max([len(label) for label, _ in rungs] + [4])
    lines.append(f"{'rung':<{w}} {'runs':>5} {'hours/run':>10} {'wall-clock h':>12} {'cumulative':>10}")
    total = 0.0
    for label, budgets in rungs:
        hours = [b.gpu_hours / gpus_per_run for b, n in budgets for _ in range(n)]
        wall = wall_clock_hours(budgets, gpus_per_run, at_once)
        total += wall
        lines.append(f"{label:<{w}} {len(hours):>5} {_span(hours, _hours):>10} {_hours(wall):>12} "
                     f"{_hours(total):>10}")
    return "\n".join(lines)


def _tokens(n: float) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f}{unit}"
    return f"{n:.0f}"


def _hours(h: float) -> str:
    return f"{h:,.1f}" if h >= 10 else f"{h:.3g}"


CPU_NOTE = ("trains on CPUs (train.device cpu, or auto with no GPU in sight): no GPU-hours; --gpus-per-run N "
            "or --cluster-gpus N sizes it on H100/H200s")


def format_budget(budgets: Iterable[tuple[RunBudget, int]], mfu: float = DEFAULT_MFU, gpus: bool = True) -> str:
    """The table `reslab plan` prints: per (arm, grid point) params, tokens per run, tokens per
    parameter, passes over the corpus, throughput relative to pre-norm with its source (a note
    number), GPU-hours per run and for all its seeds; then the study's total with the MFU anchor,
    the notes, and any corpus that is not prepared, with the command that prepares it. A study that
    trains on CPUs (not `gpus`) gets its training FLOPs in place of the speed and GPU-hours."""
    budgets = list(budgets)
    w = max([len(b.label) for b, _ in budgets] + [6])
    notes: dict[str, int] = {}
    cost = f"{'speed':>6} {'GPU-h/run':>9} {'runs':>4} {'GPU-h':>8}  speed from" if gpus else \
        f"{'FLOPs/run':>9} {'runs':>4} {'FLOPs':>8}"
    lines = [f"{'budget':<{w}} {'params':>8} {'tokens/run':>10} {'tok/param':>9} {'passes':>10} {cost}"]
    missing: dict[str, None] = {}
    for b, n in budgets:
        if b.passes is None:
            passes = "unknown"
            missing[b.corpus] = None
        else:
            passes = f"{b.passes:.3g}" + (" > max" if b.over_budget else "")
        row = f"{b.label:<{w}} {_tokens(b.params):>8} {_tokens(b.tokens):>10} {b.tokens_per_param:>9.1f} {passes:>10} "
        if gpus:
            note = notes.setdefault(b.throughput.source, len(notes) + 1)
            lines.append(row + f"{b.throughput.factor:>5.2f}x {_hours(b.gpu_hours):>9} {n:>4} "
                               f"{_hours(b.gpu_hours * n):>8}  [{note}]")
        else:
            lines.append(row + f"{b.flops:>9.3g} {n:>4} {b.flops * n:>8.3g}")
    n_runs = sum(n for _, n in budgets)
    if gpus:
        total = sum(b.gpu_hours * n for b, n in budgets)
        lines.append(f"total: {n_runs} runs, {_hours(total)} GPU-hours on one H100/H200 (6NT + attention FLOPs at "
                     f"{mfu:.1%} MFU of {PEAK_BF16_FLOPS / 1e12:.0f} TFLOP/s, each arm at its speed: training "
                     "tokens/s relative to compiled pre-norm of its shape)")
        lines.append(f"MFU: {ANCHOR.describe()}" if math.isclose(mfu, ANCHOR.mfu) else "MFU: given, not the anchor's")
        lines += [f"speed [{i}]: {source}" for source, i in notes.items()]
    else:
        lines.append(f"total: {n_runs} runs, {sum(b.flops * n for b, n in budgets):.3g} training FLOPs (6NT + "
                     f"attention); the study {CPU_NOTE}")
    moe = [f"{b.label} {_tokens(b.params)} of {_tokens(b.total_params)}" for b, _ in budgets if b.total_params]
    if moe:
        lines.append("MoE: params, FLOPs and tok/param count the active parameters (top_k routed experts), of all: "
                     + ", ".join(moe))
    for b, _ in budgets:
        if b.over_budget:
            lines.append(f"over budget: {b.label} makes {b.passes:.3g} passes over corpus {b.corpus!r} "
                         f"({_tokens(b.corpus_tokens or 0)} train tokens), above data.max_epochs={b.max_epochs:g}")
    for corpus in missing:
        where = "prepared on first use; size unknown until then" if corpus == "stdlib" else "not prepared"
        lines.append(f"corpus {corpus!r}: {where} (passes unknown)"
                     + ("" if corpus == "stdlib" else f"; prepare it with: {prepare_command(corpus)}"))
    return "\n".join(lines)


def corpus_lines(budgets: Iterable[tuple[RunBudget, int]]) -> list[str]:
    """One line per corpus for `reslab validate`: its train tokens and the most passes a run makes
    over it, or that it is not prepared and the command that prepares it."""
    by_corpus: dict[str, list[RunBudget]] = {}
    for b, _ in budgets:
        by_corpus.setdefault(b.corpus, []).append(b)
    lines = []
    for corpus, group in by_corpus.items():
        worst = max(group, key=lambda b: (b.passes or 0.0, b.tokens))
        if worst.passes is None:
            lines.append(f"corpus {corpus!r}: " + ("prepared on first use" if corpus == "stdlib" else
                         f"not prepared; prepare it with: {prepare_command(corpus)}"))
        else:
            lines.append(f"corpus {corpus!r}: {_tokens(worst.corpus_tokens or 0)} train tokens; the longest run "
                         f"({worst.label}) makes {worst.passes:.3g} passes (data.max_epochs {worst.max_epochs:g})")
    return lines


def check_budget(budgets: Iterable[tuple[RunBudget, int]], *, require_prepared: bool) -> None:
    """Raise a ConfigError naming `data.max_epochs` for the first run above it; with
    `require_prepared` (what `run` asks) also for a corpus that is not prepared."""
    for b, _ in budgets:
        if b.over_budget:
            assert b.passes is not None and b.corpus_tokens is not None
            need = math.ceil(b.passes * 100) / 100
            offset = f" after train.data_offset's {_tokens(b.offset_tokens)}" if b.offset_tokens else ""
            raise ConfigError(
                f"{b.label}: data.max_epochs: a run trains {_tokens(b.tokens)} tokens{offset}, {b.passes:.3g} passes "
                f"over corpus {b.corpus!r} ({_tokens(b.corpus_tokens)} train tokens), above data.max_epochs="
                f"{b.max_epochs:g}; prepare a larger corpus, train fewer steps, or set data.max_epochs: {need:g} "
                "if the repeats are intended"
            )
        if require_prepared and b.passes is None and b.corpus != "stdlib":
            raise ConfigError(missing_corpus_message(b.corpus))


__all__ = [
    "ANCHOR", "Anchor", "CHINCHILLA_TOKENS_PER_PARAM", "CPU_NOTE", "DEFAULT_MFU", "MHAR_THROUGHPUT", "PEAK_BF16_FLOPS",
    "RunBudget", "Throughput", "backbone_params", "budgets_by_point", "check_budget", "corpus_lines",
    "depth_reads", "format_budget", "format_ladder", "format_placement", "gpu_hours", "residual_params", "run_budget",
    "run_tokens", "study_budget", "throughput", "tokenizer_vocab", "train_flops",
]
