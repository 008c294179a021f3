"""How large a run's model is, before anything is built: the backbone's parameters by arithmetic, the residual
pathway's counted on a module built on the meta device, and the bound past which no run can hold it.

    N          vocab x d (the tied embedding, once) + L (attention + FFN + norms) + d, plus the pathway's; a MoE
               FFN counts all its experts here and top_k of them in the active count (`backbone_active_params`)
    state      16 bytes per parameter to train: fp32 weights and gradients, Adam's two moments
    bound      the state sharded by FSDP2 over the most GPUs one run spans (`resources.gpus_per_run` <= 1024)
               of the largest memory one holds (an H200's 141 GB): 144 TB, 9.0e12 parameters

The pathway is counted on a module built on the meta device for a large backbone (`residual_params`).
Activations are not counted, so a model under the bound may still not fit; one over it cannot train anywhere,
and is refused (`check_model_size`) when the study is loaded (`experiments.spec`, the backbone alone) and when
it is budgeted (`experiments.budget`, the pathway included), with its size in the message. A leaf of
`experiments`: the spec and the budget import it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from reslab.models.config import ConfigError, RunConfig
from reslab.models.presets import ModelShape

STATE_BYTES_PER_PARAM = 16
MAX_STATE_BYTES = 1024 * 141e9
MAX_PARAMS = int(MAX_STATE_BYTES // STATE_BYTES_PER_PARAM)
# the layer bound keeps the count itself cheap: a pathway is built, on the meta device, to count its parameters
MAX_LAYERS = 10_000
# Below this backbone a pathway is built for real to be counted: no variant's is larger than its backbone (at most
# a few hundred MB here, in milliseconds), while the meta device's first random init imports torch._dynamo (2-7 s
# on 2 cores: DAR, DDL, Delta AttnRes, DepthSWA, Highway, Hyper-Connections draw their init from a generator).
META_FROM_PARAMS = 10**8


def backbone_params(shape: ModelShape) -> int:
    """Parameters of the decoder without the residual pathway: embedding (and an untied LM head), attention
    (q, k, v, o and the optional per-head q/k norms), SwiGLU and the RMSNorm gains."""
    d, e = shape.d_model, shape.head_dim
    attention = d * shape.n_heads * e + 2 * d * shape.n_kv_heads * e + shape.n_heads * e * d
    attention += 2 * e if shape.qk_norm else 0
    norms = 2 * d
    mlp = sum(ffn_params(shape, layer)[0] for layer in range(shape.n_layers))
    embedding = shape.vocab_size * d * (1 if shape.tie_embeddings else 2)
    return embedding + shape.n_layers * (attention + norms) + mlp + d


def ffn_params(shape: ModelShape, layer: int) -> tuple[int, int]:
    """(all, active) parameters of layer `layer`'s FFN: the dense SwiGLU's 3 d h, or a MoE's router (d E), its
    E routed experts (3 d h_e each, top_k of them active) and its shared ones (3 d h_e each, always active)."""
    d, moe = shape.d_model, shape.moe
    if moe is None or not shape.is_moe(layer):
        return 3 * d * shape.ffn_hidden, 3 * d * shape.ffn_hidden
    expert = 3 * d * (moe.expert_hidden or shape.ffn_hidden)
    fixed = d * moe.experts + moe.shared_experts * expert
    return fixed + moe.experts * expert, fixed + moe.top_k * expert


def backbone_active_params(shape: ModelShape) -> int:
    """`backbone_params` less the routed experts a token does not reach: what a token's matmuls touch, the N of
    the FLOP count and of tokens per parameter (equal to `backbone_params` for a dense model)."""
    return backbone_params(shape) - sum(a - b for a, b in (ffn_params(shape, i) for i in range(shape.n_layers)))


def residual_params(cfg: RunConfig, shape: ModelShape) -> int:
    """The residual pathway's extra parameters, counted on the built module: on the meta device (shapes without
    storage) once the backbone passes `META_FROM_PARAMS`, so counting a model no machine holds allocates nothing."""
    return pathway_params(cfg, shape, meta=backbone_params(shape) > META_FROM_PARAMS)


def pathway_params(cfg: RunConfig, shape: ModelShape, *, meta: bool) -> int:
    """The pathway's parameters, built on the meta device (`_on_meta`) or for real."""
    from reslab.models.residual import build_pathway

    with _on_meta() if meta else contextlib.nullcontext():
        return build_pathway(cfg.residual, shape).extra_params()


@contextlib.contextmanager
def _on_meta() -> Iterator[None]:
    """Every tensor factory on the meta device, `nn.utils.skip_init` included: it builds on meta and then moves
    the module to its `device` argument, CPU when not given (not the default device), which would allocate and
    break the in-place init of the meta weights around it (DDL, Highway). Only the driver counts, never while a
    model trains in its process, so swapping it for the count reaches no other module."""
    import torch
    from torch import nn

    real = nn.utils.skip_init

    def skip_init(module_cls: Any, *args: Any, **kwargs: Any) -> Any:
        return real(module_cls, *args, **{"device": "meta", **kwargs})

    nn.utils.skip_init = skip_init
    try:
        with torch.device("meta"):
            yield
    finally:
        nn.utils.skip_init = real


def check_model_size(shape: ModelShape, params: int | None, label: str) -> None:
    """Raise a ConfigError naming the model's size when it is past what any run can hold (`MAX_PARAMS`,
    `MAX_LAYERS`); `params` None checks the layers and the backbone alone, by arithmetic (nothing is built)."""
    if shape.n_layers > MAX_LAYERS:
        raise ConfigError(f"{label}: model.n_layers: {shape.n_layers:,} layers; allowed: at most {MAX_LAYERS:,}")
    params = backbone_params(shape) if params is None else params
    if params > MAX_PARAMS:
        raise ConfigError(
            f"{label}: model: {params:.3g} parameters (d_model {shape.d_model:,}, {shape.n_layers:,} layers, vocab "
            f"{shape.vocab_size:,}) need {params * STATE_BYTES_PER_PARAM / 1e12:.3g} TB to train "
            f"({STATE_BYTES_PER_PARAM} bytes per parameter: weights, gradients, Adam's moments), past the "
            f"{MAX_STATE_BYTES / 1e12:.0f} TB of the largest run (1024 GPUs of 141 GB); allowed: at most "
            f"{MAX_PARAMS:.3g} parameters")


__all__ = ["MAX_LAYERS", "MAX_PARAMS", "MAX_STATE_BYTES", "META_FROM_PARAMS", "STATE_BYTES_PER_PARAM",
           "backbone_active_params", "backbone_params", "check_model_size", "ffn_params", "pathway_params",
           "residual_params"]
