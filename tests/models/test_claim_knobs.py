"""Issue 10 items 5 and 6: shape-aware validation before dispatch, and the knobs behind each paper
claim (their equations are checked in test_oracles.py; here: what each knob is for)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from variant_testing import make_model, tokens

from reslab.experiments.spec import load_study
from reslab.models.config import ConfigError, ModelConfig, ResidualConfig
from reslab.models.presets import resolve_model
from reslab.models.residual import check_pathway_shape
from reslab.models.residual.review import widened_ffn_hidden
from reslab.orchestrator.cli import main

pytestmark = pytest.mark.usefixtures("one_thread")

EXPERIMENTS = Path(__file__).resolve().parents[2] / "experiments"

BAD_SHAPES = """\
study: bad_shapes
base:
  model: {preset: tiny}
  data: {corpus: stdlib, tokenizer: byte}
  train: {steps: 5}
arms:
  control: prenorm
  mhar3: {residual: {name: mhar, options: {heads: 3}}}
  delta3: {residual: {name: delta_attnres, options: {heads: 3}}}
  long_blocks: {residual: {name: block_attnres, options: {block_size: 9}}}
  dar_blocks: {residual: {name: dar, options: {block_size: 10}}}
seeds: 2
comparisons:
  - {name: all, control: control}
