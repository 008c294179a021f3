"""A decoder-only Transformer whose residual pathway is a pluggable component.

Pre-norm RMSNorm, RoPE, causal SDPA attention (optionally GQA), SwiGLU, tied embeddings (or an untied head),
N(0, std^2) init with output projections scaled by 1/sqrt(2L) (GPT-2). The forward walks the
2L sublayers and lets the `ResidualPathway` decide what each one reads and how its output is
written back (see `models.residual.base`). `prefill`, `decode_step` and `generate` decode
incrementally with a KV cache (`models.decoding`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from reslab.models import decoding
from reslab.models.decoding import DecodeState, GenerateOptions, KVCache
from reslab.models.layers import Attention, MoE, RMSNorm, SwiGLU
from reslab.models.magnitudes import MagnitudeRecorder
from reslab.models.presets import ModelShape, resolve_model
from reslab.models.residual import build_pathway
from reslab.models.residual.base import ResidualPathway, RoutingRecorder


@dataclass
class ForwardOutput:
    logits: Tensor          # [B, T, V]
    loss: Tensor | None     # mean next-token cross-entropy (nats), float32
    aux_loss: Tensor | None  # the pathway's auxiliary term, if any


class Decoder(nn.Module):
    def __init__(self, shape: ModelShape, pathway: ResidualPathway):
        super().__init__()
        self.shape = shape
        self.embed = nn.Embedding(shape.vocab_size, shape.d_model)
        self.sublayers = nn.ModuleList()
        self.norms = nn.ModuleList()
        for layer in range(shape.n_layers):
            self.sublayers.extend([Attention(shape, layer), MoE(shape) if shape.is_moe(layer) else SwiGLU(shape)])
            self.norms.extend([RMSNorm(shape.d_model, shape.norm_eps), RMSNorm(shape.d_model, shape.norm_eps)])
        self.final_norm = RMSNorm(shape.d_model, shape.norm_eps)
        # untied: a head of its own (a pretrained model's, `models.hf_import`); tied, the embedding
        self.lm_head = None if shape.tie_embeddings else nn.Linear(shape.d_model, shape.vocab_size, bias=False)
        self._init_backbone()
        # the pathway initialises its own parameters; assigned after the backbone init on purpose
        self.pathway = pathway
        # set for a pass (`models.training.evaluate`) to record each sublayer's read and output magnitude
        self.magnitudes: MagnitudeRecorder | None = None

    def _init_backbone(self) -> None:
        std = self.shape.init_std
        out_std = std / math.sqrt(2 * self.shape.n_layers)
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, 0.0, out_std if getattr(module, "is_output_projection", False) else std)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, 0.0, std)

    def _run(self, idx: Tensor, layer_states: list[Any] | None = None, decode: DecodeState | None = None) -> Any:
        """Walk the 2L sublayers and return the final state; with a list, append the state after
        each Transformer layer to it (forward keeps none, so evaluation memory stays one state).
        With `decode`, `idx` are the next tokens of a cache that `decode.cache.extend` has opened."""
        if decode is None:
            positions = torch.arange(idx.shape[1], device=idx.device).expand(idx.shape[0], -1)
            state = self.pathway.resume(self.pathway.start(self.embed(idx)), None, positions)
        else:
            state = self.pathway.resume(self.pathway.start(self.embed(idx)), decode.carry, decode.cache.positions)
        return self.run_sites(state, range(self.shape.n_sites), layer_states, decode)

    def run_sites(self, state: Any, sites: range, layer_states: list[Any] | None = None,
                  decode: DecodeState | None = None) -> Any:
        """`state` through the sublayers `sites` (consecutive; a pipeline stage runs its own, `models.pipeline`)."""
        for site in sites:
            norm, sublayer = self.norms[site], self.sublayers[site]
            state = self.pathway.prepare(state, site)
            x = self.pathway.sublayer_input(state, site)
            xv = self.pathway.value_input(state, site)
            # even sites are attention (ResidualPathway's contract): only they read the cache
            cache = {"cache": decode.cache} if decode is not None and site % 2 == 0 else {}
            out = sublayer(norm(x), None if xv is None else norm(xv), **cache)
            if self.magnitudes is not None:
                self.magnitudes.add(site, x, out)
            state = self.pathway.update(state, site, out)
            if layer_states is not None and site % 2 == 1:
                layer_states.append(state)
        return state

    def logits(self, state: Any) -> Tensor:
        """The LM head on the pathway's final state: [B, T, V]."""
        head = self.embed.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(self.final_norm(self.pathway.readout(state)), head)

    @torch.no_grad()
    def layer_states(self, idx: Tensor) -> list[Any]:
        """The pathway's state after each Transformer layer (L of them; the last feeds the readout)."""
        states: list[Any] = []
        self._run(idx, states)
        return states

    def forward(self, idx: Tensor, targets: Tensor | None = None) -> ForwardOutput:
        state = self._run(idx)
        logits = self.logits(state)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
        return ForwardOutput(logits, loss, self._aux_loss(state))

    def moe_layers(self) -> list[tuple[int, MoE]]:
        """(Transformer layer, its MoE FFN) for every layer that has one."""
        return [(site // 2, m) for site, m in enumerate(self.sublayers) if isinstance(m, MoE)]

    def _aux_loss(self, state: Any) -> Tensor | None:
        """The pathway's auxiliary term plus every MoE layer's balance and z-loss of this forward."""
        terms = [self.pathway.aux_loss(state), *(m.aux for _, m in self.moe_layers())]
        present = [t for t in terms if t is not None]
        return sum(present[1:], present[0]) if present else None

    # --- incremental decoding (models.decoding) ---------------------------------------------
    @torch.no_grad()
    def extend(self, idx: Tensor, state: DecodeState, valid: Tensor | None = None) -> Tensor:
        """Run the next tokens `idx` [B, t] of every row (`valid` [B, t]: False on left padding)
        against `state`'s cache, which keeps their keys and values; returns their logits [B, t, V]."""
        state.cache.extend(torch.ones_like(idx, dtype=torch.bool) if valid is None else valid)
        final = self._run(idx, decode=state)
        state.carry = self.pathway.carry(final)
        return self.logits(final)

    def prefill(self, idx: Tensor, valid: Tensor | None = None) -> tuple[Tensor, DecodeState]:
        """A new decode state holding the prompts `idx` [B, P] (left-padded where `valid` is
        False); returns the prompts' logits [B, P, V] and the state."""
        state = DecodeState(KVCache(self.shape.n_layers, idx.shape[0], self.shape.seq_len))
        return self.extend(idx, state, valid), state

    def decode_step(self, token: Tensor, state: DecodeState) -> Tensor:
        """One new token per row, `token` [B]; returns its logits [B, V]."""
        return self.extend(token.unsqueeze(1), state)[:, -1]

    def decode_state_bytes(self) -> decoding.StateBytes:
        """The decode state's bytes (`models.decoding.StateBytes`) in this model's parameters' dtype: the
        KV cache per cached token from the shape, the pathway's state of the token in flight and its carry,
        per row, from its declaration
        (`ResidualPathway.decode_state_elems`), which tests hold to `measure_decode_state_bytes`."""
        s, size = self.shape, self.embed.weight.element_size()
        pathway, carry = self.pathway.decode_state_elems()
        return decoding.StateBytes(kv=2 * s.n_layers * s.n_kv_heads * s.head_dim * size, pathway=pathway * size,
                                   carry=carry * size)

    @torch.no_grad()
    def measure_decode_state_bytes(self) -> decoding.StateBytes:
        """`decode_state_bytes` measured on this model's parameters' dtype and device: the pathway's state
        from the final state of one token decoded after a one-token prompt (every tensor the state holds,
        each storage once, less the storages of the carry), the carry from what that step leaves for the
        next (`models.decoding.tensor_bytes`)."""
        s, param = self.shape, self.embed.weight
        kv = 2 * s.n_layers * s.n_kv_heads * s.head_dim * param.element_size()
        state = DecodeState(KVCache(s.n_layers, 1, s.seq_len))
        token = torch.zeros(1, 1, dtype=torch.long, device=param.device)
        self.extend(token, state)
        state.cache.extend(torch.ones_like(token, dtype=torch.bool))
        final = self._run(token, decode=state)
        carry = self.pathway.carry(final)
        return decoding.StateBytes(kv=kv, pathway=decoding.tensor_bytes(final, exclude=carry),
                                   carry=decoding.tensor_bytes(carry))

    def generate(self, prompts: Sequence[Sequence[int] | Tensor], options: GenerateOptions) -> list[list[int]]:
        """The new tokens of every prompt (`models.decoding.generate`)."""
        return decoding.generate(self, prompts, options, self.shape.seq_len, self.shape.vocab_size,
                                 self.embed.weight.device)

    @torch.no_grad()
    def layer_streams(self, idx: Tensor) -> list[Tensor]:
        """The residual stream after each Transformer layer, [B, T, D] each (for D_eff)."""
        return [self.pathway.stream(state) for state in self.layer_states(idx)]

    @torch.no_grad()
    def recorded_pass(self, idx: Tensor) -> tuple[list[Any], RoutingRecorder]:
        """One forward pass that keeps the pathway's state after each Transformer layer and
        records every routing site's depth weights (the readout's included)."""
        recorder = RoutingRecorder()
        self.pathway.recorder = recorder
        try:
            states = self.layer_states(idx)
            self.pathway.readout(states[-1])
        finally:
            self.pathway.recorder = None
        return states, recorder

    def routing_stats(self, idx: Tensor) -> RoutingRecorder:
        """One forward pass recording every routing site's depth weights."""
        return self.recorded_pass(idx)[1]

    def param_counts(self) -> dict[str, int]:
        """Parameters per component; the tied LM head is counted once, in `embedding` (an untied one there
        too). `active`: those a token's forward touches, `total` less the routed experts it does not reach
        (experts - top_k per MoE layer); equal to `total` for a dense model."""
        sub = {"attention": 0, "mlp": 0}
        for module in self.sublayers:
            sub["attention" if isinstance(module, Attention) else "mlp"] += sum(p.numel() for p in module.parameters())
        counts = {
            "embedding": self.embed.weight.numel() + (0 if self.lm_head is None else self.lm_head.weight.numel()),
            **sub,
            "norms": sum(p.numel() for p in self.norms.parameters()) + self.final_norm.weight.numel(),
            "residual": self.pathway.extra_params(),
        }
        counts["total"] = sum(counts.values())
        counts["active"] = counts["total"] - sum(
            (m.cfg.experts - m.cfg.top_k) * sum(p.numel() for p in m.experts[0].parameters())
            for _, m in self.moe_layers())
        return counts


def build_model(model_cfg, residual_cfg, *, vocab_size: int, impl: str = "reference") -> Decoder:
    """Build a `Decoder` from config; the caller seeds torch beforehand to fix the init."""
    shape = resolve_model(model_cfg, vocab_size=vocab_size)
    return Decoder(shape, build_pathway(residual_cfg, shape, impl=impl))
