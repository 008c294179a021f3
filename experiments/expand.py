"""Expansion of a study into runs, and the run identity.

One `RunSpec` per (arm, grid point, seed). Its `run_id` is

    <arm>-<sha256(canonical JSON of {"results_version": RESULTS_VERSION,
                                      "config": the resolved run config})[:12]>

(the arm's name tells two arms of one variant apart, e.g. AdamW and Muon; the hash alone is the computation)

where the resolved config is `models.resolve.validate_run_config`'s output, so a knob left at its
default and the same knob written out give the same id. What does not enter the hash, on purpose:

- the study, arm and file names: the same config in two studies is the same computation (the same hash);
- execution details (Ray address, resources, tracking URI, workspace, concurrency): a run is a
  pure function of its config, wherever it runs;
- the git commit: it is recorded as a tag and in `env.json`, not hashed, so an unrelated commit
  does not invalidate finished runs. A change that alters numbers bumps `RESULTS_VERSION` on
  purpose (marin's declared-version lesson), which gives every run a new id.

Hashing the whole config (not opt-in fields) means adding a config field changes every id; that
recomputes rather than silently reusing stale results, which is the failure that matters.

The pair key is (grid point, seed): the seed fixes initialisation and data order identically in
every arm (`train.data_seed` follows `train.seed` unless the base pins it), so runs that share a
pair key differ only by the arm.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

from reslab.experiments.spec import SpecError, Study
from reslab.models.config import ConfigError, RunConfig, canonical_json, load, to_dict
from reslab.models.resolve import validate_run_config

# Bump (to the date of the change; `.2`, `.3` for later ones that day) when a change to models/,
# kernels/ or the data layer alters the numbers a finished run would produce; every run id changes
# with it. 2026.12.01.2: training windows without replacement, eval windows by count.
RESULTS_VERSION = "2026.12.01.2"


def format_value(value: Any) -> str:
    """A grid value as it appears in grid keys: strings bare, everything else as compact JSON."""
    return value if isinstance(value, str) else json.dumps(to_dict(value), separators=(",", ":"))


def grid_key_of(point: tuple[tuple[str, Any], ...]) -> str:
    """`"model.preset=small,residual.options.heads=4"`; `""` for a study without grid axes."""
    return ",".join(f"{path}={format_value(value)}" for path, value in point)


def rung_keys(study: Study, point: tuple[tuple[str, Any], ...] = ()) -> list[str]:
    """The grid key of each rung of the study's ladder at a point of its grid axes, rung order."""
    return [grid_key_of((*rung, *point)) for rung in study.rungs()]


def run_id_of(cfg: RunConfig, name: str | None = None) -> str:
    """The run identity of a *resolved* config (see the module docstring): `name` (the arm's; the variant's
    when None) and the config's hash."""
    payload = {"results_version": RESULTS_VERSION, "config": to_dict(cfg)}
    digest = hashlib.sha256(canonical_json(payload).encode()).hexdigest()[:12]
    return f"{name or cfg.residual.name}-{digest}"


def with_seed(cfg: RunConfig, seed: int) -> RunConfig:
    """`cfg` with `train.seed` set: `dataclasses.replace` without its checks (a study's seeds are checked when
    it is read, `spec._seed_list`), a tenth of its cost; the configs are frozen, so the two copies share the
    rest of the config."""
    train = object.__new__(type(cfg.train))
    train.__dict__.update(cfg.train.__dict__, seed=seed)
    out = object.__new__(type(cfg))
    out.__dict__.update(cfg.__dict__, train=train)
    return out


_SEED_MARK = 7_355_608_001_234_567_891  # stands for train.seed in `SeedIds`' template; never a seed of a study


class SeedIds:
    """`run_id_of` of one resolved config at every seed, from one serialisation: its canonical JSON with
    `train.seed` cut out, the seed's digits put back (JSON writes an int as `str` does). The same ids as
    `run_id_of(config with train.seed = seed)` (a test holds it), in ~2 us instead of ~400."""

    def __init__(self, cfg: RunConfig, name: str | None = None) -> None:
        data = to_dict(cfg)
        data["train"]["seed"] = _SEED_MARK
        text = canonical_json({"results_version": RESULTS_VERSION, "config": data})
        mark = str(_SEED_MARK)
        if text.count(mark) != 1:  # the mark elsewhere in the config: never in practice; hash whole then
            self.parts: tuple[bytes, bytes] | None = None
        else:
            head, tail = text.split(mark)
            self.parts = (head.encode(), tail.encode())
        self.cfg, self.name = cfg, name or cfg.residual.name

    def __call__(self, seed: int) -> str:
        if self.parts is None:
            return run_id_of(replace(self.cfg, train=replace(self.cfg.train, seed=seed)), self.name)
        head, tail = self.parts
        return f"{self.name}-{hashlib.sha256(head + str(int(seed)).encode() + tail).hexdigest()[:12]}"


