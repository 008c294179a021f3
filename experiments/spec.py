"""The study schema: YAML -> a typed, frozen `Study`, every error naming file, field path and what
is allowed.

A study file (see `quickstart.yaml` for a runnable one):

    study: quickstart               # optional; default: the file's stem. Letters, digits, _ . -
    description: free text          # optional
    base:                           # a run config (models.config.RunConfig) shared by every arm
      model: {preset: tiny}
      optim: {lr: 3e-3}
      train: {steps: 200}
    arms:                           # named arms, at least one
      control: prenorm              # shorthand: a residual variant name
      attnres: {residual: attnres}
      block4:
        residual: {name: block_attnres, options: {block_size: 4}}
        optim: {lr: 2e-3}           # an arm may override any base field
    seeds: 3                        # a count (seeds 0, 1, 2) or an explicit list [0, 1, 7]
    grid:                           # optional axes over any config field, crossed with each other
      model.preset: [tiny, small]
    comparisons:                    # optional
      - name: main                  # default: "<control>-vs-rest"
        control: control
        treatments: [attnres]       # default: every other arm
        metric: val_loss_tail       # default; see METRICS
        direction: minimize         # or maximize; default: minimize
        family: main                # multiplicity correction family; default: "default"

Precedence when building one run's config, lowest first: `base`, the arm, the grid point, then
command-line `--set` overrides (which apply to every run, e.g. `--set train.steps=6` for a smoke
test; they change the run ids, as they should). An arm's `residual` replaces the base's variant
and knobs as a whole (knobs belong to a variant); `residual.impl` is inherited unless the arm sets
it. A grid axis may not sweep a field an arm sets, nor `residual.name` (that is what arms are
for), nor `train.seed` (that is what `seeds` is for). Grid axes apply to every arm, so an axis over
a residual knob needs every arm's variant to have that knob; a head-count sweep against a
`prenorm` control is written as one arm per head count (see `head_sweep.yaml`).

YAML is read with a safe loader that also rejects duplicate keys (PyYAML silently keeps the last).
Loading validates everything that can be checked without training: the schema, every variant and
knob (via `models.residual.resolve_residual`), every (arm, grid point) config, and the comparisons;
`experiments.expand` then checks that no two arms resolve to the same config.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from reslab.models.config import ConfigError, RunConfig, load, set_path, to_dict

# The summary metrics a comparison may name: what `models.training.train` reports at the end
# of a run (and `results.collect` tabulates). Every one but the throughput and memory columns
# is a pure function of the run config.
METRICS: dict[str, str] = {
    "val_loss_tail": "minimize",
    "val_loss": "minimize",
    "train_loss": "minimize",
    "tokens_per_s": "maximize",
    "peak_mem_mb": "minimize",
    "train_time_s": "minimize",
    "wall_time_s": "minimize",
    "params_total": "minimize",
    "params_residual": "minimize",
}

TOP_LEVEL_KEYS = ("study", "description", "base", "arms", "seeds", "grid", "comparisons")
ARM_KEYS = ("description", "residual", "model", "data", "optim", "train")
COMPARISON_KEYS = ("name", "control", "treatments", "metric", "direction", "family")
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$")


class SpecError(ConfigError):
    """A study file is wrong. The message starts with the file and names the field path."""


# ----------------------------------------------------------------------------- YAML


class _StrictLoader(yaml.SafeLoader):
    """`yaml.SafeLoader` that rejects a key repeated in one mapping (merge keys `<<` excepted)."""


def _construct_mapping(loader: _StrictLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen: dict[Any, yaml.Node] = {}
    for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":
            continue
        key = loader.construct_object(key_node, deep=True)
        if key in seen:
            first = seen[key].start_mark
            raise yaml.constructor.ConstructorError(
                "while constructing a mapping", node.start_mark,
                f"found duplicate key {key!r} (first defined on line {first.line + 1})",
                key_node.start_mark,
            )
        seen[key] = key_node
    loader.flatten_mapping(node)
    return yaml.SafeLoader.construct_mapping(loader, node, deep=deep)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def load_yaml(path: str | Path) -> Any:
    """Parse a YAML file safely; duplicate keys and syntax errors raise `SpecError` with the line."""
    path = Path(path)
    if not path.is_file():
        raise SpecError(f"{path}: no such study file")
    try:
        with open(path) as f:  # a file stream puts its name into the error marks
            return yaml.load(f, Loader=_StrictLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as exc:
        raise SpecError(f"{path}: invalid YAML: {exc}") from None


# ----------------------------------------------------------------------------- the typed study


@dataclass(frozen=True, kw_only=True)
class Arm:
    """One arm: its name and its overrides of the base config (a nested mapping, residual
    normalised to `{name, options[, impl]}`)."""

    name: str
    overrides: dict[str, Any]
    description: str = ""

    @property
    def residual(self) -> str:
        return self.overrides["residual"]["name"]


@dataclass(frozen=True, kw_only=True)
class GridAxis:
    path: str
    values: tuple[Any, ...]


@dataclass(frozen=True, kw_only=True)
class ComparisonSpec:
    """A declared comparison; `results.stats.Comparison(**dataclasses.asdict(spec))` runs it."""

    name: str
    control: str
    treatments: tuple[str, ...]
    metric: str = "val_loss_tail"
    direction: typing.Literal["minimize", "maximize"] = "minimize"
    family: str = "default"


@dataclass(frozen=True, kw_only=True)
class Study:
    """A validated study. `base` and arm overrides are plain nested mappings (never mutated);
    `overrides` are the command-line `--set` pairs, applied last to every run."""

    name: str
    path: Path
    description: str
    base: dict[str, Any]
    arms: tuple[Arm, ...]
    seeds: tuple[int, ...]
    grid: tuple[GridAxis, ...]
    comparisons: tuple[ComparisonSpec, ...]
    overrides: tuple[tuple[str, Any], ...] = ()

    def grid_points(self) -> list[tuple[tuple[str, Any], ...]]:
        """Every grid point, axes in file order; one empty point when there is no grid."""
        points: list[tuple[tuple[str, Any], ...]] = [()]
        for axis in self.grid:
            points = [(*p, (axis.path, v)) for p in points for v in axis.values]
        return points

    def config_dict(self, arm: Arm, point: tuple[tuple[str, Any], ...], seed: int) -> dict[str, Any]:
        """The merged (not yet validated) run config of one (arm, grid point, seed)."""
        data = _merge_arm(self.base, arm.overrides)
        for path, value in point:
            data = set_path(data, path, value)
        for path, value in self.overrides:
            data = set_path(data, path, value)
        return set_path(data, "train.seed", seed)


# ----------------------------------------------------------------------------- helpers


def _allowed(names: typing.Iterable[str]) -> str:
    names = list(names)
    return ", ".join(names) if names else "(none)"


def _unknown_keys(data: dict, allowed: typing.Sequence[str], where: str) -> None:
    unknown = [k for k in data if k not in allowed]
    if unknown:
        hints = []
        for key in unknown:
            close = difflib.get_close_matches(str(key), allowed, n=1)
            hints.append(f"{key!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
        raise ConfigError(f"{where}: unknown key(s) {', '.join(hints)}; allowed: {_allowed(allowed)}")


def _check_name(value: Any, where: str, what: str) -> str:
    if not isinstance(value, str) or not _NAME_RE.match(value):
        raise ConfigError(
            f"{where}: {what} {value!r} is not allowed; use letters, digits, '_', '.' and '-', "
            "starting with a letter or digit"
        )
    return value


def _merge(base: Any, over: Any) -> Any:
    if isinstance(base, dict) and isinstance(over, dict):
        out = dict(base)
        for key, value in over.items():
            out[key] = _merge(base.get(key), value)
        return out
    return over


def _merge_arm(base: dict, overrides: dict) -> dict:
    """Deep-merge an arm into the base; the arm's `residual` replaces name and options whole."""
    out = _merge(base, {k: v for k, v in overrides.items() if k != "residual"})
    residual = dict(overrides["residual"])
    if "impl" not in residual and "impl" in base.get("residual", {}):
        residual["impl"] = base["residual"]["impl"]
    out["residual"] = residual
    return to_dict(out)


