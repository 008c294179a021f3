"""The training loop: determinism, exact resume, divergence detection, bad-config errors."""

from __future__ import annotations

import dataclasses
import math

import pytest

from reslab.models.config import (
    ConfigError,
    CostConfig,
    ModelConfig,
    OptimConfig,
    ResidualConfig,
    RunConfig,
    TrainConfig,
)
from reslab.models.training import StopRun, TrainingDiverged, lr_at, train


def tiny_run(name: str = "attnres", steps: int = 12, optim_kw: dict | None = None, **train_kw) -> RunConfig:
    return RunConfig(
        model=ModelConfig(preset="tiny", d_model=32, n_layers=2, n_heads=2, ffn_hidden=64, seq_len=32),
        residual=ResidualConfig(name=name),
        optim=OptimConfig(batch_size=4, warmup_steps=3, grad_accum=2, **(optim_kw or {})),
        train=TrainConfig(steps=steps, eval_every=4, eval_windows=8, log_every=2, seed=3, **train_kw),
        cost=CostConfig(measure=False),  # tests/models/test_serving.py measures it
    )


def stop_at(step: int):
    """An `on_step` callback that stops the run after `step` optimizer steps."""
    def on_step(done: int) -> None:
        if done == step:
            raise StopRun(done)
    return on_step


def losses(result) -> list[float]:
    return [e["train_loss"] for e in result.history["train"]] + [e["val_loss"] for e in result.history["eval"]]


def test_arms_of_any_batch_size_are_scored_on_the_same_tokens():
    """The eval set is `eval_windows` windows whatever the batch size (which only chunks them),
    and the loss over them is the mean over every target, however they are chunked."""
    import dataclasses

    import torch

    from reslab.models.training import Trainer, evaluate

    base = tiny_run("prenorm", eval_batch_size=None)
    trainers = [Trainer(dataclasses.replace(base, optim=dataclasses.replace(base.optim, batch_size=b)))
                for b in (3, 8)]
    windows = [torch.cat([x for x, _ in t.val_batches]) for t in trainers]
    assert [len(t.val_batches) for t in trainers] == [3, 1] and torch.equal(*windows) and len(windows[0]) == 8
    model = trainers[0].model
    one = evaluate(model, trainers[1].val_batches, torch.device("cpu"), trainers[0].autocast)
    uneven = evaluate(model, trainers[0].val_batches, torch.device("cpu"), trainers[0].autocast)  # 3 + 3 + 2 rows
    assert uneven == pytest.approx(one, rel=1e-6)


@pytest.mark.parametrize("name", ["prenorm", "attnres", "block_attnres"])
def test_same_seed_same_losses(name):
    a, b = train(tiny_run(name)), train(tiny_run(name))
    assert losses(a) == losses(b)
    assert a.summary["val_loss"] == b.summary["val_loss"]


def test_seed_changes_the_run():
    a = train(tiny_run())
    b = train(RunConfig(**{**tiny_run().__dict__, "train": TrainConfig(
        steps=12, eval_every=4, eval_windows=8, log_every=2, seed=4)}))
    assert losses(a) != losses(b)


def test_data_seed_decouples_data_order_from_init():
    base = tiny_run()
    same_data = RunConfig(**{**base.__dict__, "train": TrainConfig(
        steps=12, eval_every=4, eval_windows=8, log_every=2, seed=3, data_seed=3)})
    assert losses(train(base)) == losses(train(same_data))


# muon: both optimizers' states (Muon's momentum, AdamW's moments) go through the checkpoint, as Adafactor's
# factored moments do; wsd: the
# schedule is a pure function of the step, so a resumed run continues its cooldown
@pytest.mark.parametrize("name,optim_kw", [
    ("prenorm", None), ("block_attnres", None),
    ("prenorm", {"name": "muon"}),
    ("block_attnres", {"name": "muon", "options": {"adjust_lr": "original"}, "lr": 0.01}),
    ("attnres", {"name": "muon", "schedule": "wsd", "schedule_options": {"cooldown_fraction": 0.5}}),
    ("prenorm", {"name": "adafactor", "lr": 0.01}),
])
def test_interrupted_and_resumed_run_gives_the_same_curve(tmp_path, name, optim_kw):
    cfg = tiny_run(name, steps=12, optim_kw=optim_kw)
    straight = train(cfg, tmp_path / "straight")
    with pytest.raises(StopRun, match="stopped at step 5"):
        train(cfg, tmp_path / "resumed", on_step=stop_at(5))
    resumed = train(cfg, tmp_path / "resumed")
    assert resumed.info["start_step"] == 5
    assert losses(resumed) == losses(straight)
    assert resumed.summary["val_loss_tail"] == straight.summary["val_loss_tail"]


