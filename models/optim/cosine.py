"""The default schedule: linear warmup to `optim.lr` over `optim.warmup_steps`, then cosine decay to
`min_lr_ratio * lr` at the last step. No knobs of its own."""

from __future__ import annotations

import math
from typing import Any

from reslab.models.config import OptimConfig
from reslab.models.optim import register_schedule
from reslab.models.optim.base import Schedule


@register_schedule("cosine")
class Cosine(Schedule):
    flat_prefix = ""  # no knobs, then or now

    @classmethod
    def lr(cls, step: int, total: int, optim: OptimConfig, config: Any) -> float:
        o = optim
        if step < o.warmup_steps:
            return o.lr * (step + 1) / o.warmup_steps
        span = max(1, total - 1 - o.warmup_steps)
        progress = min(1.0, (step - o.warmup_steps) / span)
        return o.lr * (o.min_lr_ratio + (1 - o.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))
