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
    seeds: 3                        # a count (seeds 0, 1, 2) or an explicit list [0, 1, 7], or
                                    # {sequential: {start: 4, batch: 2, max: 16}}: batches until decided
    grid:                           # optional axes over any config field, crossed with each other
      model.preset: [tiny, small]
    ladder:                         # optional scale axis: rung i sets every path to its i-th value
      model.preset: [tiny, small, 100m]
      train.steps: [1000, 4000, 16000]
    contrasts:                      # optional: paired contrasts over arms, per grid point (results.contrasts)
      - {name: u-shape, weights: {h4: -1, h8: 2, h16: -1}}          # two-sided sign flip against 0
      - {name: block-ni, weights: {block: 1, full: -1}, margin: 0.01}  # non-inferiority: below the margin
      - {name: block-keeps, fraction: {control: control, full: full, cheaper: block}}  # Fieller's interval
    costs: [decode_tps, decode_state_bytes]  # optional: cost metrics (common.metrics.COST_METRICS) each
                                    # comparison reads as a paired ratio treatment / control (results.costs)
    mechanisms: [growth, grad_cv]   # optional: mechanism summaries (common.metrics.MECHANISM_METRICS) each
                                    # comparison reads as a paired delta treatment - control (results.mechanisms)
    comparisons:                    # optional
      - name: main                  # default: "<control>-vs-rest"
        control: control
        treatments: [attnres]       # default: every other arm
        metric: val_loss_tail       # default; see common/metrics.py
        direction: minimize         # or maximize; default: the metric's
        family: main                # multiplicity correction family; default: "default"
        correction: holm            # or bh; the family's correction that decides verdicts; default: holm
        kind: superiority           # or equivalence (then `margin:` in the metric's units)
        mei: 0.01                   # minimum effect of interest, metric units (`reslab power` sizes seeds for it)
        exploratory: false          # true: exempt from the power check before `reslab run`
        pool: [model.preset]        # grid axes to pool over (stratified sign flip); default: none
        at: tokens                  # or flops, wall_clock: val_loss read off each run's eval curve at the
                                    # cost every arm reached (results.equal_cost); default: tokens
    evals: {tasks: [reslab_next_line], limit: 500}  # optional: downstream tasks (experiments/evals.py)
    interventions: {kinds: [sources], mode: zero}  # optional: knock-outs on each finished run's eval windows
                                    # (experiments/interventions.py)
    tune:                           # optional: an Optuna search per arm (`reslab tune`); see experiments/tune.py
      trials: 6
      seed: 1000                    # the tuning seed, disjoint from `seeds`
      space: {optim.lr: {type: float, low: 1e-4, high: 1e-2, log: true}}
    gates: {control: control, looks: [3, 4, 6], stages: [{rungs: [0, 1, 2]}]}  # optional, with a ladder:
                                    # promote treatments up it gate by gate (experiments/gates.py)

Precedence when building one run's config, lowest first: `base`, the arm, the grid point, then
command-line `--set` overrides (which apply to every run, e.g. `--set train.steps=6` for a smoke
test; they change the run ids, as they should). An arm's `residual` replaces the base's variant
and knobs as a whole (knobs belong to a variant); `residual.impl` is inherited unless the arm sets
it. A grid axis may not sweep a field an arm sets, nor `residual.name` (that is what arms are
for), nor `train.seed` (that is what `seeds` is for). Grid axes apply to every arm, so an axis over
a residual knob needs every arm's variant to have that knob; a head-count sweep against a
`prenorm` control is written as one arm per head count (see `head_sweep.yaml`).

