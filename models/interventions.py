"""Interventions on a trained model (issue 36): the change in held-out loss when one source a
site reads is removed, a whole stream is removed from every read, or a gate is pinned.

An `Intervention` names what is done:

    kind "source"  one source at one site: `site` 0..2L-1 (a sublayer; even sites attention, odd
                   MLP) or 2L (the final readout), `source` a label of that site's read
                   ("emb", "s3" = the output of site 3, "block1", "partial", "stream0", "a.s3", ...);
    kind "stream"  one stream removed from every read of it (`site` None): multi-stream variants;
    kind "gate"    the gate of `site` (None: every gated site at once) pinned to 1 ("open") or 0
                   ("closed"): gated variants;

and `mode` is "zero" (the source is removed; a read that normalises its weights renormalises over
the rest, a softmax read as if its logit were -inf) or "mean" (its value is replaced by its mean
over every token of the eval windows, as that site read it; its weight is then computed from that
value as the variant computes it) for sources and streams, "open" or "closed" for gates. What
exactly each variant removes is in its module docstring ("Interventions").

`menu(pathway, mode=None)` lists every intervention the variant supports, in site order (site
None last), every mode unless `mode` picks one; `check` refuses a request with one line naming
what exists; `effects` evaluates the model once unmodified (the base loss, collecting the sources'
means when a "mean" intervention is asked for) and once per intervention over the same batches;
`count` is the number of evaluations of the eval windows a request costs (its menu entries plus
the unmodified pass).

The pathway applies the intervention itself: `effects` sets an `InterventionHook` as the pathway's
`intervention` (as `Decoder.recorded_pass` sets its `recorder`) and each variant consults it where it
reads its sources (`ResidualPathway.softmax_sources`, `linear_sources`, `remove_terms`, `gate_pin`);
the backbone is not involved and the training forward, with no hook set, is unchanged. The fused
kernels (`impl="triton"`) are refused: build the model with `impl="reference"` (same weights).

Support (`supporting(kind)` lists it from the variants' `intervention_kinds`): sources in every
variant but `seq_swa` and the gate-only review, highway and ddl; streams in dar, hyper_connections,
mhc and mgr; gates in review, highway, ddl and mgr. `seq_swa` (a window over tokens) has none.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from reslab.common.errors import ConfigError
from reslab.models.residual import variants
from reslab.models.residual.base import GATE_MODES, SOURCE_MODES, InterventionHook, ResidualPathway

KINDS = ("source", "stream", "gate")


@dataclass(frozen=True)
class Intervention:
    kind: str          # "source" (one source at one site) | "stream" (one stream everywhere) | "gate"
    site: int | None   # 0..2L-1 sublayer site, 2L the final readout; None for "stream" / all-sites gates
    source: str        # a label from `menu(model)`: "emb", "s3", "block1", "stream0", "gate", ...
    mode: str          # "zero" | "mean" for sources and streams; "open" | "closed" for gates

    def describe(self) -> str:
        where = "every site" if self.site is None else f"site {self.site}"
        return f"{self.kind} {self.source!r} at {where}, mode {self.mode!r}"


def modes_of(kind: str) -> tuple[str, ...]:
    return GATE_MODES if kind == "gate" else SOURCE_MODES


def supporting(kind: str) -> list[str]:
    """The registered variants that support interventions of `kind`."""
    return [name for name, cls in variants().items() if kind in cls.intervention_kinds]


def _unsupported(pathway: ResidualPathway, kind: str) -> ConfigError:
    return ConfigError(
        f"interventions: variant {pathway.name!r} supports no {kind!r} interventions "
        f"(it supports: {', '.join(pathway.intervention_kinds) or 'none'}); {kind!r} is supported by "
        f"{', '.join(supporting(kind)) or 'no variant'}"
    )


def _targets(pathway: ResidualPathway) -> list[tuple[str, int | None, str]]:
    """(kind, site, source) of every intervention the variant supports, in menu order."""
    kinds, sites = pathway.intervention_kinds, pathway.shape.n_sites
    gates = set(pathway.gate_sites()) if "gate" in kinds else set()
    out: list[tuple[str, int | None, str]] = []
    for site in range(sites + 1):
        if "source" in kinds:
            out += [("source", site, label) for label in pathway.source_labels(site)]
        if site in gates:
            out.append(("gate", site, "gate"))
    if "stream" in kinds:
        out += [("stream", None, label) for label in pathway.stream_labels()]
    if gates:
        out.append(("gate", None, "gate"))
    return out


def menu(pathway: ResidualPathway, mode: str | None = None) -> list[Intervention]:
    """Every intervention `pathway`'s variant supports: per site 0..2L its sources and its gate, then
    the whole-stream and all-sites entries (site None); each in every mode of its kind, or only in
    `mode`. A variant without interventions raises ConfigError naming the variants that have them."""
    if not pathway.intervention_kinds:
        raise ConfigError(
            f"interventions: variant {pathway.name!r} supports none; sources: {', '.join(supporting('source'))}; "
            f"streams: {', '.join(supporting('stream'))}; gates: {', '.join(supporting('gate'))}"
        )
    if mode is not None and mode not in SOURCE_MODES + GATE_MODES:
        raise ConfigError(f"interventions.mode: {mode!r} is not a mode; allowed: "
                          f"{', '.join(SOURCE_MODES + GATE_MODES)}")
    return [Intervention(kind, site, source, m) for kind, site, source in _targets(pathway)
            for m in modes_of(kind) if mode is None or m == mode]


def _explain(pathway: ResidualPathway, asked: Intervention) -> ConfigError:
    """The one-line error for `asked`, which is not on the menu: what exists where it went wrong."""
    head = f"interventions: {asked.describe()} does not exist for variant {pathway.name!r}"
    last = pathway.shape.n_sites
    if asked.kind not in KINDS:
        return ConfigError(f"{head}: kind must be one of {', '.join(pathway.intervention_kinds)}")
    if asked.kind not in pathway.intervention_kinds:
        return _unsupported(pathway, asked.kind)
    if asked.mode not in modes_of(asked.kind):
        return ConfigError(f"{head}: modes of a {asked.kind} are {', '.join(modes_of(asked.kind))}")
    if asked.kind == "stream":
        if asked.site is not None:
            return ConfigError(f"{head}: a stream intervention has site None (it removes every read)")
        return ConfigError(f"{head}: streams are {', '.join(pathway.stream_labels())}")
    if asked.kind == "gate":
        gated = ", ".join(str(s) for s in pathway.gate_sites())
        return ConfigError(f"{head}: gated sites are {gated} or None (all), source 'gate'")
    if asked.site is None or not 0 <= asked.site <= last:
        return ConfigError(f"{head}: sites are 0..{last} ({last} = the final readout)")
    labels = pathway.source_labels(asked.site)
    return ConfigError(f"{head}: site {asked.site} reads {', '.join(labels) or 'no source it can remove'}")


def check(pathway: ResidualPathway, requested: Sequence[Intervention]) -> None:
    """Raise ConfigError (one line: what was asked, what exists) for the first request `pathway`'s
    variant does not support, or when its reads run on the fused kernels."""
    if getattr(pathway, "impl", "reference") != "reference":
        raise ConfigError(f"interventions: variant {pathway.name!r} runs with impl={pathway.impl!r}; interventions "
                          "run on impl='reference' only (load the same checkpoint with residual.impl: reference)")
    if not requested:
        return
    available = set(menu(pathway))
    for asked in requested:
        if asked not in available:
            raise _explain(pathway, asked)


def count(pathway: ResidualPathway, kinds: Iterable[str], mode: str | Sequence[str],
          sites: Iterable[int] | None = None) -> int:
    """Evaluations of the eval windows that `effects` needs for every menu entry of a kind in `kinds`,
    a mode in `mode` (one or several) and a site in `sites` (None: all; entries of site None, the
    whole-stream and all-sites ones, are counted whatever `sites` says), plus the unmodified pass
    (which also collects the means); 0 when nothing matches."""
    kinds, modes = set(kinds), {mode} if isinstance(mode, str) else set(mode)
    wanted = None if sites is None else set(sites)
    n = sum(1 for i in menu(pathway) if i.kind in kinds and i.mode in modes
            and (i.site is None or wanted is None or i.site in wanted))
    return n + 1 if n else 0


def _loss(model: nn.Module, batches: Sequence[Any], autocast: Callable[[], Any] | None,
          hook: InterventionHook | None) -> tuple[float, int]:
    """The token-weighted mean next-token loss over `batches` with `hook` as the pathway's intervention."""
    device = next(model.parameters()).device
    pathway: ResidualPathway = model.pathway  # type: ignore[assignment]
    total, tokens = 0.0, 0
    pathway.intervention = hook
    try:
        for x, y in batches:
            with autocast() if autocast is not None else contextlib.nullcontext():
                loss = model(x.to(device), y.to(device)).loss
            total += float(loss) * y.numel()
            tokens += y.numel()
    finally:
        pathway.intervention = None
    return total / tokens, tokens


