"""The `tune:` block of a study: what to search, how hard, on which seed, with which sampler and pruner.

    tune:
      trials: 6                   # per arm, the same for every arm (no arm is tuned harder)
      seed: 1000                  # the tuning seed; must not be one of the comparison `seeds:`
      objective: val_loss_tail    # or {metric: val_loss_tail, direction: minimize}; default direction: the metric's
      sampler: tpe                # tpe | cmaes | random | grid, or {name: tpe, seed: 0}
      pruner: median              # none | median | successive_halving | hyperband, or {name: median, <knobs>}
      space:                      # shared by every arm
        optim.lr: {type: float, low: 1.0e-4, high: 3.0e-2, log: true}
      arms:                       # per-arm additions or replacements of `space` entries
        block_attnres: {residual.options.block_size: {type: categorical, choices: [2, 4]}}

Parameters are config field paths (`experiments.checks.check_config_path`); a tuned value is applied
after the arm's own overrides, so it wins. One tuning seed: every trial of every arm trains on the
same initialisation and data order, so trials differ only by their parameters. Pruning compares
intermediate values of the objective, so a pruner needs an objective that evals report
(`val_loss`, `val_loss_tail`). `grid` needs a space of categoricals and stepped ints only.

`apply_tuned` turns each arm's best parameters into arm overrides for `reslab run --from-tune`, so
the comparison runs' ids (hashes of their configs) reflect the tuned values.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Annotated, Any

from reslab.experiments.checks import check_config_path, check_objective, check_override
from reslab.models.config import INT_MAX, ConfigError, coerce, load, set_path
from reslab.models.typed_load import Rule, missing

PARAM_TYPES = ("float", "int", "categorical")
SAMPLERS = ("tpe", "cmaes", "random", "grid")
# pruner -> its knobs (Optuna's constructor arguments of the same names)
PRUNERS: dict[str, tuple[str, ...]] = {
    "none": (),
    "median": ("n_startup_trials", "n_warmup_steps", "interval_steps"),
    "successive_halving": ("min_resource", "reduction_factor", "min_early_stopping_rate"),
    "hyperband": ("min_resource", "max_resource", "reduction_factor"),
}
EVAL_METRICS = ("val_loss", "val_loss_tail")  # what every eval reports, so a pruner can compare them
MAX_TRIALS = 10_000
MAX_CHOICES = 1000


@dataclass(frozen=True, kw_only=True)
class Param:
    """One search dimension over the config field `path`."""

    path: str
    type: str
    low: float | None = None
    high: float | None = None
    log: bool = False
    step: float | None = None
    choices: tuple[Any, ...] = ()

    def grid_values(self) -> list[Any] | None:
        """Every value of a categorical or a stepped int; None for a continuous dimension."""
        if self.type == "categorical":
            return list(self.choices)
        if self.type == "int" and not self.log and self.low is not None and self.high is not None:
            step = int(self.step or 1)
            return list(range(int(self.low), int(self.high) + 1, step))
        return None


@dataclass(frozen=True, kw_only=True)
class TuneSpec:
    trials: int
    seed: int
    metric: str
    direction: str
    sampler: str
    sampler_seed: int
    pruner: str
    pruner_options: dict[str, Any]
    space: dict[str, tuple[Param, ...]]  # arm name -> its parameters (shared + per-arm), in file order

    def describe(self) -> str:
        arms = len(self.space)
        return (f"{self.trials} trials x {arms} arms = {self.trials * arms} trial runs on tuning seed {self.seed}, "
                f"{self.direction} {self.metric}, sampler {self.sampler}, pruner {self.pruner}; space "
                + "; ".join(f"{arm}: {', '.join(p.path for p in ps)}" for arm, ps in self.space.items()))

    def grid_size(self, arm: str) -> int | None:
        sizes = [p.grid_values() for p in self.space[arm]]
        return None if any(s is None for s in sizes) else math.prod(len(s) for s in sizes if s is not None)


def _number(value: Any, where: str) -> float:
    """A finite number; YAML 1.1 reads `1e-4` (no dot) as a string, accepted as the config fields do."""
    return float(coerce(float, value, where))


def _parse_param(path: Any, value: Any, where: str) -> Param:
    check_config_path(path, where)
    if path == "train.seed":
        raise ConfigError(f"{where}: train.seed cannot be tuned; the tuning seed is `tune.seed`")
    where = f"{where}.{path}"
    if not isinstance(value, dict):
        raise ConfigError(f"{where}: expected a mapping such as {{type: float, low: 1e-4, high: 1e-2, log: true}}, "
                          f"got {value!r}")
    kind = value.get("type")
    if kind not in PARAM_TYPES:
        raise ConfigError(f"{where}.type: {kind!r} is not a parameter type; allowed: {', '.join(PARAM_TYPES)}")
    allowed = ("type", "choices") if kind == "categorical" else ("type", "low", "high", "log", "step")
    unknown = sorted(set(value) - set(allowed))
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {unknown} for a {kind} parameter; allowed: {', '.join(allowed)}")
    if kind == "categorical":
        choices = value.get("choices")
        if not isinstance(choices, list) or not 1 <= len(choices) <= MAX_CHOICES:
            raise ConfigError(f"{where}.choices: expected a list of 1 to {MAX_CHOICES} values, got {choices!r}")
        for i, c in enumerate(choices):
            if not (c is None or isinstance(c, (bool, int, float, str))):
                raise ConfigError(f"{where}.choices[{i}]: expected a number, string, boolean or null, got {c!r}")
            check_override(path, c, f"{where}.choices[{i}]:")
        if len({repr(c) for c in choices}) != len(choices):
            raise ConfigError(f"{where}.choices: values repeat: {choices!r}")
        return Param(path=path, type=kind, choices=tuple(choices))
    for key in ("low", "high"):
        if key not in value:
            raise ConfigError(f"{where}.{key}: missing; a {kind} parameter needs low and high")
    low, high = _number(value["low"], f"{where}.low"), _number(value["high"], f"{where}.high")
    log = value.get("log", False)
    if not isinstance(log, bool):
        raise ConfigError(f"{where}.log: expected true or false, got {log!r}")
    if not low < high:
        raise ConfigError(f"{where}: low ({low:g}) must be below high ({high:g})")
    if log and low <= 0:
        raise ConfigError(f"{where}.low: a log-scale range must be positive, got {low:g}")
    step = value.get("step")
    if step is not None:
        step = _number(step, f"{where}.step")
        if step <= 0 or log:
            raise ConfigError(f"{where}.step: expected a positive step on a linear scale, got {step:g}"
                              + (" with log: true" if log else ""))
    if kind == "int":
        for key, v in (("low", low), ("high", high), ("step", step)):
            if v is not None and v != int(v):
                raise ConfigError(f"{where}.{key}: an int parameter needs an integer, got {v:g}")
    check_override(path, int(low) if kind == "int" else low, f"{where}.low:")
    return Param(path=path, type=kind, low=low, high=high, log=log, step=step)


def _parse_space(value: Any, where: str) -> dict[str, Param]:
    if not isinstance(value, dict):
        raise ConfigError(f"{where}: expected a mapping of config field path -> parameter, got {value!r}")
    return {path: _parse_param(path, p, where) for path, p in value.items()}


@dataclass(frozen=True, kw_only=True)
class Objective:
    """`objective: {metric, direction}` (a bare name is the metric); checked against the metric registry."""

    metric: Any = "val_loss_tail"
    direction: Any = None


@dataclass(frozen=True, kw_only=True)
class Sampler:
    """`sampler: {name, seed}` (a bare name is the name)."""

    name: Annotated[Any, Rule(choices=SAMPLERS)] = field(metadata=missing(f"allowed: {', '.join(SAMPLERS)}"))
    seed: Annotated[int, Rule(low=0, high=2**32 - 1, message="expected an integer from 0 to 2**32-1, got {raw}")] = 0


TRIALS = f"expected trials per arm, an integer from 1 to {MAX_TRIALS}"
SEED = "expected one integer tuning seed from 0 to 2**63-1"


@dataclass(frozen=True, kw_only=True)
class TuneFile:
    """The `tune:` block as written (module docstring); `parse_tune` checks it against the study."""

    trials: Annotated[int, Rule(low=1, high=MAX_TRIALS, message=TRIALS + ", got {raw}")] \
        = field(metadata=missing(TRIALS))
    seed: Annotated[int, Rule(low=0, high=INT_MAX, message=SEED + ", got {raw}")] = field(metadata=missing(SEED))
    objective: Annotated[Objective | str, Rule(
        null=False, message="expected a metric name or {{metric, direction}}, got {raw}")] = "val_loss_tail"
    sampler: Annotated[Sampler | str | None, Rule(
        message=f"expected a name ({', '.join(SAMPLERS)}) or a mapping with `name`, got {{raw}}")] = None
    pruner: Any = None
    space: Any = None
    arms: Any = None


TUNE_KEYS = tuple(f.name for f in dataclasses.fields(TuneFile))


def _named(value: Any, where: str, allowed: tuple[str, ...], default: str) -> tuple[str, dict[str, Any]]:
    """`name` or `{name: ..., <options>}`."""
    if value is None:
        return default, {}
    if isinstance(value, str):
        value = {"name": value}
    if not isinstance(value, dict):
        raise ConfigError(f"{where}: expected a name ({', '.join(allowed)}) or a mapping with `name`, got {value!r}")
    name = value.get("name")
    if name not in allowed:
        raise ConfigError(f"{where}.name: {name!r} is not allowed; allowed: {', '.join(allowed)}")
    return name, {k: v for k, v in value.items() if k != "name"}


def parse_tune(value: Any, arms: list[str], seeds: tuple[int, ...], has_grid: bool) -> TuneSpec:
    """Validate a study's `tune:` mapping; every error names its field path."""
    if not isinstance(value, dict):
        raise ConfigError(f"tune: expected a mapping with keys {', '.join(TUNE_KEYS)}, got {value!r}")
    tune: TuneFile = load(TuneFile, value, "tune")
    if has_grid:
        raise ConfigError("tune: a study with grid axes or a ladder cannot be tuned (which point would the search "
                          "use?); tune a study without `grid:` and `ladder:`")
    trials, seed = tune.trials, tune.seed
    if seed in seeds:
        raise ConfigError(f"tune.seed: {seed} is also a comparison seed (seeds: {list(seeds)}); tuning and "
                          "comparison seeds must be disjoint, or the comparison reuses the data the search selected on")

    objective = Objective(metric=tune.objective) if isinstance(tune.objective, str) else tune.objective
    metric, direction = check_objective(objective.metric, objective.direction, "tune.objective")
    written = Sampler(name="tpe") if tune.sampler is None else tune.sampler
    chosen = load(Sampler, {"name": written}, "tune.sampler") if isinstance(written, str) else written
    sampler, sampler_seed = chosen.name, chosen.seed

    pruner, pruner_options = _named(value.get("pruner"), "tune.pruner", tuple(PRUNERS), "median")
    for key, v in pruner_options.items():
        if key not in PRUNERS[pruner]:
            raise ConfigError(f"tune.pruner.{key}: not a knob of the {pruner} pruner; allowed: "
                              f"{', '.join(PRUNERS[pruner]) or '(none)'}")
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ConfigError(f"tune.pruner.{key}: expected a non-negative integer, got {v!r}")
    if pruner != "none" and metric not in EVAL_METRICS:
        raise ConfigError(f"tune.pruner: pruning compares per-eval values of the objective, but evals do not report "
                          f"{metric!r}; use objective {' or '.join(EVAL_METRICS)}, or pruner: none")

    shared = _parse_space(value.get("space") or {}, "tune.space")
    per_arm_raw = value.get("arms") or {}
    if not isinstance(per_arm_raw, dict):
        raise ConfigError(f"tune.arms: expected a mapping of arm name -> search space, got {per_arm_raw!r}")
    space: dict[str, tuple[Param, ...]] = {}
    for arm in per_arm_raw:
        if arm not in arms:
            raise ConfigError(f"tune.arms.{arm}: not an arm of this study; arms: {', '.join(arms)}")
    for arm in arms:
        own = _parse_space(per_arm_raw.get(arm) or {}, f"tune.arms.{arm}")
        merged = {**shared, **own}
        if not merged:
            raise ConfigError(f"tune.space: arm {arm!r} has nothing to tune; give `tune.space` or `tune.arms.{arm}`")
        space[arm] = tuple(merged.values())
    spec = TuneSpec(trials=trials, seed=seed, metric=metric, direction=direction, sampler=sampler,
                    sampler_seed=sampler_seed, pruner=pruner, pruner_options=pruner_options, space=space)
    if sampler == "grid":
        for arm in arms:
            size = spec.grid_size(arm)
            if size is None:
                raise ConfigError(f"tune.sampler: grid needs categoricals and linear ints only; arm {arm!r} has a "
                                  "continuous or log-scale parameter")
            if trials > size:
                raise ConfigError(f"tune.trials: {trials} is more than arm {arm!r}'s grid of {size} points")
    return spec


def apply_tuned(arm_overrides: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
    """The arm's overrides with its tuned parameters (config field path -> value) set on top."""
    out = arm_overrides
    for path, value in params.items():
        out = set_path(out, path, value)
    return out


__all__ = ["EVAL_METRICS", "PRUNERS", "SAMPLERS", "Param", "TuneSpec", "apply_tuned", "parse_tune"]
