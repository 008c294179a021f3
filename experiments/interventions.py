"""A study's `interventions:` block: what is knocked out of every finished run's model on the eval windows.

    interventions:
      kinds: [sources, streams]  # sources: each source each site reads (a depth source, a block summary);
                                 # streams: each whole stream of a multi-stream variant (DAR, HC, mHC);
                                 # gates: each gate pinned (Review, MGR, DDL, Highway)
      mode: zero                 # zero | mean | [zero, mean]: a removed source (or stream) is zeroed, or replaced
                                 # by its mean over the eval windows (`models.interventions`)
      gates: [open, closed]      # optional (default both): how a gate is pinned
      sites: all                 # or a list of sublayer sites (0 .. 2L-1; 2L is the final readout)
      sources: all               # or a list of source labels (emb, s3, block1, stream0, gate, ...)
      arms: [dar, dar_shared]    # optional: the arms whose runs are intervened on (default: every arm)

Each (arm, grid point)'s pathway is built (cheap: no backbone) and the request resolved against its
`models.interventions.menu` before anything trains (`check_interventions`, called by `experiments.spec`): a
kind, site or source the variant does not have is one line naming what exists. A run's interventions cost
`count` evaluations of its eval windows (`cost`, which `reslab plan` prints).

One (run, request) is one unit of work after training (`orchestrator.attempt.intervention`) with a content id
(`intervention_id`): the run id (which carries the code version) and the request's settings, so another request
intervenes again and nothing else does.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from reslab.models.config import ConfigError, shown

if TYPE_CHECKING:
    from reslab.models.config import RunConfig

KEYS = ("kinds", "mode", "gates", "sites", "sources", "arms")
KINDS = {"sources": "source", "streams": "stream", "gates": "gate"}  # the block's word -> `Intervention.kind`
MODES = ("zero", "mean")
GATE_MODES = ("open", "closed")


@dataclass(frozen=True, kw_only=True)
class InterventionSpec:
    """What every finished run of the study's `arms` is intervened on (module docstring); None: all."""

    kinds: tuple[str, ...]  # `Intervention.kind`s: source, stream, gate
    modes: tuple[str, ...] = ("zero",)
    gate_modes: tuple[str, ...] = GATE_MODES
    sites: tuple[int, ...] | None = None
    sources: tuple[str, ...] | None = None
    arms: tuple[str, ...] | None = None

    def settings(self) -> dict[str, Any]:
        """What a unit's content id and its marker record: the request, not which arms it applies to."""
        return {"kinds": list(self.kinds), "modes": list(self.modes), "gates": list(self.gate_modes),
                "sites": None if self.sites is None else list(self.sites),
                "sources": None if self.sources is None else list(self.sources)}

    def applies(self, arm: str) -> bool:
        return self.arms is None or arm in self.arms

    def describe(self) -> str:
        kinds = ", ".join(f"{k}s" for k in self.kinds)
        modes = "/".join(self.modes)
        gates = f", gates pinned {'/'.join(self.gate_modes)}" if "gate" in self.kinds else ""
        sites = "all sites" if self.sites is None else f"sites {', '.join(map(str, self.sites))}"
        sources = "" if self.sources is None else f", sources {', '.join(self.sources)}"
        arms = "every arm" if self.arms is None else ", ".join(self.arms)
        return f"{kinds} ({modes}{gates}) at {sites}{sources}, on {arms}"


def _names(raw: Any, where: str, allowed: tuple[str, ...] | None, what: str) -> tuple[str, ...]:
    """A name or a non-empty list of distinct names (from `allowed` when given)."""
    values = [raw] if isinstance(raw, str) else raw
    allow = f"one of {', '.join(allowed)} or a list of them" if allowed else f"a non-empty list of {what}"
    if not isinstance(values, list) or not values or not all(isinstance(v, str) and v.strip() for v in values):
        raise ConfigError(f"{where}: {shown(raw)} is not allowed; allowed: {allow}")
    bad = [v for v in values if allowed is not None and v not in allowed]
    if bad:
        raise ConfigError(f"{where}: {shown(bad[0])} is not allowed; allowed: {allow}")
    if len(set(values)) != len(values):
        raise ConfigError(f"{where}: {shown(raw)} names one twice; allowed: each once")
    return tuple(values)


