"""Multi-Head Attention Residuals, full form (arXiv 2607.27230; variants.md section 2).

Full AttnRes (section 1.1) with the pseudo-query of every site split into H contiguous heads of
d/H channels: head h scores `q_h . RMSNorm(s_i)[h]` and mixes only the slice [h] of the sources,
each head with its own softmax over depth. The key RMS is taken over the full width and then
sliced (the released kernel's statistic), which `kernels.depth_read` does for `heads=H`. The
(d,) query is only reshaped to (H, d/H), so the parameters are AttnRes's: 4d per layer plus 2d
for the readout, zero over AttnRes. `heads=1` is `attnres` exactly. Zero queries (the v2 recipe)
make every head's read uniform, so MHAR starts as the pre-norm function (variants.md 0.1).
"""

from __future__ import annotations

from dataclasses import dataclass

from reslab.models.config import ConfigError
from reslab.models.presets import ModelShape
from reslab.models.residual import register
from reslab.models.residual.attnres import AttnRes


def check_heads(heads: int, shape: ModelShape, name: str) -> None:
    """The heads must tile the model width; raised at build time, before any parameter exists."""
    if shape.d_model % heads:
        raise ConfigError(
            f"residual.options ({name}).heads: d_model={shape.d_model} is not divisible by "
            f"heads={heads}; pick a divisor of d_model"
        )


@register("mhar")
class MHAR(AttnRes):
    """Knobs (plus those of `attnres`):
        heads: H, depth-softmax heads per routing site; must divide d_model. The v2 paper's
            optimum is H=4-8 and it adopts 8; v1 used the number of KV heads. Default: 8.
    """

    @dataclass(frozen=True, kw_only=True)
    class Config(AttnRes.Config):
        heads: int = 8

        def __post_init__(self):
            if self.heads < 1:
                raise ValueError(f"heads must be >= 1, got {self.heads}")

    def __init__(self, config, shape, impl: str = "reference"):
        check_heads(config.heads, shape, "mhar")
        super().__init__(config, shape, impl)
        self.heads = config.heads
