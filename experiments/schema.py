"""The study file's schema: what each key of a study YAML holds, as frozen dataclasses that the one typed
loader (`models.config.load`) reads, every error one line naming the field path (`experiments.spec`'s
docstring shows a whole file).

A field's type, bounds and error wording live on the field (`Annotated[T, Rule(...)]`,
`models.typed_load`); what needs two fields or the rest of the study (a comparison's arms, the run limit,
the grid a ladder must not sweep) is checked by `experiments.spec` once the file is loaded.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Any

from reslab.common.metrics import COST_METRICS, MECHANISM_METRICS
from reslab.experiments.evals import EvalSpec
from reslab.models.config import INT_MAX
from reslab.models.typed_load import Rule, missing
from reslab.results.comparison import CORRECTIONS, COSTS, KINDS, Correction, Cost, Kind

# Study, arm, comparison and family names become directory names, MLflow names and table labels.
MAX_NAME_CHARS = 100
NAME_PATTERN = r"[A-Za-z0-9][A-Za-z0-9_.\-]*"
MAX_DESCRIPTION_CHARS = 10_000
# Bounds checked before anything is expanded: a study may declare more runs with
# `limits: {max_runs: N}` or `--max-runs N`, up to MAX_RUNS_CEILING.
DEFAULT_MAX_RUNS = 5000
MAX_RUNS_CEILING = 1_000_000
PIPELINE_SCHEDULES = ("gpipe", "1f1b")
SHARDINGS = ("ddp", "fsdp")
MAX_GPUS = 1024


def name_rule(what: str) -> Rule:
    """A name that becomes a directory, an MLflow name and a table label."""
    return Rule(pattern=NAME_PATTERN, max_len=MAX_NAME_CHARS,
                message=f"{what} {{got}} is not allowed; use at most {MAX_NAME_CHARS} letters, digits, '_', '.' "
                        "and '-', starting with a letter or digit")


ARMS_MESSAGE = "expected a non-empty mapping of arm name -> variant (e.g. `control: prenorm`)"
OVERRIDES = Rule(null=False, message="expected a mapping of overrides, got {raw}")


MAX_RUNS = Rule(low=1, high=MAX_RUNS_CEILING, message=f"expected an integer from 1 to {MAX_RUNS_CEILING}, got {{got}}")


@dataclass(frozen=True, kw_only=True)
class Limits:
    """`limits:`: the most runs a study may expand to (`--max-runs` overrides it)."""

    max_runs: Annotated[int, MAX_RUNS] = DEFAULT_MAX_RUNS


@dataclass(frozen=True, kw_only=True)
class Resources:
    """`resources:`: how each run is placed (`experiments.spec`'s docstring); not part of any run's identity."""

    gpus_per_run: Annotated[int | None, Rule(low=1, high=MAX_GPUS, message=f"expected an integer from 1 to {MAX_GPUS} "
                                                                           "(GPUs, one rank each), got {got}")] = None
    sharding: Annotated[str | None, Rule(choices=(None, *SHARDINGS), message="{got} is not allowed; allowed: "
                                                                            + ", ".join(SHARDINGS))] = None
    pipeline_stages: Annotated[int, Rule(low=1, high=MAX_GPUS)] = 1
    pipeline_schedule: Annotated[str, Rule(choices=PIPELINE_SCHEDULES)] = "gpipe"
    microbatches: Annotated[int, Rule(low=1, high=MAX_GPUS)] = 1
    pipeline_virtual_stages: Annotated[int, Rule(low=1, high=MAX_GPUS)] = 1
    pipeline_cache: bool = False


@dataclass(frozen=True, kw_only=True)
class ResidualFile:
    """An arm's `residual:` written out: the variant, its knobs, and the implementation (inherited when absent)."""

    name: Any = field(metadata=missing("every arm names its residual variant"))
    options: Annotated[dict[str, Any] | None, Rule(message="expected a mapping of knob: value, got {raw}")] = None
    impl: Annotated[Any, Rule(null=False, message="{got} is not allowed; expected one of 'auto', 'reference', "
                                                  "'triton'")] = None


@dataclass(frozen=True, kw_only=True)
class ArmFile:
    """One arm: its variant (`residual:`) and its overrides of the base config's sections."""

    description: str = ""
    residual: Annotated[ResidualFile | str, Rule(message="expected a variant name or a mapping {{name, options, "
                                                         "impl}}, got {raw}")] \
        = field(metadata=missing("every arm names its residual variant"))
    model: Annotated[dict[str, Any] | None, OVERRIDES] = None
    data: Annotated[dict[str, Any] | None, OVERRIDES] = None
    optim: Annotated[dict[str, Any] | None, OVERRIDES] = None
    train: Annotated[dict[str, Any] | None, OVERRIDES] = None


ARM_KEYS = ("description", "residual", "model", "data", "optim", "train")


@dataclass(frozen=True, kw_only=True)
class ComparisonFile:
    """One `comparisons:` entry; the arms, metric, units and grid axes it names are checked against the study."""

    name: Annotated[str | None, name_rule("comparison name")] = None
    control: Any = None
    treatments: Annotated[tuple[Any, ...] | None, Rule(nonempty=True, one_or_list=True,
                                                       message="expected a non-empty list of arms, got {raw}")] = None
    metric: Any = "val_loss_tail"
    direction: Any = None
    family: Annotated[str, name_rule("family")] = "default"
    correction: Annotated[Correction, Rule(choices=CORRECTIONS)] = "holm"
    kind: Annotated[Kind, Rule(choices=KINDS)] = "superiority"
    margin: Any = None
    mei: Any = None
    exploratory: bool = False
    pool: Annotated[tuple[Any, ...], Rule(one_or_list=True, message="expected a list of grid axes, got {got}")] = ()
    at: Annotated[Cost, Rule(choices=COSTS)] = "tokens"


@dataclass(frozen=True, kw_only=True)
class ContrastFile:
    """One `contrasts:` entry: `weights:` or `fraction:` over the study's arms (checked against them)."""

    name: Annotated[str | None, name_rule("contrast name")] = None
    metric: Any = "val_loss_tail"
    weights: Any = None
    margin: Any = None
    fraction: Any = None


def metric_names(what: str, allowed: tuple[str, ...]) -> tuple[Rule, Rule]:
    """The rules of `costs:` or `mechanisms:` (a non-empty list of metric names from `allowed`): the list's, an
    item's."""
    names = ", ".join(allowed)
    return (Rule(nonempty=True, message=f"expected a non-empty list of {what} metrics, got {{got}}; allowed: {names}"),
            Rule(choices=allowed, message=f"{{got}} is not a {what} metric{{hint}}; allowed: {names}"))


COST_LIST, COST_ITEM = metric_names("cost", COST_METRICS)
MECHANISM_LIST, MECHANISM_ITEM = metric_names("mechanism", MECHANISM_METRICS)
SEEDS = Annotated[
    Annotated[int, Rule(low=1, message="a count must be >= 1, got {got}")]
    | Annotated[tuple[Annotated[int, Rule(low=0, high=INT_MAX, message="expected an integer from 0 to 2**63-1, "
                                                                       "got {got}")], ...],
                Rule(nonempty=True, message="the list is empty; give at least one seed")]
    | dict[str, Any],
    Rule(message="expected a count (e.g. 3) or a list of integers, got {got}")]
GATE_STAGE_KEYS = ("name", "rungs", "threshold", "at")
GATES_KEYS = ("control", "treatments", "metric", "alpha", "errors", "looks", "target", "max_decades", "law", "draws",
              "stages")


@dataclass(frozen=True, kw_only=True)
class GateStageFile:
    """One `gates.stages:` entry (its values checked by `experiments.gates`)."""

    name: Annotated[str | None, name_rule("gate name")] = None
    rungs: Any = field(metadata=missing("list the ladder's rungs the gate fits on, by index (e.g. [0, 1])"))
    threshold: Any = 1.0
    at: Any = None


@dataclass(frozen=True, kw_only=True)
class GatesFile:
    """`gates:` (`experiments.gates`, which checks the values against the study)."""

    control: Any = field(metadata=missing("name the control arm"))
    treatments: Annotated[tuple[Any, ...] | None, Rule(nonempty=True, one_or_list=True,
                                                       message="expected a non-empty list of arms, got {raw}")] = None
    metric: Any = "val_loss"
    alpha: Any = 0.05
    errors: Any = "each"
    looks: Any = field(metadata=missing("list the seed counts each gate is read at (e.g. [3, 4, 6])"))
    target: Any = ()
    max_decades: Any = 2.0
    law: Any = None
    draws: Any = 400
    stages: Annotated[tuple[Annotated[GateStageFile, Rule(
        message=f"expected a mapping with keys {', '.join(GATE_STAGE_KEYS)}, got {{raw}}")], ...],
                      Rule(nonempty=True, message="expected a non-empty list of gates, got {raw}")] \
        = field(metadata=missing("list the gates in order, each {rungs, threshold}"))


AXES = Rule(nonempty=True, message="expected a mapping of field path -> list of values, got {got}")
AXIS_VALUES = Rule(nonempty=True, message="expected a non-empty list of values, got {got}")


@dataclass(frozen=True, kw_only=True)
class StudyFile:
    """A study file's top level, as written (`experiments.spec.Study` is the validated study)."""

    study: Annotated[str | None, name_rule("study name")] = None
    description: Annotated[str, Rule(max_len=MAX_DESCRIPTION_CHARS, message="expected a string of at most "
                                     f"{MAX_DESCRIPTION_CHARS} characters, got {{got}}")] = ""
    base: Annotated[dict[str, Any] | None, Rule(message="expected a run config mapping (model, residual, data, "
                                                        "optim, train), got {raw}")] = None
    arms: Annotated[dict[str, Annotated[ArmFile | str, Rule(
        message=f"expected a variant name (e.g. prenorm) or a mapping with keys {', '.join(ARM_KEYS)}, got {{raw}}")]]
                    | None, Rule(nonempty=True, message=ARMS_MESSAGE)] = None
    seeds: SEEDS = field(metadata=missing("give a count (e.g. 3) or a list of seeds"))  # or {sequential: ...}
    grid: Annotated[dict[str, Annotated[tuple[Any, ...], AXIS_VALUES]] | None, AXES] = None
    ladder: Annotated[dict[str, Annotated[tuple[Any, ...], AXIS_VALUES]] | None, AXES] = None
    comparisons: Annotated[tuple[Annotated[ComparisonFile, Rule(
        message="expected a mapping with keys name, control, treatments, metric, direction, family, correction, "
                "kind, margin, mei, exploratory, pool, at, got {raw}")], ...] | None,
                           Rule(message="expected a list of comparisons, got {raw}")] = None
    contrasts: Annotated[tuple[Annotated[ContrastFile, Rule(
        message="expected a mapping with keys name, metric, weights, margin, fraction, got {got}")], ...] | None,
                         Rule(message="expected a list of contrasts, got {got}")] = None
    costs: Annotated[tuple[Annotated[str, COST_ITEM], ...], COST_LIST] = ()
    mechanisms: Annotated[tuple[Annotated[str, MECHANISM_ITEM], ...], MECHANISM_LIST] = ()
    limits: Annotated[Limits | None, Rule(message="expected a mapping such as {{max_runs: 10000}}, got {got}")] = None
    tune: Any = None
    resources: Annotated[Resources | None, Rule(message="expected a mapping such as {{gpus_per_run: 8, sharding: "
                                                        "fsdp}}, got {got}")] = None
    evals: Annotated[EvalSpec | None, Rule(null=False, message="expected a mapping with keys tasks, num_fewshot, "
                                                              "limit, at, got {got}")] = None
    interventions: Any = None
    gates: Annotated[GatesFile | None, Rule(null=False, message="expected a mapping with keys "
                                                               f"{', '.join(GATES_KEYS)}, got {{got}}")] = None


__all__ = ["ARMS_MESSAGE", "ARM_KEYS", "ArmFile", "ComparisonFile", "ContrastFile", "DEFAULT_MAX_RUNS", "GATES_KEYS",
           "GATE_STAGE_KEYS", "GateStageFile", "GatesFile", "Limits",
           "MAX_DESCRIPTION_CHARS", "MAX_NAME_CHARS", "MAX_RUNS", "MAX_RUNS_CEILING", "PIPELINE_SCHEDULES", "Resources",
           "ResidualFile", "SHARDINGS", "StudyFile", "name_rule"]