def _leaf_paths(data: dict, prefix: str = "") -> list[str]:
    out = []
    for key, value in data.items():
        if isinstance(value, dict) and value:
            out.extend(_leaf_paths(value, f"{prefix}{key}."))
        else:
            out.append(f"{prefix}{key}")
    return out


def _overlaps(a: str, b: str) -> bool:
    return a == b or a.startswith(b + ".") or b.startswith(a + ".")


def check_config_path(path: str, where: str) -> None:
    """`path` must name a field of `RunConfig` (`residual.options.<knob>` for knobs)."""
    if not isinstance(path, str) or not path:
        raise ConfigError(f"{where}: a field path must be a dotted string such as optim.lr, got {path!r}")
    parts = path.split(".")
    cls: Any = RunConfig
    for i, part in enumerate(parts):
        done = ".".join(parts[:i])
        if cls is dict:  # residual.options: any knob name; the variant checks it
            if i != len(parts) - 1:
                raise ConfigError(f"{where}: {path!r}: residual knobs are flat; expected residual.options.<knob>")
            return
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
        cls = dict if typing.get_origin(tp) is dict else tp
    if dataclasses.is_dataclass(cls):
        raise ConfigError(f"{where}: {path!r} is a section; name one of its fields, e.g. {path}.{dataclasses.fields(cls)[0].name}")