@torch.no_grad()
def effects(model: nn.Module, batches: Sequence[Any], interventions: Sequence[Intervention], *,
            autocast: Callable[[], Any] | None = None) -> list[dict[str, Any]]:
    """One row per intervention: {kind, site, source, mode, loss, base_loss, delta, tokens}, with
    `loss` and `base_loss` the token-weighted mean next-token loss (nats) over `batches` ((inputs,
    targets) pairs, as `models.training.evaluate` takes them) with and without the intervention,
    `delta = loss - base_loss`. `autocast`: a callable returning the context every forward runs in
    (the trainer's `autocast`), None for none. The model is evaluated in eval mode and left as it was."""
    pathway: ResidualPathway = model.pathway  # type: ignore[assignment]
    check(pathway, interventions)
    batches = list(batches)
    if not batches:
        raise ConfigError("interventions: no eval batches to evaluate on")
    was_training = model.training
    model.eval()
    try:
        collect = InterventionHook.collecting() if any(i.mode == "mean" for i in interventions) else None
        base_loss, tokens = _loss(model, batches, autocast, collect)
        means = collect.collected_means() if collect is not None else {}
        rows = []
        for asked in interventions:
            hook = InterventionHook(asked.kind, asked.site, asked.source, asked.mode, means)
            loss, _ = _loss(model, batches, autocast, hook)
            rows.append({**asdict(asked), "loss": loss, "base_loss": base_loss, "delta": loss - base_loss,
                         "tokens": tokens})
    finally:
        model.train(was_training)
    return rows
