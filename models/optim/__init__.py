"""Optimizers and learning-rate schedules: one module per kind, registered by name, as the residual variants are.

`optim.name` picks an optimizer (`adamw`, `muon`, `adafactor`) and `optim.options` holds its knobs (the kind's
nested `Config`); `optim.schedule` picks a schedule (`cosine`, `wsd`) and `optim.schedule_options` its knobs. The
fields every kind reads stay flat in `optim` (lr, warmup_steps, min_lr_ratio, weight_decay, decay_scope, beta1,
beta2, eps, grad_clip, batch_size, grad_accum). Every module in this package but `base` is imported on first
lookup, so a new kind is a new file (`models/optim/base.py` says what it declares); nothing else changes.

Run ids hash the config's dict (`experiments.expand.run_id_of`). Before issue 50 `optim` was flat, every kind's
knobs a field of its own (`muon_momentum`, `cooldown_fraction`, ...), present whatever the kind. `hashed_optim`
gives the section that form wherever it can be written in it (the optimizer and schedule are kinds of then,
with knobs of theirs), so the ids of existing studies are unchanged; a config that names a newer kind is hashed
as it is.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

from reslab.common.errors import ConfigError
from reslab.models.config import OptimConfig, RunConfig, did_you_mean, load, to_dict
from reslab.models.optim.base import Optimizer, Schedule
from reslab.models.registry import import_modules, registrar

OPTIMIZERS: dict[str, type[Optimizer]] = {}
SCHEDULES: dict[str, type[Schedule]] = {}


register_optimizer = registrar(OPTIMIZERS, "optimizer")
register_schedule = registrar(SCHEDULES, "schedule")


def _discover() -> None:
    import_modules(__name__, __path__)


def optimizers() -> dict[str, type[Optimizer]]:
    _discover()
    return dict(sorted(OPTIMIZERS.items()))


def schedules() -> dict[str, type[Schedule]]:
    _discover()
    return dict(sorted(SCHEDULES.items()))


def get_optimizer(name: str, where: str = "optim.name") -> type[Optimizer]:
    kinds = optimizers()
    if name not in kinds:
        raise ConfigError(f"{where}: unknown optimizer {did_you_mean(str(name), kinds)}; allowed: {', '.join(kinds)}")
    return kinds[name]


def get_schedule(name: str, where: str = "optim.schedule") -> type[Schedule]:
    kinds = schedules()
    if name not in kinds:
        raise ConfigError(f"{where}: unknown schedule {did_you_mean(str(name), kinds)}; allowed: {', '.join(kinds)}")
    return kinds[name]


def _knobs(kind: type[Optimizer] | type[Schedule], options: dict[str, Any], where: str) -> Any:
    config = load(kind.Config, options, f"{where} ({kind.name})")
    errors = kind.errors(config)
    if errors:
        raise ConfigError("; ".join(f"{where}.{e}" for e in errors))
    return config


def resolve_optim(optim: OptimConfig, where: str = "optim") -> OptimConfig:
    """Check the optimizer's and the schedule's names and knobs and fill in every default."""
    kind = get_optimizer(optim.name, f"{where}.name")
    schedule = get_schedule(optim.schedule, f"{where}.schedule")
    options = to_dict(_knobs(kind, optim.options, f"{where}.options"))
    schedule_options = to_dict(_knobs(schedule, optim.schedule_options, f"{where}.schedule_options"))
    return OptimConfig(**{**optim.__dict__, "options": options, "schedule_options": schedule_options})


def optimizer_refusal(optim: OptimConfig, *, ranks: int = 1, stages: int = 1, sharding: str = "ddp",
                      where: str = "optim") -> None:
    """Raise one ConfigError when `optim.name` cannot train a run on `ranks` processes in `stages` pipeline
    stages with `sharding` (the optimizer's own `refusal`), naming the optimizers that could."""
    kind = get_optimizer(optim.name, f"{where}.name")
    allowed = [name for name, other in optimizers().items()
               if other.refusal([], ranks=ranks, stages=stages, sharding=sharding) is None]
    why = kind.refusal(allowed, ranks=ranks, stages=stages, sharding=sharding)
    if why is not None:
        raise ConfigError(f"{where}.name: {why}")


def make_optimizer(model: nn.Module, cfg: RunConfig, device: torch.device) -> torch.optim.Optimizer:
    """`optim.name`'s torch optimizer over `model`, its parameter groups the kind's own."""
    kind = get_optimizer(cfg.optim.name)
    return kind.build(model, cfg.optim, _knobs(kind, cfg.optim.options, "optim.options"), device)


def lr_at(step: int, cfg: RunConfig) -> float:
    """The learning rate at 0-based `step` of `train.steps` under `optim.schedule`."""
    kind = get_schedule(cfg.optim.schedule)
    config = _knobs(kind, cfg.optim.schedule_options, "optim.schedule_options")
    return kind.lr(step, cfg.train.steps, cfg.optim, config)


@functools.cache
def _flat_kinds() -> dict[type, tuple[str, dict[str, Any]]]:
    """Every kind that had flat fields before issue 50: (its prefix, its knobs' defaults)."""
    _discover()
    kinds: list[type[Optimizer] | type[Schedule]] = [*OPTIMIZERS.values(), *SCHEDULES.values()]
    return {kind: (kind.flat_prefix, to_dict(kind.Config())) for kind in kinds if kind.flat_prefix is not None}


def hashed_optim(plain: dict[str, Any]) -> dict[str, Any]:
    """The `optim` section (`to_dict`'s form) as the run id hashes it (module docstring): the flat form of before
    issue 50 where the config can be written in it, every flat kind's knobs (the chosen kind's values, the
    others' defaults) as the fields `<flat_prefix><knob>`; else the section as it is."""
    flat_kinds = _flat_kinds()
    chosen: dict[type | None, dict[str, Any]] = {OPTIMIZERS.get(plain["name"]): plain["options"],
                                                 SCHEDULES.get(plain["schedule"]): plain["schedule_options"]}
    for kind, options in chosen.items():
        if kind is None or kind not in flat_kinds or not set(options) <= set(flat_kinds[kind][1]):
            return plain
    flat = {k: v for k, v in plain.items() if k not in ("options", "schedule_options")}
    for kind, (prefix, defaults) in flat_kinds.items():
        knobs = {**defaults, **chosen.get(kind, {})}
        flat.update({f"{prefix}{knob}": value for knob, value in knobs.items()})
    return flat


def hashed_config(cfg: RunConfig) -> dict[str, Any]:
    """`to_dict(cfg)` with the optim section as `hashed_optim` gives it: what `run_id_of` hashes."""
    data = to_dict(cfg)
    data["optim"] = hashed_optim(data["optim"])
    return data


def same_config(recorded: dict[str, Any], current: dict[str, Any]) -> bool:
    """Whether two run configs in `to_dict`'s form are one run's: equal once each `optim` section is in the form
    the run id hashes. A run directory or checkpoint written before the registries holds the flat `optim`
    section (`optim.muon_momentum`), which is already that form, so a run interrupted then resumes now."""

    def hashed(data: dict[str, Any]) -> dict[str, Any]:
        optim = data.get("optim")
        return {**data, "optim": hashed_optim(optim)} if isinstance(optim, dict) and "options" in optim else data

    return recorded == current or hashed(recorded) == hashed(current)


__all__ = [
    "OPTIMIZERS", "SCHEDULES", "Optimizer", "Schedule", "get_optimizer", "get_schedule", "hashed_config", "same_config",
    "hashed_optim", "lr_at", "make_optimizer", "optimizer_refusal", "optimizers", "register_optimizer",
    "register_schedule", "resolve_optim", "schedules",
]
