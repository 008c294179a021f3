"""The mixture-of-experts FFN (models.layers.MoE): the dense limit, deterministic routing, the balance terms
against a hand (loop) computation, the auxiliary-loss-free bias update, active-parameter counts against a
FLOP counter, every residual variant with MoE layers, the training loop's hooks and bad input."""

from __future__ import annotations

import math

import pytest
import torch
from variant_testing import SMALL, VOCAB, make_model, tokens

from reslab.experiments.size import backbone_active_params, backbone_params
from reslab.models.backbone import build_model
from reslab.models.config import (
    ConfigError,
    CostConfig,
    ModelConfig,
    MoEConfig,
    OptimConfig,
    ResidualConfig,
    RunConfig,
    TrainConfig,
    load,
)
from reslab.models.layers import MoE, SwiGLU
from reslab.models.presets import resolve_model
from reslab.models.residual import variants
from reslab.models.serving import flops_per_token
from reslab.models.training import moe_balance_step, moe_loads, train


def shape_with(moe: MoEConfig, **model):
    return resolve_model(ModelConfig(**{**SMALL, **model}, moe=moe), vocab_size=VOCAB)


@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
def test_one_expert_top1_is_the_dense_swiglu_exactly(score):
    shape = shape_with(MoEConfig(experts=1, top_k=1, score=score))
    torch.manual_seed(0)
    dense, moe = SwiGLU(shape), MoE(shape)
    moe.experts[0].load_state_dict(dense.state_dict())
    x = torch.randn(2, 7, shape.d_model)
    assert torch.equal(moe(x), dense(x))
    assert moe.load.tolist() == [14.0]


def test_routing_is_deterministic_under_the_seed():
    moe = MoEConfig(experts=4, top_k=2, shared_experts=1, expert_hidden=16)
    a, b = make_model("prenorm", moe=moe), make_model("prenorm", moe=moe)
    idx = tokens()
    assert torch.equal(a(idx).logits, b(idx).logits)
    layer = a.sublayers[1]
    x = torch.randn(5, SMALL["d_model"])
    assert torch.equal(layer.route(x)[1], layer.route(x)[1])
    assert not torch.equal(make_model("prenorm", moe=moe, seed=1)(idx).logits, a(idx).logits)


def _loop_balance(logits: list[list[float]], k: int, score: str, coef: float, z_coef: float) -> float:
    """The Switch/GShard aux loss and the z-loss by plain loops over tokens and experts (no torch)."""
    n, e = len(logits), len(logits[0])
    counts, probs, z = [0] * e, [0.0] * e, 0.0
    for row in logits:
        if score == "softmax":
            top = max(row)
            exps = [math.exp(v - top) for v in row]
            s = [v / sum(exps) for v in exps]
        else:
            s = [1 / (1 + math.exp(-v)) for v in row]
        for i in sorted(range(e), key=lambda i: -s[i])[:k]:
            counts[i] += 1
        for i in range(e):
            probs[i] += s[i] / sum(s) / n
        z += math.log(sum(math.exp(v) for v in row)) ** 2 / n
    return coef * e * sum(c / (n * k) * p for c, p in zip(counts, probs, strict=True)) + z_coef * z


@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
def test_balance_loss_matches_the_loop_formula(score):
    shape = shape_with(MoEConfig(experts=5, top_k=2, score=score, aux_coef=0.03, z_loss_coef=0.002))
    torch.manual_seed(3)
    moe = MoE(shape).double()
    x = torch.randn(11, shape.d_model, dtype=torch.float64)
    moe(x)
    logits = (x @ moe.router.weight.T).tolist()
    assert moe.aux is not None
    # the router's logits are float32 (`MoE.route`) whatever the input dtype: agreement to float32 rounding
    assert moe.aux.item() == pytest.approx(_loop_balance(logits, 2, score, 0.03, 0.002), rel=1e-6)


def test_balanced_routing_gives_an_aux_loss_of_the_coefficient():
    """Zero router weights: every score ties, P_i = 1/E, and the loss is coef x E x sum f_i / E = coef."""
    shape = shape_with(MoEConfig(experts=4, top_k=2, aux_coef=0.01))
    moe = MoE(shape)
    with torch.no_grad():
        moe.router.weight.zero_()
    moe(torch.randn(9, shape.d_model))
    assert moe.aux is not None and moe.aux.item() == pytest.approx(0.01, rel=1e-6)