def test_resume_refuses_a_checkpoint_from_another_config(tmp_path):
    with pytest.raises(StopRun):
        train(tiny_run(steps=12), tmp_path / "run", on_step=stop_at(4))
    with pytest.raises(RuntimeError, match="different config"):
        train(tiny_run(steps=13), tmp_path / "run")


def test_divergence_stops_the_run(monkeypatch):
    # a deterministic NaN: real divergence needs many steps or an absurd LR, so poison the loss
    from reslab.models import backbone

    real_forward = backbone.Decoder.forward
    calls = {"n": 0}

    def poisoned(self, idx, targets=None):
        out = real_forward(self, idx, targets)
        calls["n"] += 1
        if targets is not None and calls["n"] >= 6:
            out.loss = out.loss * float("nan")
        return out

    monkeypatch.setattr(backbone.Decoder, "forward", poisoned)
    with pytest.raises(TrainingDiverged, match=r"loss is nan at step 3"):
        train(tiny_run())


def test_schedule_warmup_then_cosine_to_floor():
    cfg = tiny_run(steps=100)
    lrs = [lr_at(s, cfg) for s in range(100)]
    peak = cfg.optim.lr
    assert lrs[0] == pytest.approx(peak / 3) and lrs[2] == pytest.approx(peak)
    assert all(a >= b for a, b in zip(lrs[2:], lrs[3:], strict=False))
    assert lrs[-1] == pytest.approx(peak * cfg.optim.min_lr_ratio, rel=1e-3)


def test_training_lowers_the_loss_and_reports_everything():
    result = train(tiny_run("attnres", steps=24))
    first, last = result.history["eval"][0]["val_loss"], result.summary["val_loss"]
    assert last < first < math.log(257) + 0.5
    for key in ("val_loss", "val_loss_tail", "train_loss", "tokens_per_s", "peak_mem_mb", "params_residual"):
        assert math.isfinite(result.summary[key]), key
    assert len(result.info["data_fingerprint"]) > 16
    assert "routing_entropy" in result.history["eval"][-1]


def test_bad_config_is_a_clear_error():
    with pytest.raises(ConfigError, match=r"optim.lr: must be > 0"):
        train(RunConfig(optim=OptimConfig(lr=0)))
    with pytest.raises(ConfigError, match=r"model.preset: unknown preset 'huge'; allowed: tiny"):
        train(RunConfig(model=ModelConfig(preset="huge")))


def test_the_trainer_asks_the_parallel_how_to_step():
    """Issue 50: the pipeline stage sits behind `Parallel.steps`; the loop never asks which placement it has."""
    import inspect

    from reslab.models.distributed import ReplicatedSteps
    from reslab.models.training import Trainer

    assert isinstance(Trainer(tiny_run(steps=2)).steps, ReplicatedSteps)
    source = inspect.getsource(Trainer)
    assert "staged" not in source and ".pipeline" not in source


def test_an_evaluation_before_the_first_log_window_says_train_dash():
    """Issue 52, item 16: `reslab train` printed "train nan" at an evaluation before any train loss was logged
    (here at step 1, the log window every 4 steps); the study driver prints "train -"."""
    from reslab.models.training import Trainer

    lines: list[str] = []
    cfg = dataclasses.replace(tiny_run("prenorm", steps=2), train=TrainConfig(steps=2, eval_every=1, eval_windows=4,
                                                                               log_every=4, seed=3))
    Trainer(cfg, log=lines.append, resume=False).fit()
    first = next(line for line in lines if line.startswith("step      1/2"))
    assert "| train - | val " in first and "nan" not in first, lines