def _variant_knobs(name: str) -> list[str]:
    from reslab.models.residual import get_variant

    return [f.name for f in dataclasses.fields(get_variant(name).Config)]


# ----------------------------------------------------------------------------- parsing


def _parse_residual(value: Any, where: str) -> dict[str, Any]:
    if isinstance(value, str):
        return {"name": value, "options": {}}
    if not isinstance(value, dict):
        raise ConfigError(f"{where}: expected a variant name or a mapping {{name, options, impl}}, got {value!r}")
    _unknown_keys(value, ("name", "options", "impl"), where)
    if "name" not in value:
        raise ConfigError(f"{where}.name: missing; every arm names its residual variant")
    options = value.get("options") or {}
    if not isinstance(options, dict):
        raise ConfigError(f"{where}.options: expected a mapping of knob: value, got {options!r}")
    out = {"name": value["name"], "options": dict(options)}
    if "impl" in value:
        out["impl"] = value["impl"]
    return out


def _parse_arm(name: Any, value: Any) -> Arm:
    where = f"arms.{name}"
    _check_name(name, "arms", "arm name")
    if isinstance(value, str):
        value = {"residual": value}
    if not isinstance(value, dict):
        raise ConfigError(
            f"{where}: expected a variant name (e.g. prenorm) or a mapping with keys {_allowed(ARM_KEYS)}, got {value!r}"
        )
    _unknown_keys(value, ARM_KEYS, where)
    if "residual" not in value:
        raise ConfigError(f"{where}.residual: missing; every arm names its residual variant")
    description = value.get("description", "")
    if not isinstance(description, str):
        raise ConfigError(f"{where}.description: expected a string, got {description!r}")
    overrides: dict[str, Any] = {"residual": _parse_residual(value["residual"], f"{where}.residual")}
    for section in ("model", "data", "optim", "train"):
        if section in value:
            if not isinstance(value[section], dict):
                raise ConfigError(f"{where}.{section}: expected a mapping of overrides, got {value[section]!r}")
            overrides[section] = value[section]
    if "seed" in overrides.get("train", {}):
        raise ConfigError(f"{where}.train.seed: seeds come from the study's `seeds:`; remove it here")
    return Arm(name=name, overrides=to_dict(overrides), description=description)


def _parse_seeds(value: Any) -> tuple[int, ...]:
    where = "seeds"
    if isinstance(value, bool) or value is None:
        raise ConfigError(f"{where}: expected a count (e.g. 3) or a list of integers, got {value!r}")
    if isinstance(value, int):
        if value < 1:
            raise ConfigError(f"{where}: a count must be >= 1, got {value}")
        return tuple(range(value))
    if isinstance(value, list):
        if not value:
            raise ConfigError(f"{where}: the list is empty; give at least one seed")
        for i, s in enumerate(value):
            if isinstance(s, bool) or not isinstance(s, int) or s < 0:
                raise ConfigError(f"{where}[{i}]: expected a non-negative integer, got {s!r}")
        dup = sorted({s for s in value if value.count(s) > 1})
        if dup:
            raise ConfigError(f"{where}: seed(s) {dup} repeat; each seed is one pair")
        return tuple(value)
    raise ConfigError(f"{where}: expected a count (e.g. 3) or a list of integers, got {value!r}")


