"""Warmup-stable-decay (`optim.schedule: wsd`; Hu et al. 2024, MiniCPM): linear warmup, the peak lr held, then
a cooldown over the last `cooldown_fraction` of the steps to `min_lr_ratio * lr`, `linear` or `1-sqrt`
(Hagele et al. 2024 find 1-sqrt best)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

from reslab.models.config import OptimConfig
from reslab.models.optim import register_schedule
from reslab.models.optim.base import Schedule


def wsd_factor(step: int, total: int, o: OptimConfig, config: Any) -> float:
    """The multiple of `lr` at 0-based `step` of `total` under warmup-stable-decay: `(step + 1) / warmup`
    during warmup; 1 until the cooldown's n = round(cooldown_fraction * total) last steps (never into the
    warmup); then `min + (1 - min) * f(p)` with p = (step - start + 1) / n, reaching `min_lr_ratio` at the
    last step, f(p) = 1 - p (`linear`) or 1 - sqrt(p) (`1-sqrt`)."""
    if step < o.warmup_steps:
        return (step + 1) / o.warmup_steps
    start = max(o.warmup_steps, total - round(config.cooldown_fraction * total))
    if step < start:
        return 1.0
    p = min(1.0, (step - start + 1) / (total - start))
    f = 1 - p if config.cooldown_shape == "linear" else 1 - math.sqrt(p)
    return o.min_lr_ratio + (1 - o.min_lr_ratio) * f


@register_schedule("wsd")
class WarmupStableDecay(Schedule):
    """Knobs (`optim.schedule_options`; before issue 50 the flat fields `optim.<knob>`):
        cooldown_fraction: the share of the steps the cooldown takes, in [0, 1]. Default: 0.1.
        cooldown_shape: `linear` or `1-sqrt`. Default: 1-sqrt.
    """

    flat_prefix = ""

    @dataclass(frozen=True, kw_only=True)
    class Config:
        cooldown_fraction: float = 0.1
        cooldown_shape: Literal["linear", "1-sqrt"] = "1-sqrt"

    @classmethod
    def errors(cls, config: Any) -> list[str]:
        if 0 <= config.cooldown_fraction <= 1:
            return []
        return [f"cooldown_fraction: must be in [0, 1] (got {config.cooldown_fraction}); the share of the steps the "
                "wsd cooldown takes"]

    @classmethod
    def lr(cls, step: int, total: int, optim: OptimConfig, config: Any) -> float:
        return optim.lr * wsd_factor(step, total, optim, config)