def _sites(raw: Any) -> tuple[int, ...] | None:
    if raw is None or raw == "all":
        return None
    ok = isinstance(raw, list) and raw and all(isinstance(s, int) and not isinstance(s, bool) and s >= 0
                                               for s in raw)
    if not ok or len(set(raw)) != len(raw):
        raise ConfigError(f"interventions.sites: {shown(raw)} is not allowed; allowed: all, or a list of distinct "
                          "sublayer sites (integers >= 0: 0 .. 2L-1, and 2L for the final readout)")
    return tuple(raw)


def parse_interventions(raw: Any, arms: list[str]) -> InterventionSpec:
    """The `interventions:` mapping's shape, every error one line naming the field; what each arm's variant
    has is checked by `check_interventions` once the study's configs are known."""
    if not isinstance(raw, dict):
        raise ConfigError(f"interventions: expected a mapping with keys {', '.join(KEYS)}, got {shown(raw)}")
    unknown = [k for k in raw if k not in KEYS]
    if unknown:
        raise ConfigError(f"interventions.{unknown[0]}: unknown key; allowed: {', '.join(KEYS)}")
    if "kinds" not in raw:
        raise ConfigError(f"interventions.kinds: missing; allowed: a list of {', '.join(KINDS)}")
    kinds = _names(raw["kinds"], "interventions.kinds", tuple(KINDS), "kinds")
    modes = _names(raw.get("mode", "zero"), "interventions.mode", MODES, "modes")
    gate_modes = _names(raw.get("gates", list(GATE_MODES)), "interventions.gates", GATE_MODES, "gate pins")
    sources = raw.get("sources")
    chosen = None if sources is None or sources == "all" else _names(sources, "interventions.sources", None,
                                                                     "source labels (e.g. [emb, s0, stream1])")
    on = None
    if raw.get("arms") is not None:
        on = _names(raw["arms"], "interventions.arms", None, "arm names")
        missing = [a for a in on if a not in arms]
        if missing:
            raise ConfigError(f"interventions.arms: {shown(missing[0])} is not an arm of the study; allowed: "
                              f"{', '.join(arms)}")
    return InterventionSpec(kinds=tuple(KINDS[k] for k in kinds), modes=modes, gate_modes=gate_modes,
                            sites=_sites(raw.get("sites")), sources=chosen, arms=on)


def _pathway(cfg: RunConfig) -> Any:
    """The run config's residual pathway alone (its parameters, no backbone): what its menu is read from."""
    from reslab.models.presets import resolve_model
    from reslab.models.residual import build_pathway

    return build_pathway(cfg.residual, resolve_model(cfg.model, vocab_size=cfg.model.vocab_size or 256))


def _modes(spec: InterventionSpec, kind: str) -> tuple[str, ...]:
    return spec.gate_modes if kind == "gate" else spec.modes


def _check_named(spec: InterventionSpec, chosen: list[Any], where: str) -> None:
    """A site or source the request names that none of its kinds has: one line naming what exists."""
    sites = sorted({i.site for i in chosen if i.site is not None})
    sources = list(dict.fromkeys(i.source for i in chosen))
    bad_sites = [s for s in spec.sites or () if s not in sites]
    if bad_sites:
        raise ConfigError(f"{where}.sites: site {bad_sites[0]} is out of range; allowed: "
                          f"{', '.join(map(str, sites)) or '(none: its interventions have no site)'}")
    bad_sources = [s for s in spec.sources or () if s not in sources]
    if bad_sources:
        raise ConfigError(f"{where}.sources: {shown(bad_sources[0])} is not a source it has; allowed: "
                          f"{', '.join(sources)}")


