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

from reslab.models.presets import ModelShape
from reslab.models.residual import register
from reslab.models.residual.attnres import AttnRes
from reslab.models.residual.base import Identity


def heads_errors(heads: int, shape: ModelShape) -> list[str]:
    """The depth heads must tile the model width (`check_shape` of every variant with `heads`)."""
    if shape.d_model % heads == 0:
        return []
    divisors = [str(h) for h in range(1, shape.d_model + 1) if shape.d_model % h == 0]
    return [f"heads: {heads} does not divide d_model={shape.d_model}; allowed: a divisor of d_model "
            f"({', '.join(divisors)})"]


@register("mhar")
class MHAR(AttnRes):
    """Knobs (plus those of `attnres`):
        heads: H, depth-softmax heads per routing site; must divide d_model. The v2 paper's
            optimum is H=4-8 and it adopts 8; v1 used the number of KV heads. Default: 8.
    """

    identities = (
        Identity("zero pseudo-queries: every head reads the uniform mean, the stream / N, scaled by N "
                 "(stream_scale) to the pre-norm stream"),
        Identity("H = 1 is AttnRes", options={"heads": 1, "query_init": "normal"}, equals="attnres",
                 equals_options={"query_init": "normal"}),
    )

    @dataclass(frozen=True, kw_only=True)
    class Config(AttnRes.Config):
        heads: int = 8

        def __post_init__(self):
            if self.heads < 1:
                raise ValueError(f"heads must be >= 1, got {self.heads}")

    @classmethod
    def check_shape(cls, config: MHAR.Config, shape: ModelShape) -> list[str]:
        return super().check_shape(config, shape) + heads_errors(config.heads, shape)

    def __init__(self, config, shape, impl: str = "reference"):
        super().__init__(config, shape, impl)
        self.heads = config.heads
