"""The backbone's building blocks: RMSNorm, RoPE, causal (GQA) attention, SwiGLU, a mixture-of-experts FFN.

Shape legend: B batch, T tokens, D model width, H query heads, K key/value heads, E head dim.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from reslab.models.presets import ModelShape

if TYPE_CHECKING:
    from reslab.models.decoding import KVCache


def rms_norm(x: Tensor, eps: float, weight: Tensor | None = None) -> Tensor:
    """RMSNorm in float32, cast back to the input dtype; `weight=None` is parameter-free."""
    xf = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight
    return y.to(x.dtype)


def zero_linear(d_in: int, d_out: int, bias: float | None = None) -> nn.Linear:
    """An nn.Linear with W = 0 and, unless `bias` is None, a bias filled with `bias`.

    Built with `nn.utils.skip_init`: nn.Linear's own init draws from the global RNG, which would
    shift every backbone weight drawn after the pathway and break seed pairing across arms.
    """
    layer = nn.utils.skip_init(nn.Linear, d_in, d_out, bias=bias is not None)
    with torch.no_grad():
        layer.weight.zero_()
        if bias is not None:
            layer.bias.fill_(bias)
    return layer


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm(x, self.eps, self.weight)


class Rotary(nn.Module):
    """Rotary position embedding (half-split layout); cos/sin computed per call in float32."""

    inv_freq: Tensor  # a non-persistent buffer, registered in __init__

    def __init__(self, head_dim: int, theta: float):
        super().__init__()
        inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, x: Tensor, positions: Tensor | None = None) -> Tensor:  # x: [B, H, T, E]
        """Rotate by each token's position: 0..T-1, or `positions` [B, T] (decoding)."""
        if positions is None:
            t = torch.arange(x.shape[-2], device=x.device, dtype=torch.float32)
            freqs = torch.outer(t, self.inv_freq)                 # [T, E/2]
        else:
            freqs = (positions.float().unsqueeze(-1) * self.inv_freq).unsqueeze(1)  # [B, 1, T, E/2]
        cos, sin = freqs.cos().to(x.dtype), freqs.sin().to(x.dtype)
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


class Attention(nn.Module):
    """Causal self-attention with grouped-query heads and RoPE.

    `value_input` lets a residual variant feed the value projection from its own route
    (RD-AttnRes); by default queries, keys and values read the same input. With a `cache`
    (`models.decoding.KVCache`, decoding) the tokens are the cache's next ones: they rotate by
    their own positions, store their keys and values as layer `layer` and attend over the cache.
    """

    def __init__(self, shape: ModelShape, layer: int = 0):
        super().__init__()
        d, e = shape.d_model, shape.head_dim
        self.n_heads, self.n_kv_heads, self.head_dim = shape.n_heads, shape.n_kv_heads, e
        self.q_proj = nn.Linear(d, shape.n_heads * e, bias=False)
        self.k_proj = nn.Linear(d, shape.n_kv_heads * e, bias=False)
        self.v_proj = nn.Linear(d, shape.n_kv_heads * e, bias=False)
        self.o_proj = nn.Linear(shape.n_heads * e, d, bias=False)
        # torch's stubs type Module.__setattr__ values as Tensor | Module; a plain flag is fine at runtime
        self.o_proj.is_output_projection = True  # type: ignore[assignment]
        self.rotary = Rotary(e, shape.rope_theta)
        self.q_norm = RMSNorm(e, shape.norm_eps) if shape.qk_norm else None
        self.k_norm = RMSNorm(e, shape.norm_eps) if shape.qk_norm else None
        self.layer = layer  # this attention's Transformer layer: its slot in a KV cache

    def forward(self, x: Tensor, value_input: Tensor | None = None, cache: KVCache | None = None) -> Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)      # [B, H, T, E]
        k = self.k_proj(x).view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)   # [B, K, T, E]
        v_in = x if value_input is None else value_input
        v = self.v_proj(v_in).view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        if self.q_norm is not None and self.k_norm is not None:  # both or neither (shape.qk_norm)
            q, k = self.q_norm(q), self.k_norm(k)
        if cache is None:
            q, k = self.rotary(q), self.rotary(k)
            y = F.scaled_dot_product_attention(
                q, k, v, is_causal=True, enable_gqa=self.n_kv_heads != self.n_heads
            )
        else:
            q, k = self.rotary(q, cache.positions), self.rotary(k, cache.positions)
            y = cache.attend(self.layer, q, k, v)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, -1))


