"""What a run costs before it runs: tokens, passes over its corpus, FLOPs and GPU-hours.

    tokens per run   steps x batch_size x grad_accum x seq_len
    passes           tokens per run / the corpus's train tokens (from its manifest)
    FLOPs            6 N T + 12 L d_attn S T   (PaLM, arXiv 2204.02311, appendix B)
    GPU-hours        FLOPs / (peak x MFU) / 3600

N counts every parameter a token's matmuls touch: the backbone (the tied embedding once, as
the LM head), the norms and the residual pathway's extra parameters; T is tokens per run, L
layers, d_attn = n_heads x head_dim, S the sequence length. The attention term counts the full
S x S score matrix, as the PaLM formula does. Routing over depth adds O(sources x d) FLOPs per
site, under 1% of 6N here, but it is memory-bound: MHAR reports 0.55-0.88x baseline throughput
with fused kernels (arXiv 2607.27230), so the routing arms' hours are a lower bound.

Peak is the dense BF16 tensor-core rate of one H100 or H200 SXM (989 TFLOP/s; the H200 has the
H100's compute and more memory), and MFU defaults to 40%, what a single-GPU nanoGPT-style loop
with torch.compile and FlashAttention reaches at 100M-400M parameters. Both are arguments.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from reslab.experiments.expand import RunSpec
from reslab.models.config import ConfigError, DataConfig, RunConfig
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
DEFAULT_MFU = 0.4
CHINCHILLA_TOKENS_PER_PARAM = 20


def run_tokens(cfg: RunConfig, shape: ModelShape) -> int:
    """Tokens one run trains on: steps x batch_size x grad_accum x seq_len."""
    return cfg.train.steps * cfg.optim.batch_size * cfg.optim.grad_accum * shape.seq_len


def tokenizer_vocab(cfg: RunConfig, meta: Meta | None) -> int:
    """The tokenizer's vocabulary: the prepared corpus's, else what the config asks for."""
    if meta is not None:
        return meta.vocab_size
    return cfg.data.bpe_vocab_size if cfg.data.tokenizer == "bpe" else 257


def backbone_params(shape: ModelShape) -> int:
    """Parameters of the decoder without the residual pathway: embedding (tied LM head), attention
    (q, k, v, o and the optional per-head q/k norms), SwiGLU and the RMSNorm gains."""
    d, e = shape.d_model, shape.head_dim
    attention = d * shape.n_heads * e + 2 * d * shape.n_kv_heads * e + shape.n_heads * e * d
    attention += 2 * e if shape.qk_norm else 0
    mlp = 3 * d * shape.ffn_hidden
    norms = 2 * d
    return shape.vocab_size * d + shape.n_layers * (attention + mlp + norms) + d


def residual_params(cfg: RunConfig, shape: ModelShape) -> int:
    """The residual pathway's extra parameters, counted on the built module."""
    from reslab.models.residual import build_pathway

    return build_pathway(cfg.residual, shape).extra_params()


def train_flops(shape: ModelShape, params: int, tokens: int) -> float:
    """6 N T + 12 L d_attn S T: the matmuls forward and backward plus the attention scores."""
    d_attn = shape.n_heads * shape.head_dim
    return 6.0 * params * tokens + 12.0 * shape.n_layers * d_attn * shape.seq_len * tokens


def gpu_hours(flops: float, mfu: float = DEFAULT_MFU, peak: float = PEAK_BF16_FLOPS) -> float:
    if not 0 < mfu <= 1:
        raise ConfigError(f"mfu: must be in (0, 1], got {mfu}")
    return flops / (peak * mfu) / 3600.0


@dataclass(frozen=True, kw_only=True)
class RunBudget:
    """The cost of one run; every seed of an (arm, grid point) has the same one."""

    label: str
    corpus: str
    params: int
    tokens: int
    flops: float
    gpu_hours: float
    corpus_tokens: int | None
    max_epochs: float

    @property
    def passes(self) -> float | None:
        return None if self.corpus_tokens is None else self.tokens / self.corpus_tokens

    @property
    def tokens_per_param(self) -> float:
        return self.tokens / self.params

    @property
    def over_budget(self) -> bool:
        return self.passes is not None and self.passes > self.max_epochs * (1 + 1e-9)


