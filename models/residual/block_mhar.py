"""Multi-Head Attention Residuals, block form (arXiv 2607.27230; variants.md sections 2.2, 1.2).

Block AttnRes sources (the embedding, completed block sums, the current partial block) read
with MHAR's H-head depth softmax: the pseudo-query split into H contiguous heads, key RMSNorm
over the full width then sliced per head. Same parameters as Block AttnRes (4d per layer plus
2d for the readout); `heads=1` is `block_attnres` exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

from reslab.models.presets import ModelShape
from reslab.models.residual import register
from reslab.models.residual.base import Identity
from reslab.models.residual.block_attnres import BlockAttnRes
from reslab.models.residual.mhar import heads_errors


@register("block_mhar")
class BlockMHAR(BlockAttnRes):
    """Knobs (plus those of `block_attnres`):
        heads: H, depth-softmax heads per routing site; must divide d_model. Default: 8.
    """

    identities = (
        Identity("zero pseudo-queries: every head reads the uniform mean of the block sums, scaled by N "
                 "(stream_scale) to the pre-norm stream"),
        Identity("H = 1 is Block AttnRes", options={"heads": 1, "query_init": "normal"}, equals="block_attnres",
                 equals_options={"query_init": "normal"}),
    )

    @dataclass(frozen=True, kw_only=True)
    class Config(BlockAttnRes.Config):
        heads: int = 8

        def __post_init__(self):
            super().__post_init__()
            if self.heads < 1:
                raise ValueError(f"heads must be >= 1, got {self.heads}")

    @classmethod
    def check_shape(cls, config: BlockMHAR.Config, shape: ModelShape) -> list[str]:
        return super().check_shape(config, shape) + heads_errors(config.heads, shape)

    def __init__(self, config, shape, impl: str = "reference"):
        super().__init__(config, shape, impl)
        self.heads = config.heads