class SwiGLU(nn.Module):
    def __init__(self, shape: ModelShape, hidden: int | None = None):
        super().__init__()
        hidden = shape.ffn_hidden if hidden is None else hidden
        self.gate_proj = nn.Linear(shape.d_model, hidden, bias=False)
        self.up_proj = nn.Linear(shape.d_model, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, shape.d_model, bias=False)
        # torch's stubs type Module.__setattr__ values as Tensor | Module; a plain flag is fine at runtime
        self.down_proj.is_output_projection = True  # type: ignore[assignment]

    def forward(self, x: Tensor, value_input: Tensor | None = None) -> Tensor:
        if value_input is not None:
            raise ValueError("the MLP sublayer has a single input; value_input is for attention sites")
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MoE(nn.Module):
    """Top-k routed SwiGLU experts plus optional shared ones (`models.config.MoEConfig` has the knobs).

    Router: a bias-free linear to E logits in float32, gated by softmax or sigmoid; each token goes to the k
    experts of the highest score (plus `expert_bias`, the auxiliary-loss-free balancing bias, which only
    chooses) and mixes their outputs with its chosen scores renormalised to sum to 1. Dropless: every token is
    computed by all its k experts (tokens are sorted by expert, each expert runs once on its rows). Each
    forward leaves `aux` (the balance loss plus the z-loss, or None) and adds its routed slots per expert to
    `load`, which `models.training` reads (bias updates, utilisation) and zeroes.
    """

    expert_bias: Tensor
    load: Tensor

    def __init__(self, shape: ModelShape):
        super().__init__()
        moe = shape.moe
        if moe is None:
            raise ValueError("MoE needs shape.moe")
        self.cfg = moe
        hidden = moe.expert_hidden or shape.ffn_hidden
        self.router = nn.Linear(shape.d_model, moe.experts, bias=False)
        self.experts = nn.ModuleList(SwiGLU(shape, hidden) for _ in range(moe.experts))
        self.shared = SwiGLU(shape, moe.shared_experts * hidden) if moe.shared_experts else None
        self.register_buffer("expert_bias", torch.zeros(moe.experts))
        # a plain tensor, not a buffer: DDP broadcasts rank 0's buffers before every forward, which would overwrite
        # each rank's own count (`models.training.moe_loads` sums the ranks'); moves to the input's device
        self.load = torch.zeros(moe.experts)
        self.aux: Tensor | None = None

    def route(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """x [N, D] -> (logits [N, E] float32, chosen experts [N, k], their mixing weights [N, k] float32)."""
        logits = self.router(x).float()
        scores = logits.softmax(-1) if self.cfg.score == "softmax" else logits.sigmoid()
        chosen = torch.topk(scores + self.expert_bias, self.cfg.top_k, dim=-1).indices
        weights = scores.gather(-1, chosen)
        return logits, chosen, weights / weights.sum(-1, keepdim=True)

    def balance_loss(self, logits: Tensor, chosen: Tensor) -> Tensor | None:
        """Switch/GShard `aux_coef * E * sum_i f_i P_i` (balance `aux`) plus the router z-loss, or None."""
        c, terms = self.cfg, []
        if c.balance == "aux" and c.aux_coef > 0:
            scores = logits.softmax(-1) if c.score == "softmax" else logits.sigmoid()
            p = (scores / scores.sum(-1, keepdim=True)).mean(0)
            f = torch.bincount(chosen.flatten(), minlength=c.experts).float() / chosen.numel()
            terms.append(c.aux_coef * c.experts * (f * p).sum())
        if c.z_loss_coef > 0:
            terms.append(c.z_loss_coef * torch.logsumexp(logits, -1).pow(2).mean())
        return sum(terms[1:], terms[0]) if terms else None

    def forward(self, x: Tensor, value_input: Tensor | None = None) -> Tensor:
        if value_input is not None:
            raise ValueError("the MLP sublayer has a single input; value_input is for attention sites")
        flat = x.reshape(-1, x.shape[-1])
        logits, chosen, weights = self.route(flat)
        self.aux = self.balance_loss(logits, chosen)
        slots = chosen.flatten()
        order = torch.argsort(slots, stable=True)
        counts = torch.bincount(slots, minlength=self.cfg.experts)
        with torch.no_grad():
            if self.load.device != counts.device:
                self.load = self.load.to(counts.device)
            self.load += counts.to(self.load.dtype)
        rows = order // self.cfg.top_k
        routed = flat[rows]  # every (token, chosen expert) slot, grouped by expert
        parts = [expert(part) for expert, part in zip(self.experts, routed.split(counts.tolist()), strict=True)
                 if part.shape[0]]
        mixed = torch.cat(parts) * weights.flatten()[order].unsqueeze(-1)
        out = torch.zeros_like(flat).index_add_(0, rows, mixed.to(flat.dtype))
        if self.shared is not None:
            out = out + self.shared(flat)
        return out.view_as(x)
