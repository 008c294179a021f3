"""Adafactor (`optim.name: adafactor`, `torch.optim.Adafactor`; Shazeer & Stern 2018, torch's variant): the
second moment of each matrix kept factored, one row and one column vector, no first moment. It takes the one
scheduled `optim.lr` and AdamW's two groups (`optim.weight_decay` on the matrices, `decay_scope`); torch's
weight decay is decoupled, as AdamW's. `optim.beta1`, `beta2` and `eps` are AdamW's and are not read.

It refuses `resources.sharding: fsdp`: a rank would hold a shard of each matrix, and the factored moment of a
shard's rows and columns is not the matrix's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from reslab.models.config import OptimConfig
from reslab.models.optim import register_optimizer
from reslab.models.optim.base import Optimizer, decay_groups


@register_optimizer("adafactor")
class Adafactor(Optimizer):
    """Knobs (`optim.options`), torch's, with its defaults:
        beta2_decay: the decay rate of the second moment, beta2_t = 1 - t^beta2_decay; must be <= 0.
            Default: -0.8.
        eps1: added to the second moment's denominator; null: torch's dtype eps. Default: null.
        eps2: the floor of the relative step size. Default: 1e-3.
        d: the clipping threshold of the update's RMS. Default: 1.0.
    """

    shards = False

    @dataclass(frozen=True, kw_only=True)
    class Config:
        beta2_decay: float = -0.8
        eps1: float | None = None
        eps2: float = 1e-3
        d: float = 1.0

    @classmethod
    def errors(cls, config: Any) -> list[str]:
        checks = [
            (config.beta2_decay <= 0, f"beta2_decay: must be <= 0 (got {config.beta2_decay})"),
            (config.eps1 is None or config.eps1 >= 0, f"eps1: must be >= 0 or null (got {config.eps1})"),
            (config.eps2 >= 0, f"eps2: must be >= 0 (got {config.eps2})"),
            (config.d >= 1, f"d: must be >= 1 (got {config.d}); the clipping threshold"),
        ]
        return [rule for ok, rule in checks if not ok]

    @classmethod
    def build(cls, model: nn.Module, optim: OptimConfig, config: Any, device: torch.device) -> torch.optim.Optimizer:
        return torch.optim.Adafactor(decay_groups(model, optim), lr=optim.lr, beta2_decay=config.beta2_decay,
                                     eps=(config.eps1, config.eps2), d=config.d)