def resolve(spec: InterventionSpec, cfg: RunConfig, where: str = "interventions") -> list[Any]:
    """The `models.interventions.Intervention`s the request makes of a run with config `cfg`, in the menu's
    order, `check`ed by the model's own validation too. A kind, site or source the variant lacks is one line
    naming what it has. A whole stream, and a gate pinned at every site, has no site: `sites:` narrows the
    per-site interventions only."""
    from reslab.models.interventions import menu

    pathway = _pathway(cfg)
    try:
        offered = menu(pathway)
    except ConfigError as exc:  # a variant without interventions: which variants have them
        raise ConfigError(str(exc).replace("interventions", where, 1)) from None
    plural = {v: k for k, v in KINDS.items()}
    chosen: list[Any] = []
    for kind in spec.kinds:
        mine = [i for i in offered if i.kind == kind and i.mode in _modes(spec, kind)]
        if not mine:
            have = ", ".join(dict.fromkeys(plural.get(i.kind, i.kind) for i in offered)) or "(none)"
            raise ConfigError(f"{where}.kinds: variant {cfg.residual.name!r} has no {plural[kind]} to intervene "
                              f"on; it has: {have} (name the arms that have it under interventions.arms)")
        chosen += mine
    _check_named(spec, chosen, where)
    chosen = [i for i in chosen if (spec.sites is None or i.site is None or i.site in spec.sites)
              and (spec.sources is None or i.source in spec.sources)]
    if not chosen:
        raise ConfigError(f"{where}: the sites and sources asked for select no intervention of "
                          f"{cfg.residual.name!r}; allowed: a site and a source it reads there")
    _check(pathway, chosen, where)
    return chosen


def _check(pathway: Any, chosen: list[Any], where: str) -> None:
    """The model's own check of the request (`models.interventions.check`), its line naming the arm."""
    from reslab.models.interventions import check

    try:
        check(pathway, chosen)
    except ConfigError as exc:
        raise ConfigError(str(exc).replace("interventions", where, 1)) from None


def cost(spec: InterventionSpec, cfg: RunConfig) -> int:
    """Evaluations of the eval windows one run's interventions cost (`models.interventions.count`: one per
    intervention plus the unmodified pass, which also collects the means; a `sources:` list counts only the
    interventions it keeps)."""
    from reslab.models.interventions import count

    chosen = resolve(spec, cfg)
    full = count(_pathway(cfg), spec.kinds, spec.modes + spec.gate_modes, spec.sites)
    # `count` knows no sources: what the sources filter leaves out is taken off its total
    unfiltered = resolve(InterventionSpec(kinds=spec.kinds, modes=spec.modes, gate_modes=spec.gate_modes,
                                          sites=spec.sites), cfg) if spec.sources is not None else chosen
    return full - (len(unfiltered) - len(chosen))


def intervention_id(run_id: str, spec: InterventionSpec) -> str:
    """The content id of one (run, request): the run (its config and code) and the request's settings."""
    text = json.dumps({"run": run_id, "interventions": spec.settings()}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def check_configs(spec: InterventionSpec, configs: list[tuple[str, str, RunConfig]]) -> None:
    """Resolve the request against each (arm, grid point label, config) it applies to: one line for the
    first that it does not fit (`resolve`), before anything trains."""
    for arm, point, cfg in configs:
        if spec.applies(arm):
            resolve(spec, cfg, where=f"interventions (arm {arm}{' at ' + point if point else ''})")


def cost_lines(spec: InterventionSpec, runs: list[Any], per_run: int = 1) -> list[str]:
    """What `reslab plan` says of the interventions: per arm and grid point, the evaluations of the eval windows
    one run's interventions cost (`cost`), and the total over the runs; each of `runs` stands for `per_run` runs
    (the plan passes one seed's runs and the number of seeds)."""
    per: dict[tuple[str, str], tuple[int, int, int]] = {}  # (arm, grid key) -> (cost, runs, eval windows)
    for run in runs:
        if spec.applies(run.arm):
            key = (run.arm, run.grid_key)
            n = per[key][0] if key in per else cost(spec, run.config)
            per[key] = (n, (per[key][1] if key in per else 0) + per_run, run.config.train.eval_windows)
    if not per:
        return []
    lines = [f"interventions: {spec.describe()}; per run, one evaluation of its eval windows per (site, source, "
             "mode) plus one of the unmodified model (which also collects the means)"]
    for (arm, point), (n, count_, windows) in per.items():
        lines.append(f"  {arm}{' [' + point + ']' if point else ''}: {n} evaluations of {windows} eval windows per "
                     f"run x {count_} run(s)")
    total = sum(n * k for n, k, _ in per.values())
    lines.append(f"  total: {total} evaluations of the eval windows after training")
    return lines
