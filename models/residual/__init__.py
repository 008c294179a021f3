"""Residual pathways: one module per variant, registered by name.

Every module in this package is imported on first lookup, so a new variant is a new file with
an `@register("name")` class; nothing else changes.
"""

from __future__ import annotations

import importlib
import pkgutil

from reslab.models.config import ConfigError, ResidualConfig, RunConfig, did_you_mean, load, to_dict
from reslab.models.presets import ModelShape, resolve_model
from reslab.models.residual.base import ResidualPathway, RoutingRecorder

REGISTRY: dict[str, type[ResidualPathway]] = {}
_DISCOVERED = False


def register(name: str):
    def wrap(cls: type[ResidualPathway]) -> type[ResidualPathway]:
        if name in REGISTRY and REGISTRY[name] is not cls:
            raise ValueError(f"residual variant {name!r} is registered twice ({REGISTRY[name]} and {cls})")
        cls.name = name
        REGISTRY[name] = cls
        return cls

    return wrap


def _discover() -> None:
    global _DISCOVERED
    if _DISCOVERED:
        return
    for info in pkgutil.iter_modules(__path__):
        if info.name not in ("base",) and not info.name.startswith("_"):
            importlib.import_module(f"{__name__}.{info.name}")
    _DISCOVERED = True


def variants() -> dict[str, type[ResidualPathway]]:
    _discover()
    return dict(sorted(REGISTRY.items()))


def get_variant(name: str, where: str = "residual.name") -> type[ResidualPathway]:
    _discover()
    if name not in REGISTRY:
        raise ConfigError(f"{where}: unknown residual variant {did_you_mean(str(name), REGISTRY)}; "
                          f"allowed: {', '.join(sorted(REGISTRY))}")
    return REGISTRY[name]


def control() -> str:
    """The name of the control variant (the one declaring `control`), the baseline every study compares against."""
    names = [name for name, cls in variants().items() if cls.control]
    if len(names) != 1:
        raise RuntimeError(f"exactly one residual variant must declare control = True; found {names}")
    return names[0]


def resolve_residual(cfg: ResidualConfig, where: str = "residual") -> ResidualConfig:
    """Check the knobs against the variant's Config and fill in every default."""
    cls = get_variant(cfg.name, f"{where}.name")
    knobs = load(cls.Config, cfg.options, f"{where}.options ({cfg.name})")
    return ResidualConfig(name=cfg.name, options=to_dict(knobs), impl=cfg.impl)


def check_pathway_shape(cfg: ResidualConfig, shape: ModelShape, where: str = "residual") -> None:
    """Raise one ConfigError listing every knob of `cfg` that does not fit the model `shape`
    (`ResidualPathway.check_shape`), each named by its field path under `where`."""
    cls = get_variant(cfg.name, f"{where}.name")
    knobs = load(cls.Config, cfg.options, f"{where}.options ({cfg.name})")
    errors = cls.check_shape(knobs, shape)
    if errors:
        raise ConfigError("; ".join(f"{where}.options.{e}" for e in errors))


def check_run_shape(cfg: RunConfig, where: str = "config") -> None:
    """`check_pathway_shape` for a RunConfig: its residual knobs against its resolved model."""
    shape = resolve_model(cfg.model, vocab_size=cfg.model.vocab_size or 256, where=f"{where}.model")
    check_pathway_shape(cfg.residual, shape, f"{where}.residual")


def build_pathway(cfg: ResidualConfig, shape, impl: str = "reference") -> ResidualPathway:
    cls = get_variant(cfg.name)
    knobs = load(cls.Config, cfg.options, f"residual.options ({cfg.name})")
    return cls(knobs, shape, impl=impl)


__all__ = [
    "REGISTRY", "ResidualPathway", "RoutingRecorder", "build_pathway", "check_pathway_shape", "check_run_shape",
    "control",
    "get_variant",
    "register", "resolve_residual", "variants",
]
