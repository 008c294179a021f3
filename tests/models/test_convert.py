"""reslab.models.convert: a trained prenorm checkpoint becomes delta_attnres (the same logits at the
shipped eps, to float32 rounding) or gated delta_block (exactly the same logits); anything but the pathway's parameters
missing or unexpected is an error naming the keys."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from reslab.models.backbone import build_model
from reslab.models.checkpoint import CHECKPOINT_NAME
from reslab.models.config import (
    CostConfig,
    DataConfig,
    ModelConfig,
    OptimConfig,
    ResidualConfig,
    RunConfig,
    TrainConfig,
    load,
    to_dict,
)
from reslab.models.convert import CONFIG_NAME, WEIGHTS_NAME, convert_checkpoint
from reslab.models.data import ByteTokenizer, Document, PrepareOptions, prepare
from reslab.models.residual import resolve_residual
from reslab.models.training import train

GATED_BLOCK = ResidualConfig(name="delta_block",
                             options={"gate": "learnable_alpha", "gate_init": 0.0, "null_source": True})
HAS_INIT_FROM = "init_from" in {f.name for f in dataclasses.fields(TrainConfig)}


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A prenorm run trained 6 steps by models.training.train on a small byte-level corpus."""
    root = tmp_path_factory.mktemp("convert")
    docs = [
        Document(f"doc{i}", "".join(f"def f{i}_{j}(x):\n    return x * {i + j} - {j}\n" for j in range(60)))
        for i in range(12)
    ]
    prepare(docs, root / "corpus", PrepareOptions(tokenizer=ByteTokenizer(), val_fraction=0.2,
                                                  source_description="test"))
    cfg = RunConfig(
        model=ModelConfig(preset="tiny", d_model=32, n_layers=3, n_heads=2, ffn_hidden=64, seq_len=16),
        data=DataConfig(corpus=str(root / "corpus")),
        optim=OptimConfig(lr=3e-3, warmup_steps=2, batch_size=4),
        train=TrainConfig(steps=6, eval_every=6, eval_windows=4, log_every=1, device="cpu", diagnostics=False),
        cost=CostConfig(measure=False),
    )
    train(cfg, root / "run")
    return root, cfg, root / "run" / CHECKPOINT_NAME


def prenorm_model(ckpt_path) -> torch.nn.Module:
    ckpt = torch.load(ckpt_path, weights_only=True)
    cfg = load(RunConfig, json.loads(ckpt["config"]))
    model = build_model(cfg.model, cfg.residual, vocab_size=ckpt["model"]["embed.weight"].shape[0])
    model.load_state_dict(ckpt["model"])
    return model


def converted_model(conversion) -> torch.nn.Module:
    weights = torch.load(conversion.weights, weights_only=True)
    model = build_model(
        load(ModelConfig, conversion.config["model"]), load(ResidualConfig, conversion.config["residual"]),
        vocab_size=weights["embed.weight"].shape[0],
    )
    model.load_state_dict(weights)
    return model


def tokens() -> torch.Tensor:
    return torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))


def test_delta_attnres_keeps_the_logits(source, tmp_path):
    # h_hat = (1 + 1/N) h, which stream_scale divides by (1 + 1/N): the source's logits at norm_eps=1e-6
    # up to float32 rounding. The literal h_hat (stream_scale=False) changes RMSNorm's eps term
    # (variants.md 0.1) and moves them by ~5e-5 here (7e-5 of their scale); a wrong source ~1e-2
    _, _, ckpt = source
    conversion = convert_checkpoint(ckpt, ResidualConfig(name="delta_attnres"), tmp_path)
    base, model = prenorm_model(ckpt), converted_model(conversion)
    idx = tokens()
    ref = base(idx).logits
    scale = ref.abs().max().item()
    assert (model(idx).logits - ref).abs().max().item() < 1e-6 * scale
    literal = converted_model(convert_checkpoint(ckpt, ResidualConfig(name="delta_attnres",
                                                                      options={"stream_scale": False}),
                                                 tmp_path / "literal"))
    diff = (literal(idx).logits - ref).abs().max().item()
    assert 1e-6 * scale < diff < 1e-3 * scale, diff