"""
FIELDS = ["arms.mhar3 and arms.delta3: residual.options.heads: 3 does not divide d_model=64",  # said once (issue 52)
          "arms.long_blocks.residual.options.block_size: 9 exceeds the model's 2L=8 sublayers",
          "arms.dar_blocks.residual.options.block_size: 10 exceeds the model's 2L=8 sublayers"]


def test_load_study_reports_every_shape_error_in_one_config_error(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text(BAD_SHAPES)
    with pytest.raises(ConfigError) as info:
        load_study(path)
    message = str(info.value)
    assert "\n" not in message and all(field in message for field in FIELDS), message


@pytest.mark.parametrize("command", ["validate", "plan"])
def test_validate_and_plan_refuse_shape_errors_with_exit_2(tmp_path, capsys, command):
    path = tmp_path / "bad.yaml"
    path.write_text(BAD_SHAPES)
    assert main([command, str(path), "--workspace", str(tmp_path / "ws")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and all(field in err for field in FIELDS), err
    assert not (tmp_path / "ws").exists() or not any((tmp_path / "ws").rglob("*.json"))


def test_train_refuses_a_shape_error_before_building(capsys):
    assert main(["train", "--preset", "tiny", "--residual", "mhar", "--opt", "heads=3", "--print-config"]) == 2
    assert "residual.options.heads: 3 does not divide d_model=64" in capsys.readouterr().err


def test_building_refuses_too_with_a_config_error():
    # the worker never retries a ConfigError (exit code 2): a build that fails is not a crash
    with pytest.raises(ConfigError, match=r"residual\.options\.heads: 3 does not divide"):
        make_model("delta_attnres", {"heads": 3})
    assert ConfigError("x").exit_code == 2


@pytest.mark.parametrize("name", ["rd_attnres", "depth_swa"])
def test_variants_that_bypass_the_route_refuse_kimis_ablation_knobs(name):
    shape = resolve_model(ModelConfig(preset="tiny"), vocab_size=64)
    with pytest.raises(ConfigError, match=r"residual\.options\.score: 'sigmoid' is not supported"):
        check_pathway_shape(ResidualConfig(name=name, options={"score": "sigmoid"}), shape)


def test_rd_parameter_control_has_the_learned_routes_parameters():
    learned = make_model("rd_attnres", {"block_size": 2})
    merged = make_model("rd_attnres", {"block_size": 2, "value_route": "merged"})
    assert merged.pathway.extra_params() == learned.pathway.extra_params()
    block = make_model("block_attnres", {"block_size": 2})
    assert merged.pathway.extra_params() - block.pathway.extra_params() == 3 * 32  # one d-vector per layer


@pytest.mark.parametrize("d, n_layers, ffn", [(64, 4, 192), (512, 6, 1408), (1024, 24, 4096)])
def test_widened_prenorm_matches_reviews_parameter_count(d, n_layers, ffn):
    def total(name: str, ffn_hidden: int) -> int:
        shape = dict(preset="tiny", d_model=d, n_layers=n_layers, n_heads=4, ffn_hidden=ffn_hidden, seq_len=8)
        with torch.device("meta"):
            model = make_model(name, **shape)
        return sum(p.numel() for p in model.parameters())

    review = total("review", ffn)
    shape = resolve_model(ModelConfig(preset="tiny", d_model=d, n_layers=n_layers, n_heads=4, ffn_hidden=ffn),
                          vocab_size=64)
    widened = total("prenorm", widened_ffn_hidden(shape, 4 * d * d + 2 * d))
    assert abs(widened - review) <= 3 * d * n_layers / 2    # rounding the width: half a column per matrix
    assert total("prenorm", ffn) < review - n_layers * 3 * d * d


def test_review_convex_form_loses_the_embedding_gradient_past_20_layers():
    # the convex form (1 - r) h + r u halves the identity path per sublayer at r = 1/2: 48
    # sublayers scale the embedding's direct path by 2^-48; the additive form keeps it
    def embedding_grad(form: str, n_layers: int) -> float:
        model = make_model("review", {"form": form}, n_layers=n_layers)
        idx = tokens(b=2)
        model(idx[:, :-1], idx[:, 1:]).loss.backward()
        return float(model.embed.weight.grad.norm())

    shallow = embedding_grad("convex", 4) / embedding_grad("additive", 4)
    deep = embedding_grad("convex", 24) / embedding_grad("additive", 24)
    assert deep < 1e-2 * shallow, (shallow, deep)


def hsic1(x: torch.Tensor, y: torch.Tensor) -> float:
    """Song et al. (2012) eq. (5) on uncentred linear Grams."""
    n = x.shape[0]
    k, l_ = x @ x.T, y @ y.T
    k, l_ = k - torch.diag(k.diagonal()), l_ - torch.diag(l_.diagonal())
    ones = torch.ones(n, dtype=x.dtype)
    return float((torch.trace(k @ l_) + (ones @ k @ ones) * (ones @ l_ @ ones) / ((n - 1) * (n - 2))
                  - 2.0 / (n - 2) * (ones @ k @ l_ @ ones)) / (n * (n - 3)))


def test_dar_cross_stream_cka():
    model = make_model("dar").double()
    with torch.no_grad():
        for p in model.pathway.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(3), dtype=p.dtype) * 0.5)
    states = model.layer_states(tokens(b=2, t=8))
    out = model.pathway.diagnostics(states, model.routing_stats(tokens(b=2, t=8)))
    assert len(out["cross_stream_cka_layers"]) == 3 and out["cross_stream_cka"] == out["cross_stream_cka_layers"][-1]
    a, b = (s.state.reshape(-1, 32) for s in states[-1].streams)
    want = hsic1(a, b) / math.sqrt(hsic1(a, a) * hsic1(b, b))
    assert out["cross_stream_cka"] == pytest.approx(want, rel=1e-9)
    assert out["cross_stream_cka"] < 1 - 1e-6
    # zero queries keep the two streams identical (the module's symmetry note): CKA exactly 1
    twin = make_model("dar", {"query_init": "zero"}).double()
    twin_states = twin.layer_states(tokens(b=2, t=8))
    assert twin.pathway.cross_stream_cka(twin_states[-1]) == pytest.approx(1.0, abs=1e-12)


@pytest.mark.parametrize("name", ["kimi_routing_ablations", "delta_cumulative_routing", "rd_parameter_control",
                                  "review_vs_widened", "review_convex_depth", "dar_stream_cka"])
def test_each_claim_has_a_shipped_study(name):
    study = load_study(EXPERIMENTS / f"{name}.yaml")
    assert study.comparisons
    header = (EXPERIMENTS / f"{name}.yaml").read_text().split("\nstudy:")[0]
    assert "CPU-sized" in header or "GPU-sized" in header
