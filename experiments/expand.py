"""Expansion of a study into runs, and the run identity.

One `RunSpec` per (arm, grid point, seed). Its `run_id` is

    <variant>-<sha256(canonical JSON of {"results_version": RESULTS_VERSION,
                                          "config": the resolved run config})[:12]>

where the resolved config is `models.resolve.validate_run_config`'s output, so a knob left at its
default and the same knob written out give the same id. What does not enter the hash, on purpose:

- the study, arm and file names: the same config in two studies is the same computation;
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

import hashlib
import json
from dataclasses import dataclass
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


def run_id_of(cfg: RunConfig) -> str:
    """The run identity of a *resolved* config (see the module docstring)."""
    payload = {"results_version": RESULTS_VERSION, "config": to_dict(cfg)}
    digest = hashlib.sha256(canonical_json(payload).encode()).hexdigest()[:12]
    return f"{cfg.residual.name}-{digest}"


@dataclass(frozen=True, kw_only=True)
class RunSpec:
    """One run of a study: which arm, grid point and seed, its resolved config and its id."""

    study: str
    arm: str
    grid: tuple[tuple[str, Any], ...]
    seed: int
    config: RunConfig
    run_id: str

    @property
    def grid_key(self) -> str:
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
    to one config."""
    runs: list[RunSpec] = []
    owner: dict[str, RunSpec] = {}
    for seed in study.seeds if seeds is None else seeds:
        for point in study.grid_points():
            for arm in study.arms:
                where = f"arms.{arm.name}"
                try:
                    cfg = resolve_config(study.config_dict(arm, point, seed), where)
                except ConfigError as exc:
                    raise SpecError(f"{study.path}: {exc}") from None
                spec = RunSpec(
                    study=study.name, arm=arm.name, grid=point, seed=seed, config=cfg, run_id=run_id_of(cfg)
                )
                if spec.run_id in owner:
                    other = owner[spec.run_id]
                    at = f" at grid point {spec.grid_key}" if point else ""
                    raise SpecError(
                        f"{study.path}: arms.{arm.name}: resolves to the same config as arms.{other.arm}{at} "
                        f"(run id {spec.run_id}); two arms must differ in at least one field"
                    )
                owner[spec.run_id] = spec
                runs.append(spec)
    return runs


__all__ = ["RESULTS_VERSION", "RunSpec", "expand", "format_value", "grid_key_of", "resolve_config", "rung_keys",
           "run_id_of"]