def test_gated_delta_block_is_exact(source, tmp_path):
    _, _, ckpt = source
    conversion = convert_checkpoint(ckpt, GATED_BLOCK, tmp_path)
    base, model = prenorm_model(ckpt), converted_model(conversion)
    idx = tokens()
    assert torch.equal(model(idx).logits, base(idx).logits)
    ungated = converted_model(convert_checkpoint(ckpt, ResidualConfig(name="delta_block"), tmp_path / "ungated"))
    assert (ungated(idx).logits - base(idx).logits).abs().max() > 1e-3


def test_new_parameters_keep_their_init_and_the_backbone_is_copied(source, tmp_path):
    _, _, ckpt = source
    conversion = convert_checkpoint(ckpt, GATED_BLOCK, tmp_path)
    weights = torch.load(conversion.weights, weights_only=True)
    trained = torch.load(ckpt, weights_only=True)["model"]
    fresh = build_model(
        load(ModelConfig, conversion.config["model"]), resolve_residual(GATED_BLOCK),
        vocab_size=trained["embed.weight"].shape[0],
    ).state_dict()
    assert set(weights) == set(fresh)
    for key, value in weights.items():
        expected = fresh[key] if key.startswith("pathway.") else trained[key]
        assert torch.equal(value, expected), key
    assert any(key.startswith("pathway.") for key in weights)


def test_run_config(source, tmp_path):
    _, cfg, ckpt = source
    conversion = convert_checkpoint(ckpt, GATED_BLOCK, tmp_path / "out")
    assert conversion.weights == (tmp_path / "out" / WEIGHTS_NAME).resolve()
    assert json.loads((tmp_path / "out" / CONFIG_NAME).read_text()) == conversion.config
    expected = to_dict(dataclasses.replace(cfg, residual=resolve_residual(GATED_BLOCK)))
    expected["train"]["init_from"] = str(conversion.weights)
    assert conversion.config == expected
    assert conversion.config["residual"]["options"]["num_blocks"] == 4


def _rewrite(ckpt_path, out_path, edit) -> None:
    ckpt = torch.load(ckpt_path, weights_only=True)
    edit(ckpt)
    torch.save(ckpt, out_path)


def test_mismatched_keys_are_named(source, tmp_path):
    _, _, ckpt = source

    def add_key(c):
        c["model"]["sublayers.9.extra"] = torch.zeros(1)

    def drop_key(c):
        del c["model"]["norms.2.weight"]

    def not_prenorm(c):
        cfg = json.loads(c["config"])
        cfg["residual"] = {"name": "attnres", "options": {}, "impl": "auto"}
        c["config"] = json.dumps(cfg)

    for edit, message in (
        (add_key, r"unexpected \['sublayers.9.extra'\]"),
        (drop_key, r"missing \['norms.2.weight'\]"),
        (not_prenorm, "residual is 'attnres'; conversion starts from 'prenorm'"),
    ):
        bad = tmp_path / f"{edit.__name__}.pt"
        _rewrite(ckpt, bad, edit)
        with pytest.raises(ValueError, match=message):
            convert_checkpoint(bad, GATED_BLOCK, tmp_path / edit.__name__)


@pytest.mark.skipif(not HAS_INIT_FROM, reason="needs TrainConfig.init_from (the diff in the convert report)")
def test_training_continues_from_the_conversion(source, tmp_path):
    root, _, ckpt = source
    conversion = convert_checkpoint(ckpt, GATED_BLOCK, tmp_path / "conv")
    cfg = load(RunConfig, conversion.config)
    result = train(cfg, tmp_path / "run")
    # the first logged loss is the source model's loss on the step-0 batch: same function exactly
    from reslab.models.data import TokenDataset

    x, y = TokenDataset.open(cfg.data).train_samples(0, cfg.optim.batch_size, 16, cfg.data_seed)
    with torch.no_grad():
        expected = prenorm_model(ckpt)(x, y).loss.item()
    assert result.history["train"][0]["train_loss"] == pytest.approx(expected, rel=1e-6)
    assert result.history["train"][-1]["train_loss"] < result.history["train"][0]["train_loss"]