def run_budget(cfg: RunConfig, label: str, meta: Meta | None, mfu: float = DEFAULT_MFU) -> RunBudget:
    shape = resolve_model(cfg.model, vocab_size=tokenizer_vocab(cfg, meta))
    params = backbone_params(shape) + residual_params(cfg, shape)
    tokens = run_tokens(cfg, shape)
    flops = train_flops(shape, params, tokens)
    return RunBudget(
        label=label, corpus=cfg.data.corpus, params=params, tokens=tokens, flops=flops,
        gpu_hours=gpu_hours(flops, mfu), corpus_tokens=None if meta is None else meta.n_train_tokens,
        max_epochs=cfg.data.max_epochs,
    )


def _corpus_meta(data: DataConfig, prepare_stdlib_corpus: bool) -> Meta | None:
    meta = prepared_meta(data)
    if meta is None and data.corpus == "stdlib" and prepare_stdlib_corpus:
        _, meta = prepare_stdlib(
            cache_root() / "data", tokenizer=data.tokenizer, bpe_vocab_size=data.bpe_vocab_size,
            val_fraction=data.val_fraction, include_tests=data.include_tests,
        )
    return meta


def study_budget(
    runs: Sequence[RunSpec], mfu: float = DEFAULT_MFU, *, prepare_stdlib_corpus: bool = False
) -> list[tuple[RunBudget, int]]:
    """One budget per (arm, grid point), with its number of runs (seeds), in run order.

    A corpus that is not prepared has unknown passes, except that with `prepare_stdlib_corpus`
    (what `run` asks) the stdlib corpus is prepared into the cache first, as the first run would.
    """
    groups: dict[tuple[str, str], list[RunSpec]] = {}
    for run in runs:
        groups.setdefault((run.arm, run.grid_key), []).append(run)
    metas: dict[str, Meta | None] = {}
    out = []
    for (arm, grid_key), members in groups.items():
        cfg = members[0].config
        data_key = repr(cfg.data)
        if data_key not in metas:
            metas[data_key] = _corpus_meta(cfg.data, prepare_stdlib_corpus)
        label = f"{arm} @ {grid_key}" if members[0].grid else arm
        out.append((run_budget(cfg, label, metas[data_key], mfu), len(members)))
    return out


def _tokens(n: float) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f}{unit}"
    return f"{n:.0f}"


def _hours(h: float) -> str:
    return f"{h:,.1f}" if h >= 10 else f"{h:.3g}"


def format_budget(budgets: Iterable[tuple[RunBudget, int]], mfu: float = DEFAULT_MFU) -> str:
    """The table `reslab plan` prints: per (arm, grid point) params, tokens per run, tokens per
    parameter, passes over the corpus and GPU-hours, then the study's total and any corpus that is
    not prepared, with the command that prepares it."""
    budgets = list(budgets)
    w = max([len(b.label) for b, _ in budgets] + [6])
    lines = [f"{'budget':<{w}} {'params':>8} {'tokens/run':>10} {'tok/param':>9} {'passes':>10} {'GPU-h/run':>9} runs"]
    missing: dict[str, None] = {}
    for b, n in budgets:
        if b.passes is None:
            passes = "unknown"
            missing[b.corpus] = None
        else:
            passes = f"{b.passes:.3g}" + (" > max" if b.over_budget else "")
        lines.append(f"{b.label:<{w}} {_tokens(b.params):>8} {_tokens(b.tokens):>10} {b.tokens_per_param:>9.1f} "
                     f"{passes:>10} {_hours(b.gpu_hours):>9} {n:>4}")
    total = sum(b.gpu_hours * n for b, n in budgets)
    n_runs = sum(n for _, n in budgets)
    lines.append(f"total: {n_runs} runs, {_hours(total)} GPU-hours on one H100/H200 "
                 f"(6NT + attention FLOPs at {mfu:.0%} MFU of {PEAK_BF16_FLOPS / 1e12:.0f} TFLOP/s)")
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
            raise ConfigError(
                f"{b.label}: data.max_epochs: a run trains {_tokens(b.tokens)} tokens, {b.passes:.3g} passes over "
                f"corpus {b.corpus!r} ({_tokens(b.corpus_tokens)} train tokens), above data.max_epochs="
                f"{b.max_epochs:g}; prepare a larger corpus, train fewer steps, or set data.max_epochs: {need:g} "
                "if the repeats are intended"
            )
        if require_prepared and b.passes is None and b.corpus != "stdlib":
            raise ConfigError(missing_corpus_message(b.corpus))


__all__ = [
    "CHINCHILLA_TOKENS_PER_PARAM", "DEFAULT_MFU", "PEAK_BF16_FLOPS", "RunBudget", "backbone_params", "check_budget",
    "corpus_lines", "format_budget", "gpu_hours", "residual_params", "run_budget", "run_tokens", "study_budget",
    "tokenizer_vocab", "train_flops",
]