def _parse_grid(value: Any) -> tuple[GridAxis, ...]:
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise ConfigError(f"grid: expected a mapping of field path -> list of values, got {value!r}")
    axes = []
    for path, values in value.items():
        where = f"grid.{path}"
        check_config_path(path, "grid")
        if path == "residual.name":
            raise ConfigError(f"{where}: sweep variants with arms, not a grid axis")
        if path in ("train.seed", "residual"):
            raise ConfigError(f"{where}: seeds come from the study's `seeds:`")
        if not isinstance(values, list) or not values:
            raise ConfigError(f"{where}: expected a non-empty list of values, got {values!r}")
        plain = [to_dict(v) for v in values]
        dup = [v for i, v in enumerate(plain) if v in plain[:i]]
        if dup:
            raise ConfigError(f"{where}: value(s) {dup} repeat")
        axes.append(GridAxis(path=path, values=tuple(values)))
    for i, a in enumerate(axes):
        for b in axes[:i]:
            if _overlaps(a.path, b.path):
                raise ConfigError(f"grid: axes {b.path!r} and {a.path!r} overlap; sweep each field once")
    return tuple(axes)


def _parse_comparison(i: int, value: Any, arms: list[str]) -> ComparisonSpec:
    where = f"comparisons[{i}]"
    if not isinstance(value, dict):
        raise ConfigError(f"{where}: expected a mapping with keys {_allowed(COMPARISON_KEYS)}, got {value!r}")
    _unknown_keys(value, COMPARISON_KEYS, where)
    if "control" not in value:
        raise ConfigError(f"{where}.control: missing; name the control arm (one of {_allowed(arms)})")
    control = value["control"]
    if control not in arms:
        raise ConfigError(f"{where}.control: {control!r} is not an arm; allowed: {_allowed(arms)}")
    treatments = value.get("treatments", [a for a in arms if a != control])
    if isinstance(treatments, str):
        treatments = [treatments]
    if not isinstance(treatments, list) or not treatments:
        raise ConfigError(f"{where}.treatments: expected a non-empty list of arms, got {treatments!r}")
    for j, t in enumerate(treatments):
        if t not in arms:
            raise ConfigError(f"{where}.treatments[{j}]: {t!r} is not an arm; allowed: {_allowed(arms)}")
        if t == control:
            raise ConfigError(f"{where}.treatments[{j}]: {t!r} is the control; a treatment must be another arm")
    if len(set(treatments)) != len(treatments):
        raise ConfigError(f"{where}.treatments: arms repeat: {treatments}")
    metric = value.get("metric", "val_loss_tail")
    if metric not in METRICS:
        raise ConfigError(f"{where}.metric: unknown metric {metric!r}; allowed: {_allowed(METRICS)}")
    direction = value.get("direction", METRICS[metric])
    if direction not in ("minimize", "maximize"):
        raise ConfigError(f"{where}.direction: {direction!r} is not allowed; allowed: minimize, maximize")
    name = value.get("name", f"{control}-vs-rest")
    _check_name(name, f"{where}.name", "comparison name")
    family = value.get("family", "default")
    _check_name(family, f"{where}.family", "family")
    return ComparisonSpec(
        name=name, control=control, treatments=tuple(treatments), metric=metric, direction=direction, family=family
    )


