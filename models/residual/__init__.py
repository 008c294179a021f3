"""Residual pathways: one module per variant, registered by name.

Every module in this package is imported on first lookup, so a new variant is a new file with
an `@register("name")` class; nothing else changes.

Variants from outside the package (issue 53) come two ways, both resolved here so that everything that
looks a variant up (validate, plan, training, decoding, stages, costs, `reslab check`) gets them:
- an entry point of the group `reslab.variants` (`[project.entry-points."reslab.variants"]` in the
  package's pyproject: `my_pathway = "my_pkg.my_module:MyPathway"`), named like an in-tree variant;
- a path, `residual.name: "my_pkg.my_module:MyPathway"`, importing that module from `sys.path`.
The class must subclass `ResidualPathway`; it is registered under the name it was asked by.
`external_sources()` names the source of every external variant this process resolved: the code a
submission ships to its Ray workers and hashes into its code version.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import sys
from pathlib import Path

from reslab.models.config import ConfigError, ResidualConfig, RunConfig, did_you_mean, load, to_dict
from reslab.models.presets import ModelShape, resolve_model
from reslab.models.registry import import_modules, registrar
from reslab.models.residual.base import ResidualPathway, RoutingRecorder

REGISTRY: dict[str, type[ResidualPathway]] = {}
ENTRY_POINT_GROUP = "reslab.variants"
# the variants resolved from outside the package (entry points and paths), by the name they were asked by
EXTERNAL: dict[str, type[ResidualPathway]] = {}


register = registrar(REGISTRY, "residual variant")


def _discover() -> None:
    import_modules(__name__, __path__)


def _entry_points() -> dict[str, importlib.metadata.EntryPoint]:
    return {ep.name: ep for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)}


def variants() -> dict[str, type[ResidualPathway]]:
    """Every in-tree variant and every entry point of the `reslab.variants` group, by name."""
    _discover()
    found = dict(REGISTRY)
    for name in _entry_points():
        if name not in found:
            found[name] = get_variant(name)
    return dict(sorted(found.items()))


def get_variant(name: str, where: str = "residual.name") -> type[ResidualPathway]:
    _discover()
    if name in REGISTRY:
        return REGISTRY[name]
    if name not in EXTERNAL:
        cls = _external(str(name), where)
        if cls is None:
            allowed = sorted({*REGISTRY, *_entry_points()})
            raise ConfigError(f"{where}: unknown residual variant {did_you_mean(str(name), allowed)}; "
                              f"allowed: {', '.join(allowed)}, an entry point of the {ENTRY_POINT_GROUP!r} group, "
                              "or a path pkg.module:Class")
        EXTERNAL[name] = cls
    return EXTERNAL[name]


def _external(name: str, where: str) -> type[ResidualPathway] | None:
    """The class a path `pkg.module:Class` or an entry point `name` names (None: neither)."""
    if ":" in name:
        module, _, attr = name.partition(":")
        origin = f"path {name!r}"
    else:
        ep = _entry_points().get(name)
        if ep is None:
            return None
        module, _, attr = ep.value.partition(":")
        origin = f"entry point {name!r} ({ENTRY_POINT_GROUP}: {ep.value})"
    if not module or not attr or not all(part.isidentifier() for part in [*module.split("."), *attr.split(".")]):
        raise ConfigError(f"{where}: {origin} is not pkg.module:Class")
    try:
        obj: object = importlib.import_module(module)
    except Exception as exc:  # any import failure of user code is this field's error, in one line
        raise ConfigError(f"{where}: {origin}: cannot import module {module!r} ({type(exc).__name__}: "
                          f"{str(exc).splitlines()[0] if str(exc) else ''}); install its package on every node "
                          "or put it on PYTHONPATH") from None
    for part in attr.split("."):
        obj = getattr(obj, part, None)
    if not (isinstance(obj, type) and issubclass(obj, ResidualPathway)):
        raise ConfigError(f"{where}: {origin}: {module}.{attr} is {'missing' if obj is None else type(obj).__name__}; "
                          "expected a subclass of reslab.models.residual.base.ResidualPathway")
    if not obj.name:
        obj.name = name
    return obj


def external_sources() -> dict[str, Path]:
    """{top-level module: its source (a package folder or one .py file)} of every external variant this process
    resolved: what a submission ships to Ray workers and hashes into the code version."""
    out: dict[str, Path] = {}
    for cls in EXTERNAL.values():
        top = cls.__module__.split(".")[0]
        if top == "reslab" or top in out:
            continue
        module = sys.modules.get(top)
        paths = list(getattr(module, "__path__", []) or [])
        file = getattr(module, "__file__", None)
        if paths:
            out[top] = Path(paths[0]).resolve()
        elif file:
            out[top] = Path(file).resolve()
    return dict(sorted(out.items()))


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
    "ENTRY_POINT_GROUP", "EXTERNAL", "REGISTRY", "ResidualPathway", "RoutingRecorder", "build_pathway",
    "check_pathway_shape", "check_run_shape", "control", "external_sources", "get_variant",
    "register", "resolve_residual", "variants",
]