def test_the_bias_update_moves_routing_toward_balance():
    """Router skewed toward expert 0 (every token picks it): the bias step lowers its bias and raises the idle
    experts', and after some steps the most loaded expert takes far less than every token."""
    model = make_model("prenorm", n_layers=1, moe=MoEConfig(experts=4, top_k=1, score="sigmoid", balance="bias",
                                                            bias_update_rate=0.01))
    moe = model.sublayers[1]
    x = torch.randn(64, SMALL["d_model"], generator=torch.Generator().manual_seed(0)) + 1
    with torch.no_grad():
        moe.router.weight[0] = 0.05  # expert 0's logit ~1.6 on every token, the others' ~N(0, 0.16^2)
    moe_loads(model)

    def max_fraction() -> float:
        moe(x)
        return max(moe.load.tolist()) / 64

    first = max_fraction()
    load = moe.load.clone()
    moe_balance_step(model)
    assert torch.equal(moe.expert_bias, 0.01 * torch.sign(load.mean() - load))
    assert moe.load.sum() == 0
    late = []
    for _ in range(60):
        late.append(max_fraction())
        moe_balance_step(model)
    assert first == 1.0
    assert moe.expert_bias[0] < 0 and (moe.expert_bias[1:] > 0).all()
    assert sum(late[-10:]) / 10 < 0.5


def test_aux_balance_leaves_the_bias_alone():
    model = make_model("prenorm", n_layers=1, moe=MoEConfig(experts=4, top_k=1, balance="aux"))
    model(tokens())
    moe_balance_step(model)
    assert model.sublayers[1].expert_bias.abs().sum() == 0


def test_active_parameter_counts_and_flops():
    """`param_counts` against the module's own parameters and experiments.size's arithmetic; the forward
    FLOPs per token of `flops_per_token(active)` against torch's FLOP counter (matmuls only: the norm
    gains' 2 FLOPs each and the router softmax are not counted by it)."""
    from torch.utils.flop_counter import FlopCounterMode, sdpa_flop_count

    moe = MoEConfig(experts=6, top_k=2, shared_experts=1, expert_hidden=16, every=2)
    model = make_model("prenorm", n_layers=4, moe=moe)
    counts = model.param_counts()
    assert counts["total"] == sum(p.numel() for p in model.parameters()) == backbone_params(model.shape)
    assert counts["active"] == backbone_active_params(model.shape)
    assert counts["total"] - counts["active"] == 2 * (6 - 2) * 3 * SMALL["d_model"] * 16

    def cpu_sdpa(query, key, value, *_args, out_shape=None, **_kwargs) -> int:
        return sdpa_flop_count(query, key, value)

    idx = torch.zeros(2, SMALL["seq_len"], dtype=torch.long)
    cpu_attention = {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: cpu_sdpa}
    with FlopCounterMode(display=False, custom_mapping=cpu_attention) as counter, torch.no_grad():
        model(idx)
    expected = flops_per_token(model.shape, counts["active"]) - 2 * counts["norms"]
    assert counter.get_total_flops() / idx.numel() == pytest.approx(expected, rel=1e-9)


@pytest.mark.parametrize("name", sorted(variants()))
def test_every_residual_variant_trains_with_moe_layers(name):
    moe = MoEConfig(experts=4, top_k=2, shared_experts=1, expert_hidden=16, z_loss_coef=1e-3)
    model = make_model(name, n_layers=4, moe=moe)
    idx = tokens()
    out = model(idx, idx)
    assert out.aux_loss is not None and torch.isfinite(out.loss)
    (out.loss + out.aux_loss).backward()
    for layer in (1, 3, 5, 7):
        assert model.sublayers[layer].router.weight.grad.abs().sum() > 0


