"""The training loop's own guarantees under faults: a finished run is never retrained, throughput
counts only the steps that ran, divergence rules end a run, a damaged checkpoint is named."""

from __future__ import annotations

import math

import pytest
import torch

from reslab.models.checkpoint import CHECKPOINT_NAME, CheckpointUnreadable
from reslab.models.config import (
    ConfigError,
    CostConfig,
    DivergenceConfig,
    ModelConfig,
    OptimConfig,
    ResidualConfig,
    RunConfig,
    TrainConfig,
)
from reslab.models.resolve import validate_run_config
from reslab.models.training import StopRun, TrainingDiverged, train


def tiny_run(steps: int = 12, lr: float = 3e-3, **train_kw) -> RunConfig:
    return RunConfig(
        model=ModelConfig(preset="tiny", d_model=32, n_layers=2, n_heads=2, ffn_hidden=64, seq_len=32),
        residual=ResidualConfig(name="prenorm"),
        optim=OptimConfig(batch_size=4, warmup_steps=2, lr=lr),
        train=TrainConfig(steps=steps, eval_every=3, eval_windows=8, log_every=1, seed=3, diagnostics=False,
                          **train_kw),
        cost=CostConfig(measure=False),
    )


def stop_at(k: int):
    def on_step(done: int) -> None:
        if done == k:
            raise StopRun(done)
    return on_step


def test_a_finished_run_trains_nothing_again_and_keeps_its_summary(tmp_path):
    cfg = tiny_run()
    first = train(cfg, tmp_path)
    lines: list[str] = []
    again = train(cfg, tmp_path, log=lines.append)
    assert again.summary == first.summary and again.info == first.info
    assert first.summary["tokens_per_s"] > 0
    assert any("nothing to train" in line for line in lines)


def test_a_resumed_run_reports_throughput_over_the_steps_it_trained(tmp_path):
    cfg = tiny_run()
    with pytest.raises(StopRun):
        train(cfg, tmp_path, on_step=stop_at(5))
    result = train(cfg, tmp_path)
    segments = result.info["segments"]
    assert [(s["start_step"], s["end_step"]) for s in segments] == [(0, 5), (5, 12)]
    tokens_per_step = 4 * 32
    for s in segments:
        assert s["tokens_per_s"] == pytest.approx(tokens_per_step * (s["end_step"] - s["start_step"]) /
                                                  s["train_time_s"])
    total_time = sum(s["train_time_s"] for s in segments)
    assert result.summary["train_time_s"] == pytest.approx(total_time)
    assert result.summary["tokens_per_s"] == pytest.approx(tokens_per_step * 12 / total_time)


def test_lr_5_ends_as_diverged_with_the_reason():
    with pytest.raises(TrainingDiverged, match=r"above 1.5 x the initial loss .* for 2 evaluation\(s\) in a row"):
        train(tiny_run(lr=5.0))


def test_the_default_rule_leaves_a_healthy_run_alone():
    result = train(tiny_run(steps=12))
    initial = result.history["train"][0]["train_loss"]
    assert max(e["val_loss"] for e in result.history["eval"]) < initial


def test_patience_and_ratio_are_knobs():
    # lr 1 spikes to ~14-30 (vs an initial 5.65) and comes back to 6.0 by step 12
    with pytest.raises(TrainingDiverged, match="for 1 evaluation"):
        train(tiny_run(lr=1.0, divergence=DivergenceConfig(patience=1)))
    relaxed = train(tiny_run(lr=1.0, divergence=DivergenceConfig(max_loss_ratio=None)))
    assert math.isfinite(relaxed.summary["val_loss"])


def test_nan_at_evaluation_is_divergence(monkeypatch):
    from reslab.models import training

    monkeypatch.setattr(training, "evaluate", lambda *a, **k: float("nan"))  # a NaN only eval sees
    with pytest.raises(TrainingDiverged, match=r"val_loss is nan at step 3 \(evaluation\)"):
        train(tiny_run())


@pytest.mark.parametrize("field, value", [("max_loss_ratio", 1.0), ("max_loss_ratio", float("nan")),
                                          ("patience", 0)])
def test_bad_divergence_rules_name_the_field(field, value):
    with pytest.raises(ConfigError, match=f"train.divergence.{field}"):
        validate_run_config(tiny_run(divergence=DivergenceConfig(**{field: value})))


def test_a_corrupt_checkpoint_is_named_and_not_a_crash(tmp_path):
    cfg = tiny_run()
    with pytest.raises(StopRun):
        train(cfg, tmp_path, on_step=stop_at(3))
    path = tmp_path / CHECKPOINT_NAME
    path.write_bytes(path.read_bytes()[:200])
    with pytest.raises(CheckpointUnreadable, match=str(path)):
        train(cfg, tmp_path)
    torch.save({"not": "a checkpoint"}, path)
    with pytest.raises(CheckpointUnreadable, match="not a reslab checkpoint"):
        train(cfg, tmp_path)
