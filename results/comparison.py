"""The one declared-comparison type: what the study spec builds and what the statistics run.

A pure module (no pandas, no scipy), so the spec loader can build a `Comparison` directly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from reslab.common.errors import ConfigError

__all__ = ["COSTS", "CORRECTIONS", "Comparison", "Correction", "Cost", "Direction", "KINDS", "Kind"]

Direction = Literal["minimize", "maximize"]
Kind = Literal["superiority", "equivalence"]
Correction = Literal["holm", "bh"]
Cost = Literal["tokens", "flops", "wall_clock"]

DIRECTIONS: tuple[str, ...] = ("minimize", "maximize")
KINDS: tuple[str, ...] = ("superiority", "equivalence")
CORRECTIONS: tuple[str, ...] = ("holm", "bh")
COSTS: tuple[str, ...] = ("tokens", "flops", "wall_clock")
AT_WORDS = {"tokens": "tokens", "flops": "FLOPs", "wall_clock": "wall-clock"}
# The metric a comparison at equal FLOPs or wall-clock reads from each run's eval curve.
CURVE_METRIC = "val_loss"


@dataclass(frozen=True, kw_only=True)
class Comparison:
    """Each treatment arm against the control arm on one metric; deltas are treatment - control.

    Args:
        name: label carried into every output row.
        control: the control arm.
        treatments: treatment arms, each compared with ``control`` separately.
        metric: the metric column of the runs table. Default: ``"val_loss_tail"``.
        direction: ``"minimize"`` when lower is better. Default: ``"minimize"``.
        family: rows sharing a family are corrected together. Default: ``"default"``.
        correction: the family's correction that decides the verdict, ``"holm"`` (family-wise
            error) or ``"bh"`` (false discovery rate); both adjusted p are always reported.
            Default: ``"holm"``.
        kind: ``"superiority"`` (is there a difference?) or ``"equivalence"`` (is the difference
            within ``margin``?). Default: ``"superiority"``.
        margin: equivalence margin in the metric's units; required for (and only for) equivalence.
        mei: minimum effect of interest in the metric's units: the effect `reslab power` sizes seeds
            to detect, and the bound of the equivalence test (TOST within +-mei) that a superiority
            row also runs: a row whose TOST passes is "equivalent". "better"/"worse" test against 0,
            not against the mei (family-adjusted sign-flip p <= alpha and the CI excludes 0), so the
            CI of a "better" row may reach inside +-mei: the effect is real, its size may fall short of
            the mei. Requiring the CI beyond the mei would test "effect > mei", which has at most 50%
            power when the true effect is the mei the seeds were sized for. Default: None (no
            equivalence test; seeds sized with `reslab power --mei`).
        exploratory: True exempts the comparison from the power check before a run. Default: False.
        pool: grid axes to pool over: per-stratum rows plus one pooled row per treatment (and
            per point of the other axes), tested with a stratified sign flip. Default: none.
        at: the cost at which arms are compared: ``"tokens"`` (each run's own value: every arm trains
            the same tokens), ``"flops"`` or ``"wall_clock"`` (each arm's ``val_loss`` read from its
            eval curve at the cost every arm of the comparison reached on that grid point and seed:
            a routing arm that costs more per token is read before its end). Default: ``"tokens"``.
    """

    name: str
    control: str
    treatments: tuple[str, ...]
    metric: str = "val_loss_tail"
    direction: Direction = "minimize"
    family: str = "default"
    correction: Correction = "holm"
    kind: Kind = "superiority"
    margin: float | None = None
    mei: float | None = None
    exploratory: bool = False
    pool: tuple[str, ...] = ()
    at: Cost = "tokens"

    def __post_init__(self) -> None:
        treatments = (self.treatments,) if isinstance(self.treatments, str) else tuple(self.treatments)
        object.__setattr__(self, "treatments", treatments)
        object.__setattr__(self, "pool", (self.pool,) if isinstance(self.pool, str) else tuple(self.pool))
        where = f"comparison {self.name!r}"
        if not treatments:
            raise ConfigError(f"{where}: treatments is empty; give at least one arm")
        if self.control in treatments:
            raise ConfigError(f"{where}: control arm {self.control!r} is also a treatment")
        if len(set(treatments)) != len(treatments):
            raise ConfigError(f"{where}: treatments repeat an arm: {list(treatments)}")
        for field, value, allowed in (("direction", self.direction, DIRECTIONS), ("kind", self.kind, KINDS),
                                      ("correction", self.correction, CORRECTIONS), ("at", self.at, COSTS)):
            if value not in allowed:
                raise ConfigError(f"{where}: {field} {value!r} is not allowed; allowed: {', '.join(allowed)}")
        for field in ("margin", "mei"):
            value = getattr(self, field)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)
                                      or not math.isfinite(value) or value <= 0):
                raise ConfigError(f"{where}: {field} {value!r} is not allowed; give a positive number in the "
                                  f"units of {self.metric}")
        if self.kind == "equivalence" and self.margin is None:
            raise ConfigError(f"{where}: margin is missing; an equivalence comparison needs `margin:` in the units "
                              f"of {self.metric}")
        if self.kind == "superiority" and self.margin is not None:
            raise ConfigError(f"{where}: margin is only for kind: equivalence; a superiority comparison takes `mei:`")
        if not isinstance(self.exploratory, bool):
            raise ConfigError(f"{where}: exploratory {self.exploratory!r} is not allowed; allowed: true, false")
        if len(set(self.pool)) != len(self.pool):
            raise ConfigError(f"{where}: pool repeats an axis: {list(self.pool)}")
        if self.at != "tokens" and self.metric != CURVE_METRIC:
            raise ConfigError(f"{where}: at {self.at!r} reads each run's eval curve, which holds {CURVE_METRIC}; "
                              f"use metric: {CURVE_METRIC} (or at: tokens for {self.metric})")

    @property
    def threshold(self) -> float:
        """The margin of an equivalence comparison, the MEI of a superiority one (0 when none)."""
        value = self.margin if self.kind == "equivalence" else self.mei
        return float(value) if value is not None else 0.0

    def describe(self) -> str:
        """One line: arms, metric, kind with its MEI or margin, family and correction, and the declared flags."""
        if self.kind == "equivalence":
            size = f"margin {self.margin:g}"
        else:
            size = f"mei {self.mei:g}" if self.mei else "no mei"
        flags = (", exploratory" if self.exploratory else "") + (
            f", pooled over {', '.join(self.pool)}" if self.pool else "") + (
            f", at equal {AT_WORDS[self.at]}" if self.at != "tokens" else "")
        return (f"{self.name}: {self.control} vs {', '.join(self.treatments)} on {self.metric} ({self.direction}, "
                f"{self.kind}, {size}, family {self.family}, {self.correction}{flags})")
