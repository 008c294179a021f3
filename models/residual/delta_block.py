"""Delta Block AttnRes (Luo, Cai, Hu, https://arxiv.org/abs/2605.18855; variants.md 5.2, 5.4).

Additive routing as in `delta_attnres`, but over block deltas: sources are `[e, D_1, ..., D_{n-1}]`,
the completed blocks only (the current partial block is excluded). With `layers_per_block =
ceil(L / num_blocks)`, a new source is appended at every layer with `layer % layers_per_block == 0`
(layer 0 appends `e`), computed from the stream before that layer's attention output is added and
appended after that attention has routed: at a boundary layer the attention route does not see
the new delta, the MLP route does (the released code's bookkeeping).

`block_delta` chooses what is appended. Example, L=8 and num_blocks=4 (boundaries at layers 0, 2,
4, 6; D_b = h(end of block b) - h(start of block b), block b = layers 2(b-1), 2(b-1)+1), sources
seen by the MLP of layer 6:
    "intended": [e, D_1, D_2, D_3]                 (the commented-out model-level path)
    "released": [e, D_1, e + D_2, D_1 + D_3]        (the layer code's `partial - blocks[-1]`)
The published numbers were produced with the released semantics.

The sources do not sum to the stream, so unlike `delta_attnres` this is NOT prenorm's function at
init with zero queries (variants.md 0.1); gate="learnable_alpha" with gate_init=0 is exactly the
identity (the MHAR 8B conversion, variants.md 5.4; its read scale c_s is then 1). Every other
knob is `delta_attnres`'s, `stream_scale` included (the same constant c_s, though here it does not
make the ungated read the pre-norm stream). Interventions are `delta_attnres`'s over these sources:
"emb" and "block1", ... (the deltas appended at the boundaries, as `block_delta` computes them).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

from torch import Tensor

from reslab.models.presets import ModelShape
from reslab.models.residual import register
from reslab.models.residual.base import Identity
from reslab.models.residual.delta_attnres import DeltaAttnRes, DeltaState


@register("delta_block")
class DeltaBlock(DeltaAttnRes):
    """Knobs (plus those of `delta_attnres`; `route_first` lets layer 0's attention read [e]):
        num_blocks: layers_per_block = ceil(L / num_blocks). Default: 4 (the released code).
        block_delta: "intended" (D_b = h(end of b) - h(start of b)) or "released" (the code's
            `partial_block - blocks[-1]`: the third source is e + D_2, the fourth D_1 + D_3).
            Default: "intended".
    """

    identities = (
        Identity("a learnable_alpha gate at 0 adds nothing to the stream (MHAR's 8B conversion, variants.md 5.4)",
                 options={"gate": "learnable_alpha", "gate_init": 0.0}),
    )

    @dataclass(frozen=True, kw_only=True)
    class Config(DeltaAttnRes.Config):
        num_blocks: int = 4
        block_delta: Literal["intended", "released"] = "intended"

        def __post_init__(self):
            super().__post_init__()
            if self.num_blocks < 1:
                raise ValueError(f"num_blocks must be >= 1, got {self.num_blocks}")

    @classmethod
    def check_shape(cls, config: DeltaBlock.Config, shape: ModelShape) -> list[str]:
        errors = super().check_shape(config, shape)
        if config.sources != "delta":
            errors.append(f"sources: {config.sources!r} is not supported by delta_block (its sources are block "
                          "deltas); allowed: 'delta'")
        return errors

    @classmethod
    def depth_reads(cls, config: Any, n_layers: int) -> list[tuple[int, int]] | None:
        """One read of the completed block deltas only at every site."""
        per_block = 2 * math.ceil(n_layers / config.num_blocks)
        return [(1 + s // per_block, 1) for s in range(2 * n_layers)]

    def __init__(self, config: DeltaBlock.Config, shape: ModelShape, impl: str = "reference"):
        super().__init__(config, shape, impl)
        self.layers_per_block = math.ceil(shape.n_layers / config.num_blocks)

    def start(self, embedding: Tensor) -> DeltaState:
        return DeltaState(stream=embedding, sources=[])

    def real_labels(self, site: int) -> list[str]:
        """Site 0 reads the stream e (route_first); later sites e ("emb") and the block deltas appended at
        the boundary layers whose attention came before them ("block1", ...; see the module docstring)."""
        if site == 0:
            return ["emb"] if self.config.route_first else []
        appended = sum(1 for layer in range(self.shape.n_layers)
                       if layer % self.layers_per_block == 0 and 2 * layer < site)
        return ["emb"] + [f"block{n}" for n in range(1, appended)]

    def n_state_tensors(self, sites: int) -> int:
        """[B, T, D] tensors of the state after `sites` sublayers: the stream, one source per block started
        (layers l with l % layers_per_block == 0 whose attention, site 2l, has run; e the first) and, for
        "intended" deltas, the mark, the stream at the last boundary (the sum of the sources, kept to save
        the sum), which is e itself with one block."""
        blocks = sum(1 for layer in range(self.shape.n_layers) if layer % self.layers_per_block == 0
                     and 2 * layer < sites)
        mark = self.config.block_delta == "intended" and blocks > 1
        return 1 + blocks + int(mark)

    def site_sources(self, state: DeltaState, site: int) -> list[Tensor]:
        if site == 0:
            return [state.stream] if self.config.route_first else []
        return state.sources

    def update(self, state: DeltaState, site: int, output: Tensor) -> DeltaState:
        sources, mark = state.sources, state.mark
        if site % 2 == 0 and (site // 2) % self.layers_per_block == 0:
            h = state.stream                                                  # [B, T, D]
            if self.config.block_delta == "released":
                new = h if not sources else h - sources[-1]
            else:
                new = h if mark is None else h - mark
                mark = h
            sources = sources + [new]
        return DeltaState(state.stream + output, sources, mark, state.entropies)