def parse_study(data: Any, path: Path, overrides: typing.Sequence[tuple[str, Any]] = ()) -> Study:
    """Validate a parsed study mapping; errors raise `ConfigError` naming the field path only."""
    if not isinstance(data, dict):
        raise ConfigError(f"top level: expected a mapping with keys {_allowed(TOP_LEVEL_KEYS)}, got {type(data).__name__}")
    _unknown_keys(data, TOP_LEVEL_KEYS, "top level")
    name = _check_name(data.get("study", path.stem), "study", "study name")
    description = data.get("description", "")
    if not isinstance(description, str):
        raise ConfigError(f"description: expected a string, got {description!r}")

    base = data.get("base") or {}
    if not isinstance(base, dict):
        raise ConfigError(f"base: expected a run config mapping (model, residual, data, optim, train), got {base!r}")
    load(RunConfig, base, "base")  # strict: unknown keys and wrong types
    if "seed" in (base.get("train") or {}):
        raise ConfigError("base.train.seed: seeds come from the study's `seeds:`; remove it here")
    base = to_dict(base)

    overrides = tuple(overrides)
    for path_, _ in overrides:
        check_config_path(path_, "--set")
        if path_ == "train.seed":
            raise ConfigError("--set train.seed: seeds come from the study's `seeds:`")

    arms_raw = data.get("arms")
    if not isinstance(arms_raw, dict) or not arms_raw:
        raise ConfigError("arms: expected a non-empty mapping of arm name -> variant (e.g. `control: prenorm`)")
    arms = [_parse_arm(k, v) for k, v in arms_raw.items()]

    if "seeds" not in data:
        raise ConfigError("seeds: missing; give a count (e.g. 3) or a list of seeds")
    seeds = _parse_seeds(data["seeds"])
    grid = _parse_grid(data.get("grid"))

    for arm in arms:
        arm_paths = _leaf_paths({k: v for k, v in arm.overrides.items() if k != "residual"})
        arm_paths += [f"residual.options.{k}" for k in arm.overrides["residual"]["options"]]
        for axis in grid:
            clash = [p for p in arm_paths if _overlaps(p, axis.path)]
            if clash:
                raise ConfigError(
                    f"arms.{arm.name}: sets {clash[0]}, which grid axis {axis.path!r} also sweeps; "
                    "set it in one place"
                )

    comparisons_raw = data.get("comparisons") or []
    if not isinstance(comparisons_raw, list):
        raise ConfigError(f"comparisons: expected a list of comparisons, got {comparisons_raw!r}")
    arm_names = [a.name for a in arms]
    comparisons = tuple(_parse_comparison(i, c, arm_names) for i, c in enumerate(comparisons_raw))
    names = [c.name for c in comparisons]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ConfigError(f"comparisons: name(s) {dup} repeat; give each comparison its own name")

    study = Study(
        name=name, path=path, description=description, base=base, arms=tuple(arms),
        seeds=seeds, grid=grid, comparisons=comparisons, overrides=overrides,
    )
    _check_arms(study)
    return study


def _check_arms(study: Study) -> None:
    """Every arm at every grid point must be a valid run config: variant, knobs, values."""
    from reslab.models.config import validate_run_config

    knobs_of: dict[str, list[str]] = {}
    for arm in study.arms:
        where = f"arms.{arm.name}"
        try:
            knobs_of[arm.residual] = _variant_knobs(arm.residual)
        except ConfigError as exc:
            raise ConfigError(str(exc).replace("residual.name", f"{where}.residual.name", 1)) from None
        for axis in study.grid:
            if axis.path.startswith("residual.options."):
                knob = axis.path.removeprefix("residual.options.")
                if knob not in knobs_of[arm.residual]:
                    raise ConfigError(
                        f"grid.{axis.path}: does not apply to arm {arm.name!r}: variant {arm.residual!r} has "
                        f"no knob {knob!r}; its knobs: {_allowed(knobs_of[arm.residual])}. Grid axes apply to "
                        "every arm; write one arm per value instead (see experiments/head_sweep.yaml)"
                    )
        for point in study.grid_points():
            at = where + (" at grid point " + ", ".join(f"{p}={v!r}" for p, v in point) if point else "")
            cfg = load(RunConfig, study.config_dict(arm, point, study.seeds[0]), at)
            validate_run_config(cfg, where=at)


def load_study(path: str | Path, overrides: typing.Sequence[tuple[str, Any]] = ()) -> Study:
    """Read and validate a study file; every error is a `SpecError` that starts with the file."""
    path = Path(path)
    data = load_yaml(path)
    try:
        return parse_study(data, path, overrides)
    except SpecError:
        raise
    except ConfigError as exc:
        raise SpecError(f"{path}: {exc}") from None


__all__ = [
    "ARM_KEYS", "Arm", "ComparisonSpec", "GridAxis", "METRICS", "SpecError", "Study", "TOP_LEVEL_KEYS",
    "check_config_path", "load_study", "load_yaml", "parse_study",
]