YAML is read with a safe loader that also rejects duplicate keys (PyYAML silently keeps the last)
and bounds what hostile input could cost (`experiments.study_yaml`: `MAX_FILE_BYTES`, `MAX_DEPTH`,
`MAX_ALIASES`, `MAX_EXPANDED_NODES`); values must be plain data (finite numbers, 64-bit integers, strings).
Before anything is expanded, a study's size (arms x grid points x seeds) is checked against
`limits: {max_runs: N}` (default `DEFAULT_MAX_RUNS`; `--max-runs` overrides it).
`resources: {gpus_per_run: N, sharding: ddp|fsdp}` is how each run is placed (`--gpus-per-run` and
`--sharding` override it): N >= 2 trains one run on N data-parallel ranks (`models.distributed`).
`resources: {gpus_per_run: S x D, pipeline_stages: S, pipeline_schedule: gpipe|1f1b, microbatches: M}` instead
splits each run's layers into S pipeline stages (`models.pipeline`), on D data-parallel replicas of S ranks
each (`models.staged`; D = 1: one rank per stage); each replica's share of each `optim.batch_size` batch goes
through in M micro-batches (M x D must divide it); the loss is the one-process run's, and each run records
the bytes that cross each stage boundary of one replica (`pipe_bytes_per_step`). `pipeline_virtual_stages: V`
splits the layers into S V stages instead, V on each rank, interleaved (LoopedBFS for gpipe, Interleaved 1F1B
for 1f1b), and `pipeline_cache: true` turns on Kimi's cross-stage caching (a rank keeps the state it held at
its previous virtual stage of a micro-batch; only what was appended since crosses). Refused at load, one line
each: gpus_per_run not a multiple of S, more stages than layers (S V of them), micro-batches that do not divide
a replica's share, a variant that cannot cross (`stage_errors`), MoE, Muon, FSDP, micro-batches Interleaved
1F1B cannot take (M x grad_accum a multiple of max(1, M x grad_accum // S)), and a cache without virtual stages
or on a variant whose state is declared whole at every boundary although it keeps tensors (DAR, DeltaAttnRes,
DeltaBlock, DenseFormer: a rank would hold part of a state declared to cross whole). Like the cluster's
address, resources are an execution detail, not part of any run's identity.
Loading validates everything that can be checked without training: the schema, every variant and
knob (via `models.residual.resolve_residual`), every (arm, grid point) config and its model's size
(`experiments.size`, by arithmetic), and the comparisons;
`experiments.expand` then checks that no two arms resolve to the same config.

What each key holds (types, bounds, choices, the words of their errors) is declared in `experiments.schema`
and read by the one typed loader, `models.config.load`; this module checks what needs more than one field.
"""

from __future__ import annotations

import collections
import collections.abc
import dataclasses
import json
import math
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

from reslab.common.metrics import METRICS
from reslab.experiments.checks import (
    allowed_names,
    check_config_path,
    check_objective,
    check_override,
    join_arm_errors,
)
from reslab.experiments.evals import EvalSpec, check_evals
from reslab.experiments.gates import GatesSpec, parse_gates
from reslab.experiments.interventions import InterventionSpec, check_configs, parse_interventions
from reslab.experiments.schema import (
    ARM_KEYS,
    ARMS_MESSAGE,
    MAX_RUNS,
    MAX_RUNS_CEILING,
    PIPELINE_SCHEDULES,
    SHARDINGS,
    ArmFile,
    ComparisonFile,
    ContrastFile,
    Limits,
    Resources,
    StudyFile,
    name_rule,
)
from reslab.experiments.size import check_model_size
from reslab.experiments.study_yaml import SpecError, load_yaml
from reslab.experiments.tune import TuneSpec, parse_tune
from reslab.models.config import (
    TOP,
    ConfigError,
    ModelConfig,
    RunConfig,
    check_plain,
    coerce,
    load,
    set_path,
    shown,
    to_dict,
)
from reslab.models.optim import optimizer_refusal
from reslab.models.presets import MOE_PRESETS, resolve_model
from reslab.models.residual import check_run_shape, get_variant
from reslab.models.resolve import validate_run_config
from reslab.results.comparison import CURVE_METRIC, Comparison
from reslab.results.contrasts import ContrastSpec
from reslab.results.sequential import SequentialDesign, parse_design

TOP_LEVEL_KEYS = tuple(f.name for f in dataclasses.fields(StudyFile))
RESOURCE_KEYS = tuple(f.name for f in dataclasses.fields(Resources))
FRACTION_KEYS = ("control", "full", "cheaper")
# The ladder's name in `Study.grid_sizes` (not a config path, so it cannot clash with a grid axis).
LADDER_AXIS = "ladder"
# Contrast weights are small numbers (-1, 2, -1); outside these sizes their sums and squares overflow or
# vanish in float64 (1e308 + 1e308 = inf).
MIN_WEIGHT, MAX_WEIGHT = 1e-6, 1e6


# ----------------------------------------------------------------------------- the typed study


@dataclass(frozen=True, kw_only=True)
class Arm:
    """One arm: its name and its overrides of the base config (a nested mapping, residual
    normalised to `{name, options[, impl]}`)."""

    name: str
    overrides: dict[str, Any]
    description: str = ""
    # (config field path, value) that `reslab run --from-tune` set from the arm's best trial
    tuned: tuple[tuple[str, Any], ...] = ()

    @property
    def residual(self) -> str:
        return self.overrides["residual"]["name"]


@dataclass(frozen=True, kw_only=True)
class GridAxis:
    path: str
    values: tuple[Any, ...]


@dataclass(frozen=True)
class PipelineResources:
    """`resources.pipeline_stages` S (1: no pipeline), `pipeline_schedule` (gpipe or 1f1b) and `microbatches`
    (the micro-batches each `optim.batch_size` batch is split into through the stages), `pipeline_virtual_stages`
    V (the stages each rank runs, interleaved) and `pipeline_cache` (Kimi's cross-stage caching); `models.pipeline`."""

    stages: int = 1
    schedule: str = "gpipe"
    microbatches: int = 1
    virtual_stages: int = 1
    cache: bool = False


@dataclass(frozen=True)
class StudyResources:
    """`resources:`: GPUs (ranks) per run and how a multi-rank run shards the model or splits it into pipeline
    stages; None: the flags' defaults."""

    gpus_per_run: int | None = None
    sharding: str | None = None
    pipeline: PipelineResources = PipelineResources()

    @property
    def replicas(self) -> int:
        """The data-parallel degree of a pipelined run: gpus_per_run / pipeline_stages (1 without stages)."""
        return max(1, (self.gpus_per_run or 1) // self.pipeline.stages) if self.pipeline.stages > 1 else 1


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
    comparisons: tuple[Comparison, ...]
    overrides: tuple[tuple[str, Any], ...] = ()
    tune: TuneSpec | None = None
    ladder: tuple[GridAxis, ...] = ()  # zipped: rung i sets each path to its values[i]
    contrasts: tuple[ContrastSpec, ...] = ()
    sequential: SequentialDesign | None = None  # `seeds: {sequential: ...}`: seeds run in batches until decided
    resources: StudyResources = StudyResources()
    costs: tuple[str, ...] = ()  # cost metrics every comparison reads as a ratio treatment / control
    mechanisms: tuple[str, ...] = ()  # mechanism summaries every comparison reads as a delta treatment - control
    evals: EvalSpec | None = None  # `evals:`: downstream tasks every finished run is evaluated on
    interventions: InterventionSpec | None = None  # `interventions:`: knock-outs on every finished run's eval windows
    gates: GatesSpec | None = None  # `gates:`: the ladder's seeds read at looks per gate, promotion between gates

    def grid_sizes(self) -> dict[str, int]:
        """Grid axis -> number of values (what `results.power` needs of the grid); a ladder counts
        as one axis, `LADDER_AXIS`, of its rungs (a row per rung, never pooled)."""
        sizes = {axis.path: len(axis.values) for axis in self.grid}
        return sizes | ({LADDER_AXIS: len(self.ladder[0].values)} if self.ladder else {})

    def rungs(self) -> list[tuple[tuple[str, Any], ...]]:
        """The ladder's rungs in file order, each the (path, value) pairs it sets; one empty rung
        without a ladder."""
        if not self.ladder:
            return [()]
        return [tuple((axis.path, axis.values[i]) for axis in self.ladder) for i in range(len(self.ladder[0].values))]

    def scope_points(self) -> list[tuple[tuple[str, Any], ...]]:
        """The grid axes' points alone (a ladder is fitted once per scope point), in file order."""
        points: list[tuple[tuple[str, Any], ...]] = [()]
        for axis in self.grid:
            points = [(*p, (axis.path, v)) for p in points for v in axis.values]
        return points

    def grid_points(self) -> list[tuple[tuple[str, Any], ...]]:
        """Every point a run is trained at: each rung (first, in its paths' order) crossed with the
        grid's points (axes in file order); one empty point without grid and ladder."""
        return [(*rung, *point) for rung in self.rungs() for point in self.scope_points()]

    def config_dict(self, arm: Arm, point: tuple[tuple[str, Any], ...], seed: int) -> dict[str, Any]:
        """The merged (not yet validated) run config of one (arm, grid point, seed)."""
        data = _merge_arm(self.base, arm.overrides)
        for path, value in point:
            data = set_field(data, path, value)
        for path, value in self.overrides:
            data = set_field(data, path, value)
        return set_path(with_preset_moe(data), "train.seed", seed)


# ----------------------------------------------------------------------------- helpers


def _check_name(value: Any, where: str, what: str) -> str:
    """A name the file did not write (the file's stem, a mapping's key, a default) held to `schema.name_rule`."""
    return typing.cast(str, coerce(Annotated[str | None, name_rule(what)], value, where))


def _merge(base: Any, over: Any) -> Any:
    if isinstance(base, dict) and isinstance(over, dict):
        out = dict(base)
        for key, value in over.items():
            out[key] = _merge(base.get(key), value)
        return out
    return over


def set_field(data: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    """`set_path`, where a field of the optional `model.moe` section that the config leaves out (or null)
    starts the section empty; `with_preset_moe` then fills the other fields from what the missing section stands
    for (the preset's MoE, or MoEConfig's defaults on a dense preset), so `--set model.moe.top_k=1` changes one."""
    if path.startswith("model.moe.") and (data.get("model") or {}).get("moe") is None:
        data = set_path(data, "model.moe", {})
    return set_path(data, path, value)


def with_preset_moe(data: dict[str, Any]) -> dict[str, Any]:
    """A `model.moe` section that names only some fields (an arm's `moe: {top_k: 1}`, a tuned `model.moe.*`)
    takes the rest from the preset's MoE (`MOE_PRESETS`), not from MoEConfig's defaults: on `tiny-moe`,
    `{top_k: 1}` keeps its 8 experts of width 96. A dense preset has no MoE to start from: the defaults fill in."""
    model = data.get("model")
    if not isinstance(model, dict) or not isinstance(model.get("moe"), dict):
        return data
    moe, preset = model["moe"], MOE_PRESETS.get(model.get("preset", ModelConfig().preset))
    if preset is None:
        return data
    return {**data, "model": {**model, "moe": {**to_dict(preset), **moe}}}


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


def load_run_config(config_file: str | Path | None, overrides: typing.Sequence[tuple[str, Any]] = (),
                    where: str = "--set", base: dict[str, Any] | None = None) -> RunConfig:
    """One run's config (`reslab train`): `base` or the YAML file if given, then each override in
    order, then the checks every run config passes."""
    data: Any = base or {}
    if config_file is not None:
        if not Path(config_file).is_file():
            raise ConfigError(f"--config: no such file {config_file}")
        data = load_yaml(config_file) or {}
        if not isinstance(data, dict):
            raise ConfigError(f"{config_file}: expected a run config mapping at the top level, got {data!r}")
    for path, value in overrides:
        check_override(path, value, where)
        data = set_field(data, path, value)
    source = str(config_file or "config")
    cfg = validate_run_config(load(RunConfig, with_preset_moe(data), source), where=source)
    check_run_shape(cfg, source)
    return cfg


def _variant_knobs(name: str) -> list[str]:
    from reslab.models.residual import get_variant

    return [f.name for f in dataclasses.fields(get_variant(name).Config)]


# ----------------------------------------------------------------------------- parsing


def _parse_arm(name: Any, value: ArmFile | str) -> Arm:
    where = f"arms.{name}"
    _check_name(name, "arms", "arm name")
    arm = ArmFile(residual=value) if isinstance(value, str) else value
    if isinstance(arm.residual, str):
        residual: dict[str, Any] = {"name": arm.residual, "options": {}}
    else:
        residual = {"name": arm.residual.name, "options": dict(arm.residual.options or {})}
        if arm.residual.impl is not None:
            residual["impl"] = arm.residual.impl
    overrides: dict[str, Any] = {"residual": residual}
    for section in ("model", "data", "optim", "train"):
        if getattr(arm, section) is not None:
            overrides[section] = getattr(arm, section)
    if "seed" in overrides.get("train", {}):
        raise ConfigError(f"{where}.train.seed: seeds come from the study's `seeds:`; remove it here")
    return Arm(name=name, overrides=to_dict(overrides), description=arm.description)


def _parse_pipeline(value: Resources, written: typing.Collection[str]) -> PipelineResources:
    """The pipeline keys of `resources:` (`written`: the keys the file wrote); S stages times the data-parallel
    degree D must be the GPUs per run."""
    stages, cache, virtual = value.pipeline_stages, value.pipeline_cache, value.pipeline_virtual_stages
    if stages == 1:
        extra = [k for k in ("pipeline_schedule", "microbatches", "pipeline_virtual_stages", "pipeline_cache")
                 if k in written]
        if extra:
            raise ConfigError(f"resources.pipeline_stages: {', '.join(extra)} need pipeline_stages >= 2; allowed: "
                              "set pipeline_stages, or drop them")
        return PipelineResources()
    if cache and virtual < 2:
        raise ConfigError("resources.pipeline_cache: Kimi's cross-stage caching needs pipeline_virtual_stages >= 2 "
                          "(with one stage per rank nothing a rank holds is read by a later stage on it); allowed: "
                          "pipeline_virtual_stages >= 2, or no cache")
    n = value.gpus_per_run or 1
    if n % stages:
        raise ConfigError(f"resources.pipeline_stages: {stages} stages do not divide gpus_per_run {n}; allowed: "
                          "stages x data-parallel degree = gpus_per_run")
    if value.sharding == "fsdp":
        raise ConfigError("resources.sharding: fsdp with pipeline_stages is not supported; allowed: ddp "
                          "(each stage holds its layers whole)")
    return PipelineResources(stages, value.pipeline_schedule, value.microbatches, virtual, cache)


def check_pipeline_run(pipeline: PipelineResources, cfg: RunConfig, where: str, replicas: int = 1) -> None:
    """Refuse, in one line, a run config that `resources:`'s pipeline stages on `replicas` data-parallel replicas
    cannot split (before any rank starts): more stages than layers, a variant whose state cannot cross
    (`ResidualPathway.stage_errors`), MoE, micro-batches that do not divide each replica's share of
    `optim.batch_size`, Muon; with virtual stages, more stage modules than layers, Interleaved 1F1B's
    micro-batch counts, and a cache on a state that is not only appended to."""
    if pipeline.stages == 1:
        return
    shape = resolve_model(cfg.model, vocab_size=cfg.model.vocab_size or 256, where=f"{where}.model")
    if pipeline.stages > shape.n_layers:
        raise ConfigError(f"resources.pipeline_stages: {pipeline.stages} stages for {where}'s model of "
                          f"{shape.n_layers} layers; allowed: 2..{shape.n_layers}, each stage at least one layer")
    if cfg.optim.batch_size % (pipeline.microbatches * replicas):
        raise ConfigError(f"resources.microbatches: {pipeline.microbatches} micro-batches x {replicas} replica(s) "
                          f"(gpus_per_run / pipeline_stages) does not divide {where}'s optim.batch_size "
                          f"{cfg.optim.batch_size}; allowed: a batch size that is a multiple of microbatches x "
                          "replicas")
    optimizer_refusal(cfg.optim, ranks=pipeline.stages * replicas, stages=pipeline.stages, where=f"{where}.optim")
    if shape.moe is not None:  # an explicit model.moe, or a preset's (tiny-moe)
        field = "model.moe" if cfg.model.moe is not None else f"model.preset: {cfg.model.preset} is MoE:"
        raise ConfigError(f"{where}.{field} an MoE model with pipeline_stages is not supported (its balance "
                          "losses live on every stage); allowed: a dense model")
    cls = get_variant(cfg.residual.name)
    impl = "reference" if cfg.residual.impl == "auto" else cfg.residual.impl
    errors = cls.stage_errors(load(cls.Config, cfg.residual.options, f"{where}.residual.options"), shape, impl)
    if errors:
        raise ConfigError(f"{where}.residual ({cfg.residual.name}) cannot cross a stage boundary: "
                          + "; ".join(f"residual.{e}" for e in errors))
    if pipeline.virtual_stages > 1:
        _check_virtual_stages(pipeline, cfg, shape, impl)


# models.pipeline's option names, as `resources:` spells them
_PIPELINE_KEYS = {"virtual_stages": "pipeline_virtual_stages", "cross_stage_cache": "pipeline_cache",
                  "microbatches": "microbatches"}


def _check_virtual_stages(pipeline: PipelineResources, cfg: RunConfig, shape: Any, impl: str) -> None:
    """`models.pipeline`'s checks of virtual stages on this run: S V <= layers, Interleaved 1F1B's micro-batches
    (`microbatches` x `optim.grad_accum` a step), and the cache only for a variant whose state only appends."""
    from reslab.models.pipeline import PipelineOptions, cache_error, virtual_error
    from reslab.models.residual import build_pathway

    options = PipelineOptions(pipeline.stages, pipeline.schedule,  # type: ignore[arg-type]
                              pipeline.microbatches * cfg.optim.grad_accum, pipeline.virtual_stages, pipeline.cache)
    error = virtual_error(shape.n_layers, options)
    if error is None and pipeline.cache:
        error = cache_error(build_pathway(cfg.residual, shape, impl), shape.n_layers, options)
    if error:
        key, rest = error.split(":", 1)
        raise ConfigError(f"resources.{_PIPELINE_KEYS.get(key, key)}:{rest}")


def check_study_pipeline(study: Study, replicas: int) -> None:
    """`check_pipeline_run` for every arm at every grid point of `study` on `replicas` data-parallel replicas of
    its stages (the load checks the study's own gpus_per_run; `--gpus-per-run` may ask for another degree)."""
    for arm in study.arms:
        for point in study.grid_points():
            at = f"arms.{arm.name}" + (" at grid point " + _point_label(point) if point else "")
            cfg = load(RunConfig, study.config_dict(arm, point, study.seeds[0]), at)
            check_pipeline_run(study.resources.pipeline, cfg, at, replicas)


def _too_many(what: str, limit: int) -> str:
    return (f"{what}, over the limit of {limit} runs; raise it with `limits: {{max_runs: N}}` "
            f"in the study or --max-runs N (at most {MAX_RUNS_CEILING})")


def _parse_seeds(value: int | tuple[int, ...] | dict[str, Any],
                 limit: int) -> tuple[tuple[int, ...], SequentialDesign | None]:
    """(seeds, the sequential design or None): a count, a list, or `{sequential: {start, batch, max}}`,
    whose seeds are 0..max-1 (the driver runs them in batches, `orchestrator.driving.sequential`)."""
    if isinstance(value, dict):
        if set(value) != {"sequential"}:
            raise ConfigError(f"seeds: a mapping must be {{sequential: {{start, batch, max}}}}, got keys "
                              f"{sorted(value)}; otherwise give a count (e.g. 3) or a list of seeds")
        design = parse_design(value["sequential"])
        return _seed_list(design.max, limit), design
    return _seed_list(value, limit), None


def _seed_list(value: int | tuple[int, ...], limit: int) -> tuple[int, ...]:
    """A count's seeds, or the list's, within the run limit and none twice."""
    count = value if isinstance(value, int) else len(value)
    if count > limit:
        raise ConfigError(f"seeds: {_too_many(f'{count} seeds', limit)}")
    if isinstance(value, int):
        return tuple(range(value))
    dup = sorted(s for s, n in collections.Counter(value).items() if n > 1)
    if dup:
        raise ConfigError(f"seeds: seed(s) {shown(dup)} repeat; each seed is one pair")
    return value


def _value_key(value: Any) -> Any:
    """A value as a config field reads it (1 == 1.0 == true), hashable."""
    value = to_dict(value)
    return json.dumps(value, sort_keys=True) if isinstance(value, (dict, list)) else value


def _parse_axes(value: dict[str, tuple[Any, ...]] | None, limit: int, section: str) -> tuple[GridAxis, ...]:
    """`grid:` or `ladder:`: field path -> non-empty list of values, no path swept twice."""
    if value is None:
        return ()
    axes = []
    for path, values in value.items():
        where = f"{section}.{path}"
        check_config_path(path, section)
        if path == "residual.name" or (section == "ladder" and str(path).startswith("residual")):
            raise ConfigError(f"{where}: sweep variants and their knobs with arms (or a grid), not a "
                              f"{'ladder' if section == 'ladder' else 'grid axis'}")
        if path in ("train.seed", "residual"):
            raise ConfigError(f"{where}: seeds come from the study's `seeds:`")
        if len(values) > limit:
            raise ConfigError(f"{where}: {_too_many(f'{len(values)} values', limit)}")
        if section == "grid":
            keys = [_value_key(v) for v in values]
            dup = [to_dict(v) for i, v in enumerate(values) if keys[i] in keys[:i]]
            if dup:
                raise ConfigError(f"{where}: value(s) {shown(dup)} repeat")
        axes.append(GridAxis(path=path, values=tuple(values)))
    for i, a in enumerate(axes):
        for b in axes[:i]:
            if _overlaps(a.path, b.path):
                raise ConfigError(f"{section}: axes {b.path!r} and {a.path!r} overlap; sweep each field once")
    return tuple(axes)


def _parse_ladder(value: dict[str, tuple[Any, ...]] | None, limit: int,
                  grid: tuple[GridAxis, ...]) -> tuple[GridAxis, ...]:
    """The ladder: paths zipped into rungs, at least 2 of them, no rung repeated, no path a grid
    axis sweeps."""
    ladder = _parse_axes(value, limit, "ladder")
    if not ladder:
        return ()
    lengths = {axis.path: len(axis.values) for axis in ladder}
    if len(set(lengths.values())) > 1:
        raise ConfigError(f"ladder: every path lists one value per rung, but the lengths differ "
                          f"({', '.join(f'{p}: {n}' for p, n in lengths.items())})")
    n = len(ladder[0].values)
    if n < 2:
        raise ConfigError(f"ladder: {n} rung; a ladder needs at least 2 rungs (3 to fit loss against compute)")
    rungs = [tuple(_value_key(axis.values[i]) for axis in ladder) for i in range(n)]
    dup = [i for i, r in enumerate(rungs) if r in rungs[:i]]
    if dup:
        raise ConfigError(f"ladder: rung {dup[0]} repeats rung {rungs.index(rungs[dup[0]])}; each rung is one size")
    for axis in ladder:
        for g in grid:
            if _overlaps(axis.path, g.path):
                raise ConfigError(f"ladder.{axis.path}: grid axis {g.path!r} sweeps it too; set it in one place")
    return ladder


def _parse_comparison(i: int, value: ComparisonFile, arms: list[str], grid: tuple[GridAxis, ...]) -> Comparison:
    where = f"comparisons[{i}]"
    control = value.control
    if control is None:
        raise ConfigError(f"{where}.control: missing; name the control arm (one of {allowed_names(arms)})")
    if control not in arms:
        raise ConfigError(f"{where}.control: {control!r} is not an arm; allowed: {allowed_names(arms)}")
    treatments = [a for a in arms if a != control] if value.treatments is None else list(value.treatments)
    for j, t in enumerate(treatments):
        if t not in arms:
            raise ConfigError(f"{where}.treatments[{j}]: {t!r} is not an arm; allowed: {allowed_names(arms)}")
        if t == control:
            raise ConfigError(f"{where}.treatments[{j}]: {t!r} is the control; a treatment must be another arm")
    if len(set(treatments)) != len(treatments):
        raise ConfigError(f"{where}.treatments: arms repeat: {treatments}")
    metric, direction = check_objective(value.metric, value.direction, where)
    name = value.name if value.name is not None else _check_name(f"{control}-vs-rest", f"{where}.name",
                                                                  "comparison name")
    units = METRICS[metric].unit
    for key in ("margin", "mei"):
        v = getattr(value, key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int | float)
                              or not math.isfinite(v) or v <= 0):
            raise ConfigError(f"{where}.{key}: expected a positive number in {metric}'s units ({units}), "
                              f"got {shown(v)}")
    if value.at != "tokens" and metric != CURVE_METRIC:
        raise ConfigError(f"{where}.at: {value.at} reads each run's eval curve, which holds {CURVE_METRIC}; "
                          f"set metric: {CURVE_METRIC} (or at: tokens for {metric})")
    if value.kind == "equivalence" and value.margin is None:
        raise ConfigError(f"{where}.margin: missing; kind: equivalence needs the margin in {metric}'s units "
                          f"({units})")
    if value.kind == "superiority" and value.margin is not None:
        raise ConfigError(f"{where}.margin: only for kind: equivalence; a superiority comparison takes `mei:`")
    axes = [a.path for a in grid]
    for j, axis in enumerate(value.pool):
        if axis not in axes:
            raise ConfigError(f"{where}.pool[{j}]: {shown(axis)} is not a grid axis; allowed: {allowed_names(axes)}")
    if len(set(value.pool)) != len(value.pool):
        raise ConfigError(f"{where}.pool: axes repeat: {list(value.pool)}")
    return Comparison(
        name=name, control=control, treatments=tuple(treatments), metric=metric, direction=direction,
        family=value.family, correction=value.correction, kind=value.kind, margin=value.margin, mei=value.mei,
        exploratory=value.exploratory, pool=value.pool, at=value.at,
    )


def _parse_contrast(i: int, value: ContrastFile, arms: list[str]) -> ContrastSpec:
    """One `contrasts:` entry: `weights: {arm: w}` summing to 0 (with an optional non-inferiority
    `margin:`), or `fraction: {control, full, cheaper}`."""
    where = f"contrasts[{i}]"
    name = value.name if value.name is not None else _check_name(f"contrast-{i}", f"{where}.name", "contrast name")
    metric, _ = check_objective(value.metric, None, where)
    if (value.weights is None) == (value.fraction is None):
        raise ConfigError(f"{where}: give exactly one of `weights:` (arm: weight, summing to 0) and `fraction:` "
                          f"({{control, full, cheaper}})")
    margin = value.margin
    if margin is not None and (isinstance(margin, bool) or not isinstance(margin, int | float)
                               or not math.isfinite(margin) or margin <= 0):
        raise ConfigError(f"{where}.margin: expected a positive number in {metric}'s units, got {shown(margin)}")
    if value.fraction is not None:
        frac = value.fraction
        if margin is not None:
            raise ConfigError(f"{where}.margin: only for `weights:` (a non-inferiority test), not a fraction")
        if not isinstance(frac, dict) or set(frac) != set(FRACTION_KEYS):
            raise ConfigError(f"{where}.fraction: expected a mapping with exactly the keys "
                              f"{allowed_names(FRACTION_KEYS)}, got {shown(frac)}")
        for key in FRACTION_KEYS:
            if frac[key] not in arms:
                raise ConfigError(f"{where}.fraction.{key}: {shown(frac[key])} is not an arm; allowed: "
                                  f"{allowed_names(arms)}")
        if len({frac[k] for k in FRACTION_KEYS}) != 3:
            raise ConfigError(f"{where}.fraction: control, full and cheaper must be three different arms")
        return ContrastSpec(name=name, metric=metric, fraction=(frac["control"], frac["full"], frac["cheaper"]))
    weights = value.weights
    if not isinstance(weights, dict) or len(weights) < 2:
        raise ConfigError(f"{where}.weights: expected a mapping of at least two arms to weights, got {shown(weights)}")
    for arm, w in weights.items():
        if arm not in arms:
            raise ConfigError(f"{where}.weights.{arm}: not an arm; allowed: {allowed_names(arms)}")
        if (isinstance(w, bool) or not isinstance(w, int | float) or not math.isfinite(w)
                or not MIN_WEIGHT <= abs(w) <= MAX_WEIGHT):
            raise ConfigError(f"{where}.weights.{arm}: expected a non-zero number from {MIN_WEIGHT:g} to "
                              f"{MAX_WEIGHT:g} in size (e.g. -1, 2, -1), got {shown(w)}")
    total = sum(weights.values())
    if abs(total) > 1e-9 * sum(abs(w) for w in weights.values()):
        raise ConfigError(f"{where}.weights: sum to {total:g}; a contrast's weights sum to 0 (e.g. -1, 2, -1)")
    return ContrastSpec(name=name, metric=metric, weights=tuple((a, float(w)) for a, w in weights.items()),
                        margin=None if margin is None else float(margin))


def _unique_names(items: typing.Sequence[Comparison | ContrastSpec], section: str, what: str) -> None:
    names = [c.name for c in items]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ConfigError(f"{section}: name(s) {dup} repeat; give each {what} its own name")


def _parse_comparisons(raw: tuple[ComparisonFile, ...], arms: list[str],
                       grid: tuple[GridAxis, ...]) -> tuple[Comparison, ...]:
    comparisons = tuple(_parse_comparison(i, c, arms, grid) for i, c in enumerate(raw))
    corrections: dict[str, Comparison] = {}
    for i, c in enumerate(comparisons):
        first = corrections.setdefault(c.family, c)
        if first.correction != c.correction:
            raise ConfigError(f"comparisons[{i}].correction: {c.correction!r} differs from {first.correction!r} of "
                              f"{first.name!r} in family {c.family!r}; one family, one correction")
    _unique_names(comparisons, "comparisons", "comparison")
    return comparisons


def _contrast_test(c: ContrastSpec) -> tuple[Any, ...]:
    """What a contrast tests, the same for two that differ only by a positive scale of the weights and margin
    (their p-values and verdicts are equal)."""
    if c.fraction:
        return c.metric, c.fraction
    scale = sum(abs(w) for _, w in c.weights)
    margin = None if c.margin is None else float(f"{c.margin / scale:.12g}")
    return c.metric, tuple(sorted((a, float(f"{w / scale:.12g}")) for a, w in c.weights)), margin


def _parse_contrasts(raw: tuple[ContrastFile, ...], arms: list[str]) -> tuple[ContrastSpec, ...]:
    contrasts: list[ContrastSpec] = []
    first: dict[tuple[Any, ...], int] = {}
    for i, value in enumerate(raw):
        c = _parse_contrast(i, value, arms)
        j = first.setdefault(_contrast_test(c), i)
        if j != i:
            raise ConfigError(f"contrasts[{i}]: {c.name!r} tests what contrasts[{j}] {contrasts[j].name!r} tests "
                              "(the same arms, metric and weights, up to scale); declare each contrast once")
        contrasts.append(c)
    _unique_names(contrasts, "contrasts", "contrast")
    return tuple(contrasts)


def _check_metric_list(data: dict[str, Any], field: str, comparisons: tuple[Comparison, ...],
                       names: tuple[str, ...]) -> tuple[str, ...]:
    """`costs:` or `mechanisms:` (`field` of the study `data`, its `names` loaded): read within the comparisons,
    each name once."""
    if field not in data:
        return ()
    kind = {"costs": ("cost", "a cost is compared as a ratio"),
            "mechanisms": ("mechanism", "a mechanism is compared as a paired delta")}[field]
    if not comparisons:
        raise ConfigError(f"{field}: {kind[1]} within each of the study's comparisons; add a `comparisons:` list")
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ConfigError(f"{field}: {', '.join(dup)} repeat(s); name each {kind[0]} metric once")
    return names


def parse_study(data: Any, path: Path, overrides: typing.Sequence[tuple[str, Any]] = (),
                max_runs: int | None = None) -> Study:
    """Validate a parsed study mapping; errors raise `ConfigError` naming the field path only.
    `max_runs` (the `--max-runs` flag) overrides the study's `limits.max_runs`."""
    if not isinstance(data, dict):
        raise ConfigError(
            f"top level: expected a mapping with keys {allowed_names(TOP_LEVEL_KEYS)}, got {type(data).__name__}")
    for key, value in data.items():
        if key in TOP_LEVEL_KEYS:
            check_plain(value, key)
    if max_runs is not None:  # the flag replaces the file's limit, which is then not read
        max_runs = typing.cast(int, coerce(Annotated[int, MAX_RUNS], max_runs, "--max-runs"))
        if isinstance(data.get("limits"), dict):
            data = {**data, "limits": {**data["limits"], "max_runs": max_runs}}
    raw: StudyFile = load(StudyFile, data, TOP)
    limit = max_runs if max_runs is not None else (raw.limits or Limits()).max_runs
    written = raw.resources or Resources()
    resources = StudyResources(written.gpus_per_run, written.sharding,
                               _parse_pipeline(written, data.get("resources") or {}))
    name = raw.study if raw.study is not None else _check_name(path.stem, "study", "study name")
    description = raw.description

    base = raw.base or {}
    load(RunConfig, base, "base")  # strict: unknown keys and wrong types
    if "seed" in (base.get("train") or {}):
        raise ConfigError("base.train.seed: seeds come from the study's `seeds:`; remove it here")
    base = to_dict(base)

    overrides = tuple(overrides)
    for path_, value_ in overrides:
        check_override(path_, value_)
        if path_ == "train.seed":
            raise ConfigError("--set train.seed: seeds come from the study's `seeds:`")

    if not raw.arms:
        raise ConfigError(f"arms: {ARMS_MESSAGE}")
    arms = [_parse_arm(k, v) for k, v in raw.arms.items()]

    seeds, sequential = _parse_seeds(raw.seeds, limit)
    grid = _parse_axes(raw.grid, limit, "grid")
    ladder = _parse_ladder(raw.ladder, limit, grid)
    points = math.prod(len(axis.values) for axis in grid)
    rungs = len(ladder[0].values) if ladder else 1
    total = len(arms) * rungs * points * len(seeds)
    if total > limit:
        shape = (f"{len(arms)} arms x {f'{rungs} rungs x ' if ladder else ''}{points} grid points x {len(seeds)} "
                 f"seeds = {total} runs")
        raise ConfigError(f"{'ladder' if ladder else 'grid' if grid else 'seeds'}: {_too_many(shape, limit)}")

    for arm in arms:
        arm_paths = _leaf_paths({k: v for k, v in arm.overrides.items() if k != "residual"})
        arm_paths += [f"residual.options.{k}" for k in arm.overrides["residual"]["options"]]
        for axis in grid + ladder:
            clash = [p for p in arm_paths if _overlaps(p, axis.path)]
            if clash:
                what = "grid axis" if axis in grid else "the ladder"
                raise ConfigError(
                    f"arms.{arm.name}: sets {clash[0]}, which {what} {axis.path!r} also sweeps; "
                    "set it in one place"
                )

    arm_names = [a.name for a in arms]
    comparisons = _parse_comparisons(raw.comparisons or (), arm_names, grid)
    contrasts = _parse_contrasts(raw.contrasts or (), arm_names)
    costs = _check_metric_list(data, "costs", comparisons, raw.costs)
    mechanisms = _check_metric_list(data, "mechanisms", comparisons, raw.mechanisms)
    gates = parse_gates(raw.gates, arm_names, rungs if ladder else 0, seeds, sequential is not None, bool(grid))
    if sequential is not None and not comparisons:
        raise ConfigError("seeds.sequential: a sequential study stops when its comparisons are decided; add a "
                          "`comparisons:` list")
    tune = parse_tune(data["tune"], arm_names, seeds, bool(grid or ladder)) if "tune" in data else None
    study = Study(
        name=name, path=path, description=description, base=base, arms=tuple(arms),
        seeds=seeds, grid=grid, comparisons=comparisons, overrides=overrides, tune=tune, ladder=ladder,
        contrasts=contrasts, sequential=sequential, resources=resources, costs=costs, mechanisms=mechanisms,
        evals=check_evals(raw.evals) if raw.evals is not None else None, gates=gates,
        interventions=parse_interventions(data["interventions"], arm_names) if "interventions" in data else None,
    )
    _check_arms(study)
    return study


def _check_interventions(study: Study, spec: InterventionSpec) -> None:
    """The `interventions:` request against what each arm's variant has, at each grid point (one line)."""
    check_configs(spec, [(arm.name, "grid point " + _point_label(point) if point else "",
                          validate_run_config(load(RunConfig, study.config_dict(arm, point, study.seeds[0]))))
                         for arm in study.arms if spec.applies(arm.name) for point in study.grid_points()])


def _point_label(point: tuple[tuple[str, Any], ...]) -> str:
    return ", ".join(f"{p}={v!r}" for p, v in point)


def _check_arms(study: Study) -> None:
    """Every arm at every grid point must be a valid run config: variant, knobs, values; knobs that
    do not fit the model shape are reported together, for every arm, in one error."""
    knobs_of: dict[str, list[str]] = {}
    shape_errors: list[tuple[str, str]] = []
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
                        f"no knob {knob!r}; its knobs: {allowed_names(knobs_of[arm.residual])}. Grid axes apply to "
                        "every arm; write one arm per value instead (see experiments/head_sweep.yaml)"
                    )
        for point in study.grid_points():
            at = where + (" at grid point " + _point_label(point) if point else "")
            cfg = load(RunConfig, study.config_dict(arm, point, study.seeds[0]), at)
            # a model no run can hold is refused by arithmetic, before any check could build a tensor of it
            check_model_size(resolve_model(cfg.model, vocab_size=cfg.model.vocab_size or 256, where=f"{at}.model"),
                             None, at)
            try:
                check_run_shape(validate_run_config(cfg, where=at), at)
            except ConfigError as exc:
                shape_errors.append((at, str(exc)))
                continue
            check_pipeline_run(study.resources.pipeline, cfg, at, study.resources.replicas)
    if shape_errors:
        raise ConfigError(join_arm_errors(shape_errors))
    if study.interventions is not None:
        _check_interventions(study, study.interventions)


def load_study(path: str | Path, overrides: typing.Sequence[tuple[str, Any]] = (),
               max_runs: int | None = None) -> Study:
    """Read and validate a study file; every error is a `SpecError` that starts with the file.
    `max_runs` (`--max-runs`) overrides the study's `limits.max_runs`."""
    path = Path(path)
    data = load_yaml(path)
    try:
        return parse_study(data, path, overrides, max_runs)
    except SpecError:
        raise
    except ConfigError as exc:
        raise SpecError(f"{path}: {exc}") from None


__all__ = [
    "ARM_KEYS", "Arm", "Comparison", "GridAxis", "LADDER_AXIS", "METRICS", "PIPELINE_SCHEDULES", "PipelineResources",
    "RESOURCE_KEYS", "SHARDINGS", "SpecError",
    "Study", "StudyResources", "TOP_LEVEL_KEYS", "check_study_pipeline", "load_run_config", "load_study", "load_yaml",
    "parse_study",
]