def test_training_records_the_expert_utilisation():
    cfg = RunConfig(
        model=ModelConfig(preset="tiny-moe", d_model=32, n_layers=2, n_heads=2, seq_len=32,
                          moe=MoEConfig(experts=4, top_k=2, expert_hidden=32, balance="bias")),
        optim=OptimConfig(batch_size=4, warmup_steps=2),
        train=TrainConfig(steps=4, eval_every=2, eval_windows=8, log_every=2, seed=3, deff_passages=4),
        cost=CostConfig(measure=False),
    )
    seen = []

    class Spy:
        def on_start(self, info): ...
        def on_log(self, step, metrics): ...
        def on_checkpoint(self, step, path): ...
        def on_eval(self, step, metrics, diagnostics):
            seen.append((metrics, diagnostics))

    result = train(cfg, callback=Spy())
    metrics, diagnostics = seen[-1]
    assert set(diagnostics["moe"]["layers"]) == {0, 1}
    for layer, fractions in zip(diagnostics["moe"]["layers"], diagnostics["moe"]["fraction"], strict=True):
        assert sum(fractions) == pytest.approx(1.0)
        assert metrics[f"moe/max_load/l{layer:02d}"] == pytest.approx(max(fractions) * 4)
    assert math.isfinite(result.summary["val_loss"])
    # params_active: less the 4 - 2 routed experts a token skips in each of the 2 MoE layers, SwiGLU 3 x 32 x 32 each
    assert result.summary["params_active"] == result.summary["params_total"] - 2 * (4 - 2) * 3 * 32 * 32


def test_a_moe_run_writes_its_final_checkpoint_and_resumes_from_it(tmp_path):
    """The run's info (its shape, MoEConfig inside) goes into the final checkpoint as JSON; a second run in the
    same directory resumes from it and returns the same summary (what a study's worker does)."""
    from reslab.models.training import Trainer

    cfg = RunConfig(
        model=ModelConfig(preset="tiny-moe", d_model=32, n_layers=2, n_heads=2, seq_len=32,
                          moe=MoEConfig(experts=4, top_k=2, expert_hidden=32)),
        optim=OptimConfig(batch_size=4, warmup_steps=1),
        train=TrainConfig(steps=2, eval_every=2, eval_windows=4, log_every=1, seed=3, diagnostics=False,
                          magnitudes=False),
        cost=CostConfig(measure=False),
    )
    first = Trainer(cfg, tmp_path).fit()
    assert first.info["shape"]["moe"] == {"experts": 4, "top_k": 2, "shared_experts": 0, "expert_hidden": 32,
                                          "every": 1, "score": "softmax", "balance": "aux", "aux_coef": 0.01,
                                          "bias_update_rate": 0.001, "z_loss_coef": 0.0}
    again = Trainer(cfg, tmp_path).fit()
    assert again.summary == first.summary


def test_presets_and_bad_input():
    tiny, tiny_moe = (resolve_model(ModelConfig(preset=p), vocab_size=257) for p in ("tiny", "tiny-moe"))
    assert backbone_active_params(tiny_moe) == backbone_params(tiny) + tiny.n_layers * 8 * tiny.d_model
    small = resolve_model(ModelConfig(preset="small-moe"), vocab_size=257)
    assert small.moe is not None and (small.moe.top_k, small.moe.shared_experts) == (8, 1)
    with pytest.raises(ConfigError, match=r"^model\.moe\.top_k: 5 is not allowed; allowed: 1\.\.experts \(4\)$"):
        resolve_model(ModelConfig(moe=MoEConfig(experts=4, top_k=5)), vocab_size=257)
    with pytest.raises(ConfigError, match=r"^model\.moe\.experts: must be >= 1"):
        resolve_model(ModelConfig(moe=MoEConfig(experts=0, top_k=1)), vocab_size=257)
    with pytest.raises(ConfigError, match=r"^model\.moe: unknown key\(s\) 'topk' \(did you mean 'top_k'\?\)"):
        load(ModelConfig, {"moe": {"topk": 2}}, "model")
    with pytest.raises(ConfigError, match=r"^model\.moe\.balance: 'loss' is not allowed"):
        load(ModelConfig, {"moe": {"balance": "loss"}}, "model")
    cfg = ModelConfig(preset="tiny", moe=MoEConfig(experts=2, top_k=1))
    assert isinstance(build_model(cfg, ResidualConfig(), vocab_size=VOCAB).sublayers[1], MoE)
