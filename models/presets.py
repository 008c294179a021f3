"""Named model sizes and their resolution into a concrete `ModelShape`.

The shapes follow the papers' tables: `gpt2-124m` is the Kimi/fla benchmark shape, `100m` and
`350m` are MHAR's (arXiv 2607.27230, appendix). SwiGLU hidden widths are 8/3 d rounded up to a
multiple of 64 unless a paper fixes them. The `*-moe` presets are their dense namesakes with a
mixture-of-experts FFN (`MOE_PRESETS`): `tiny-moe` has 8 experts of half the dense width, 2 active, so its
active FFN equals `tiny`'s; `small-moe` follows Kimi K2's ratio scaled down (384 routed, 8 active + 1 shared
there; 64 routed of ffn/9 width, 8 active + 1 shared here, sigmoid scores, auxiliary-loss-free balancing).
The vocabulary comes from the tokenizer (byte-level by default), so parameter counts differ from the
names, which keep the papers' labels.
"""

from __future__ import annotations

from dataclasses import dataclass

from reslab.models.config import ConfigError, ModelConfig, MoEConfig, check_moe

PRESETS: dict[str, dict[str, int]] = {
    # trains 200 steps on 2 CPU cores in seconds
    "tiny": dict(d_model=64, n_layers=4, n_heads=4, n_kv_heads=4, ffn_hidden=192, seq_len=128),
    "small": dict(d_model=512, n_layers=6, n_heads=8, n_kv_heads=8, ffn_hidden=1408, seq_len=512),
    "100m": dict(d_model=512, n_layers=12, n_heads=8, n_kv_heads=4, ffn_hidden=1536, seq_len=2048),
    "gpt2-124m": dict(d_model=768, n_layers=12, n_heads=12, n_kv_heads=12, ffn_hidden=2048, seq_len=1024),
    "350m": dict(d_model=1024, n_layers=24, n_heads=16, n_kv_heads=8, ffn_hidden=4096, seq_len=1024),
}
PRESETS["tiny-moe"] = PRESETS["tiny"]
PRESETS["small-moe"] = PRESETS["small"]
# the MoE FFN a preset comes with (ModelConfig.moe replaces it)
MOE_PRESETS: dict[str, MoEConfig] = {
    "tiny-moe": MoEConfig(experts=8, top_k=2, expert_hidden=96),
    "small-moe": MoEConfig(experts=64, top_k=8, shared_experts=1, expert_hidden=160, score="sigmoid",
                           balance="bias"),
}


def _pad_vocab(n: int, multiple: int = 64) -> int:
    return -(-n // multiple) * multiple


@dataclass(frozen=True)
class ModelShape:
    """Every number the backbone and the residual variants need, fully resolved."""

    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_hidden: int
    seq_len: int
    vocab_size: int
    rope_theta: float
    norm_eps: float
    init_std: float
    qk_norm: bool
    attn_head_dim: int | None = None  # None: d_model // n_heads
    tie_embeddings: bool = True
    moe: MoEConfig | None = None

    def is_moe(self, layer: int) -> bool:
        """Whether Transformer layer `layer` (0-based) has the MoE FFN: every `moe.every`-th layer."""
        return self.moe is not None and (layer + 1) % self.moe.every == 0

    @property
    def n_sites(self) -> int:
        """Routing sites: one before every attention and every MLP sublayer."""
        return 2 * self.n_layers

    @property
    def head_dim(self) -> int:
        return self.attn_head_dim or self.d_model // self.n_heads


def resolve_model(cfg: ModelConfig, *, vocab_size: int, where: str = "model") -> ModelShape:
    """Fill the preset's numbers into every field the config leaves unset, then check them."""
    if cfg.preset not in PRESETS:
        raise ConfigError(f"{where}.preset: unknown preset {cfg.preset!r}; allowed: {', '.join(PRESETS)}")
    base = PRESETS[cfg.preset]
    pick = {k: getattr(cfg, k) if getattr(cfg, k) is not None else v for k, v in base.items()}
    if cfg.n_heads is not None and cfg.n_kv_heads is None:
        pick["n_kv_heads"] = cfg.n_heads
    shape = ModelShape(
        **pick,
        vocab_size=cfg.vocab_size or _pad_vocab(vocab_size),
        rope_theta=cfg.rope_theta,
        norm_eps=cfg.norm_eps,
        init_std=cfg.init_std,
        qk_norm=cfg.qk_norm,
        attn_head_dim=cfg.head_dim,
        tie_embeddings=cfg.tie_embeddings,
        moe=cfg.moe if cfg.moe is not None else MOE_PRESETS.get(cfg.preset),
    )
    if shape.moe is not None:
        check_moe(shape.moe, f"{where}.moe")
    for name in ("d_model", "n_layers", "n_heads", "n_kv_heads", "ffn_hidden", "seq_len", "vocab_size"):
        if getattr(shape, name) < 1:
            raise ConfigError(f"{where}.{name}: must be >= 1, got {getattr(shape, name)}")
    if cfg.head_dim is not None and cfg.head_dim < 1:
        raise ConfigError(f"{where}.head_dim: must be >= 1 or null (d_model // n_heads), got {cfg.head_dim}")
    if cfg.head_dim is None and shape.d_model % shape.n_heads:
        raise ConfigError(f"{where}: d_model={shape.d_model} is not divisible by n_heads={shape.n_heads}")
    if shape.head_dim % 2:
        raise ConfigError(f"{where}: head_dim={shape.head_dim} must be even for RoPE")
    if shape.n_heads % shape.n_kv_heads:
        raise ConfigError(f"{where}: n_heads={shape.n_heads} is not divisible by n_kv_heads={shape.n_kv_heads}")
    if cfg.vocab_size is not None and cfg.vocab_size < vocab_size:
        raise ConfigError(f"{where}.vocab_size: {cfg.vocab_size} is smaller than the tokenizer's {vocab_size}")
    if shape.norm_eps <= 0 or shape.init_std <= 0:
        raise ConfigError(f"{where}: norm_eps and init_std must be > 0")
    return shape