@dataclass(frozen=True, kw_only=True)
class RunSpec:
    """One run of a study: which arm, grid point and seed, its resolved config and its id."""

    study: str
    arm: str
    grid: tuple[tuple[str, Any], ...]
    seed: int
    config: RunConfig
    run_id: str

    @functools.cached_property
    def grid_key(self) -> str:  # kept: the readouts ask each of 10^5 runs for it several times (issue 39)
        return grid_key_of(self.grid)

    @property
    def pair(self) -> tuple[str, int]:
        """(grid key, seed): runs of different arms with the same pair are seed-matched."""
        return (self.grid_key, self.seed)

    @property
    def pair_key(self) -> str:
        return f"{self.grid_key}|seed={self.seed}" if self.grid else f"seed={self.seed}"

    @property
    def label(self) -> str:
        """Human name, also the MLflow run name: `arm/grid point/s<seed>`."""
        return "/".join([self.arm, *([self.grid_key] if self.grid else []), f"s{self.seed}"])

    def to_dict(self) -> dict[str, Any]:
        return {
            "run_id": self.run_id, "study": self.study, "arm": self.arm, "grid_key": self.grid_key,
            "grid": {p: to_dict(v) for p, v in self.grid}, "seed": self.seed, "pair_key": self.pair_key,
            "results_version": RESULTS_VERSION, "config": to_dict(self.config),
        }


def resolve_config(data: dict[str, Any], where: str) -> RunConfig:
    return validate_run_config(load(RunConfig, data, where), where=where)


def expand(study: Study, seeds: tuple[int, ...] | None = None) -> list[RunSpec]:
    """Every run of the study (or of `seeds` only), ordered seed-major (all arms of seed 0 first) so
    that a partially finished study has complete pairs early; raises `SpecError` if two arms resolve
    to one config. `iter_runs` yields the same runs one at a time."""
    return list(iter_runs(study, seeds))


def count_runs(study: Study, seeds: tuple[int, ...] | None = None) -> int:
    """How many runs `iter_runs` yields, without building one: seeds x grid points x arms."""
    points = math.prod(len(axis.values) for axis in study.grid) * (len(study.ladder[0].values) if study.ladder else 1)
    return len(study.seeds if seeds is None else seeds) * points * len(study.arms)


def _resolve_point(study: Study, point: tuple[tuple[str, Any], ...], seed: int,
                   owner: dict[str, str]) -> list[RunConfig]:
    """Each arm's resolved config at `point` (seed `seed`), checked for two arms resolving to one config."""
    configs = []
    for arm in study.arms:
        where = f"arms.{arm.name}"
        try:
            cfg = resolve_config(study.config_dict(arm, point, seed), where)
        except ConfigError as exc:
            raise SpecError(f"{study.path}: {exc}") from None
        run_id = run_id_of(cfg)
        if run_id in owner:
            at = f" at grid point {grid_key_of(point)}" if point else ""
            raise SpecError(
                f"{study.path}: arms.{arm.name}: resolves to the same config as arms.{owner[run_id]}{at} "
                f"(run id {run_id}); two arms must differ in at least one field"
            )
        owner[run_id] = arm.name
        configs.append(cfg)
    return configs


def iter_runs(study: Study, seeds: tuple[int, ...] | None = None, *, cache_points: int = 4096) -> Iterator[RunSpec]:
    """`expand`'s runs, lazily, in its order. A seed sets `train.seed` alone (a data seed left to follow it
    stays null), so each (arm, grid point) is resolved and checked once, at the first seed, and the other
    seeds' configs are that config with its seed replaced: the same config `resolve_config` gives (a test
    holds it). With at most `cache_points` grid points the resolved configs are kept between seeds; a
    larger grid is resolved again per seed, so memory stays bounded by the points kept, never the runs."""
    seeds = study.seeds if seeds is None else seeds
    points = study.grid_points()
    owner: dict[str, str] = {}  # run id -> arm, at the first seed: two arms resolving to one config
    cached: dict[int, list[tuple[RunConfig, SeedIds]]] = {}
    for n, seed in enumerate(seeds):
        for i, point in enumerate(points):
            configs = cached.get(i)
            if configs is None:
                resolved = _resolve_point(study, point, seeds[0], owner if n == 0 else {})
                configs = [(c, SeedIds(c, a.name)) for a, c in zip(study.arms, resolved, strict=True)]
                if len(points) <= cache_points:
                    cached[i] = configs
            for arm, (base, ids) in zip(study.arms, configs, strict=True):
                cfg = base if n == 0 else with_seed(base, seed)
                yield RunSpec(study=study.name, arm=arm.name, grid=point, seed=seed, config=cfg, run_id=ids(seed))


__all__ = ["RESULTS_VERSION", "RunSpec", "count_runs", "expand", "format_value", "grid_key_of", "iter_runs",
           "resolve_config", "rung_keys", "run_id_of"]
