"""Checks a study's schema (`experiments.spec`) and its `tune:` block (`experiments.tune`) share: a
config field path, one override of it, and an objective (metric and direction).

A leaf of `experiments`: both modules import it, neither imports the other for these.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from typing import Any

from reslab.common.metrics import METRICS, SUMMARY_METRICS
from reslab.models.config import ConfigError, RunConfig, check_plain, coerce, shown
from reslab.results.comparison import Direction


def allowed_names(names: typing.Iterable[str]) -> str:
    """`a, b, c` for an error's "allowed:" part; `(none)` when there is nothing to allow."""
    names = list(names)
    return ", ".join(names) if names else "(none)"


def check_objective(metric: Any, direction: Any, where: str) -> tuple[str, Direction]:
    """A metric of the registry and its direction (the registry's unless given): what a comparison and a
    tuning objective optimise. Errors name `<where>.metric` / `<where>.direction`."""
    if metric not in SUMMARY_METRICS:  # the interventions' values are mechanisms, not a run's summary
        raise ConfigError(f"{where}.metric: {shown(metric)} is not a metric; allowed: {allowed_names(SUMMARY_METRICS)}")
    direction = METRICS[metric].direction if direction is None else direction
    if direction == "minimize" or direction == "maximize":
        return metric, direction
    raise ConfigError(f"{where}.direction: {shown(direction)} is not allowed; allowed: minimize, maximize")


def check_config_path(path: str, where: str) -> Any:
    """`path` must name a field of `RunConfig` (`residual.options.<knob>` for knobs); returns the
    field's annotation, or None for a knob (its variant checks it)."""
    if not isinstance(path, str) or not path:
        raise ConfigError(f"{where}: a field path must be a dotted string such as optim.lr, got {path!r}")
    parts = path.split(".")
    cls: Any = RunConfig
    for i, part in enumerate(parts):
        done = ".".join(parts[:i])
        if cls is dict:  # residual.options: any knob name; the variant checks it
            if i != len(parts) - 1:
                raise ConfigError(f"{where}: {path!r}: residual knobs are flat; expected residual.options.<knob>")
            return None
        if not dataclasses.is_dataclass(cls):
            raise ConfigError(f"{where}: {path!r}: {done!r} is a value, not a section")
        hints = typing.get_type_hints(cls)
        names = [f.name for f in dataclasses.fields(cls)]
        if part not in names:
            close = difflib.get_close_matches(part, names, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            scope = f"{done}." if done else ""
            raise ConfigError(
                f"{where}: {path!r}: unknown field {scope}{part}{hint}; allowed: "
                + ", ".join(f"{scope}{n}" for n in names)
            )
        tp = hints[part]
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if i < len(parts) - 1 and typing.get_origin(tp) in (typing.Union, types.UnionType) and len(args) == 1 \
                and dataclasses.is_dataclass(args[0]):
            tp = args[0]  # an optional section (model.moe): its fields are set like a section's
        cls = dict if typing.get_origin(tp) is dict else tp
    if dataclasses.is_dataclass(cls):
        example = f"{path}.{dataclasses.fields(cls)[0].name}"
        raise ConfigError(f"{where}: {path!r} is a section; name one of its fields, e.g. {example}")
    return cls


def check_override(path: str, value: Any, where: str = "--set") -> None:
    """One `--set FIELD=VALUE`: the path names a field and the value has its type; an error blames
    the flag as typed (`--set optim.lr: expected a number, got 'abc'`), not the arm it reached."""
    tp = check_config_path(path, where)
    if tp is not None:
        coerce(tp, value, f"{where} {path}")
    else:
        check_plain(value, f"{where} {path}")


__all__ = ["allowed_names", "check_config_path", "check_objective", "check_override", "join_arm_errors"]


def join_arm_errors(errors: typing.Sequence[tuple[str, str]]) -> str:
    """Errors of several arms (or grid points) in one line, each text once: (where, error) pairs whose errors
    say the same thing after their `where` are one "arms.a and arms.b: <field>: <text>" (issue 52, item 16: a
    missing checkpoint every arm names was said once per arm)."""
    groups: dict[str, list[str]] = {}
    for where, error in errors:
        rest = error.removeprefix(where) if error.startswith(where) else f": {error}"
        groups.setdefault(rest, []).append(where)
    parts = []
    for rest, wheres in groups.items():
        if len(wheres) == 1:
            parts.append(wheres[0] + rest)
        else:
            parts.append(f"{', '.join(wheres[:-1])} and {wheres[-1]}: {rest.removeprefix('.').removeprefix(': ')}")
    return "; ".join(parts)
