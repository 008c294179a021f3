"""Muon beside AdamW (the split, the shape error, the lr reaching both, bad values), the wsd schedule's
values, checked against the formula worked by hand, and the registry around them (`models.optim`): the
restrictions each optimizer declares, the flat fields of before issue 50 read with one deprecation line, and
the run ids of those configs unchanged (pinned from the code before the registry, 7652683)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from reslab.models.config import ConfigError, ModelConfig, OptimConfig, ResidualConfig, RunConfig, TrainConfig
from reslab.models.optim.muon import MuonAdamW
from reslab.models.training import Trainer, lr_at, make_optimizer, train

# the hidden matrices by name, independently of `muon_matrices`' isinstance walk
HIDDEN = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight",
          "gate_proj.weight", "up_proj.weight", "down_proj.weight")


def run(variant: str = "attnres", steps: int = 8, **optim_kw) -> RunConfig:
    return RunConfig(
        model=ModelConfig(preset="tiny", d_model=32, n_layers=2, n_heads=2, ffn_hidden=64, seq_len=32),
        residual=ResidualConfig(name=variant),
        optim=OptimConfig(batch_size=4, warmup_steps=2, **optim_kw),
        train=TrainConfig(steps=steps, eval_every=4, eval_windows=8, log_every=2, seed=3, diagnostics=False),
    )


def wsd(steps: int, **optim_kw) -> list[float]:
    cfg = run(steps=steps, **optim_kw)
    return [lr_at(s, cfg) / cfg.optim.lr for s in range(steps)]


def test_wsd_linear_by_hand():
    # 20 steps, warmup 2, cooldown round(0.25 * 20) = 5 steps (15..19), floor 0.1:
    # warmup 1/2, 2/2; flat 1 for 2..14; step 15 + k has p = (k + 1) / 5 and 0.1 + 0.9 * (1 - p)
    got = wsd(20, schedule="wsd", schedule_options={"cooldown_fraction": 0.25, "cooldown_shape": "linear"},
              min_lr_ratio=0.1)
    want = [0.5, 1.0] + [1.0] * 13 + [0.82, 0.64, 0.46, 0.28, 0.1]
    assert got == pytest.approx(want, abs=1e-12)


def test_wsd_one_minus_sqrt_by_hand():
    # 10 steps, warmup 2, cooldown round(0.4 * 10) = 4 steps (6..9), floor 0: 1 - sqrt(p) at p = 1/4, 2/4, 3/4, 1
    got = wsd(10, schedule="wsd", schedule_options={"cooldown_fraction": 0.4, "cooldown_shape": "1-sqrt"},
              min_lr_ratio=0.0)
    want = [0.5, 1.0, 1.0, 1.0, 1.0, 1.0, 0.5, 1 - 0.5 ** 0.5, 1 - 0.75 ** 0.5, 0.0]
    assert got == pytest.approx(want, abs=1e-12)


def test_wsd_cooldown_never_eats_the_warmup():
    # cooldown_fraction 1 asks for all 6 steps; it starts after the 2 warmup steps: 4 steps, linear to 0.2
    got = wsd(6, schedule="wsd", schedule_options={"cooldown_fraction": 1.0, "cooldown_shape": "linear"},
              min_lr_ratio=0.2)
    assert got == pytest.approx([0.5, 1.0, 0.8, 0.6, 0.4, 0.2], abs=1e-12)


@pytest.mark.parametrize("variant", ["prenorm", "mhc", "block_attnres"])
def test_muon_takes_the_hidden_matrices_and_adamw_the_rest(variant):
    trainer = Trainer(run(variant, name="muon"))
    opt = trainer.optimizer
    assert isinstance(opt, MuonAdamW)
    names = {id(p): n for n, p in trainer.model.named_parameters()}
    muon = {names[id(p)] for g in opt.muon.param_groups for p in g["params"]}
    adamw = {names[id(p)] for g in opt.adamw.param_groups for p in g["params"]}
    assert muon == {n for n in names.values() if n.startswith("sublayers.") and n.endswith(HIDDEN)}
    assert muon.isdisjoint(adamw) and muon | adamw == set(names.values())
    assert "embed.weight" in adamw and (variant == "prenorm" or any(n.startswith("pathway.") for n in adamw))
    # the scheduler writes lr into `param_groups`: those are both optimizers' own groups
    for group in opt.param_groups:
        group["lr"] = 0.123
    assert {g["lr"] for g in opt.muon.param_groups + opt.adamw.param_groups} == {0.123}
    assert opt.muon.param_groups[0]["adjust_lr_fn"] == "match_rms_adamw"


def test_adamw_default_is_unchanged():
    trainer = Trainer(run("prenorm"))
    assert type(trainer.optimizer) is torch.optim.AdamW
    assert sum(len(g["params"]) for g in trainer.optimizer.param_groups) == len(list(trainer.model.parameters()))


def test_muon_on_a_matrix_it_cannot_orthogonalise_is_one_line():
    # a 3-D weight in an MLP, as stacked experts would be: Muon orthogonalises 2-D matrices only
    trainer = Trainer(run("prenorm"))
    trainer.model.sublayers[1].experts = nn.Parameter(torch.zeros(2, 4, 8))
    with pytest.raises(ConfigError, match=r"^optim.name: muon cannot orthogonalise sublayers.1.experts of shape "
                                          r"\(2, 4, 8\): Muon takes 2-D matrices only; use optim.name: adamw") as e:
        make_optimizer(trainer.model, run("prenorm", name="muon"), torch.device("cpu"))
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("optim,match", [
    ({"name": "sgd"}, r"^config.optim.name: unknown optimizer 'sgd'; allowed: adafactor, adamw, muon$"),
    ({"name": "muon", "options": {"adjust_lr": "spectral"}}, r"^config.optim.options \(muon\).adjust_lr"),
    ({"schedule": "step"}, r"^config.optim.schedule: unknown schedule 'step'; allowed: cosine, wsd$"),
    ({"schedule": "wsd", "schedule_options": {"cooldown_shape": "sqrt"}},
     r"^config.optim.schedule_options \(wsd\).cooldown_shape"),
    ({"name": "muon", "options": {"momentum": 1.0}}, r"^config.optim.options.momentum: must be in \[0, 1\)"),
    ({"name": "muon", "options": {"ns_steps": 0}}, r"^config.optim.options.ns_steps: must be in \[1, 20\]"),
    ({"schedule": "wsd", "schedule_options": {"cooldown_fraction": 1.5}},
     r"^config.optim.schedule_options.cooldown_fraction: must be in \[0, 1\]"),
    ({"name": "adamw", "options": {"momentum": 0.9}}, r"^config.optim.options \(adamw\): unknown key\(s\) 'momentum'"),
])
def test_bad_optim_values_are_one_line(optim, match):
    from reslab.models.config import load, to_dict

    data = to_dict(run())
    data["optim"].update(optim)
    with pytest.raises(ConfigError, match=match) as e:
        train(load(RunConfig, data))
    assert "\n" not in str(e.value)


def test_muon_trains():
    result = train(run("prenorm", steps=16, name="muon", lr=3e-3))
    first, last = result.history["eval"][0]["val_loss"], result.summary["val_loss"]
    assert math.isfinite(last) and last < first


def test_the_optimizer_and_schedule_knobs_are_tunable():
    from reslab.experiments.tune import parse_tune

    space = {"optim.name": {"type": "categorical", "choices": ["adamw", "muon"]},
             "optim.options.adjust_lr": {"type": "categorical", "choices": ["original", "match_rms_adamw"]},
             "optim.schedule": {"type": "categorical", "choices": ["cosine", "wsd"]},
             "optim.schedule_options.cooldown_shape": {"type": "categorical", "choices": ["linear", "1-sqrt"]},
             "optim.schedule_options.cooldown_fraction": {"type": "float", "low": 0.05, "high": 0.3},
             "optim.options.momentum": {"type": "float", "low": 0.8, "high": 0.98},
             "optim.options.ns_steps": {"type": "int", "low": 3, "high": 7}}
    spec = parse_tune({"trials": 4, "seed": 99, "space": space}, ["control"], (0, 1), False)
    assert [p.path for p in spec.space["control"]] == list(space)
    with pytest.raises(ConfigError, match=r"unknown field optim.muon_momentum"):
        parse_tune({"trials": 4, "seed": 99, "space": {"optim.muon_momentum": {"type": "float", "low": 0.8,
                                                                               "high": 0.9}}},
                   ["control"], (0, 1), False)


# run ids of resolved configs computed by the code before the registry (7652683, flat `optim` fields), with the
# same config in the old spelling and in the new one
PINNED_IDS = [
    ({}, {}, "prenorm-6b12dffd3858"),
    ({"name": "muon"}, {"name": "muon"}, "prenorm-0b4e60e6cc37"),
    ({"name": "muon", "muon_momentum": 0.9, "muon_ns_steps": 4, "muon_adjust_lr": "original", "muon_nesterov": False},
     {"name": "muon", "options": {"momentum": 0.9, "ns_steps": 4, "adjust_lr": "original", "nesterov": False}},
     "prenorm-bc7f1d4a3940"),
    ({"schedule": "wsd"}, {"schedule": "wsd"}, "prenorm-9e5066eee83e"),
    ({"schedule": "wsd", "cooldown_fraction": 0.3, "cooldown_shape": "linear"},
     {"schedule": "wsd", "schedule_options": {"cooldown_fraction": 0.3, "cooldown_shape": "linear"}},
     "prenorm-0b2c93ef7369"),
    ({"name": "muon", "schedule": "wsd", "cooldown_fraction": 0.2, "lr": 3e-3},
     {"name": "muon", "schedule": "wsd", "schedule_options": {"cooldown_fraction": 0.2}, "lr": 3e-3},
     "prenorm-96c771e4adf0"),
]


@pytest.mark.parametrize("old,new,run_id", PINNED_IDS)
def test_run_ids_of_either_spelling_are_those_of_before_the_registry(old, new, run_id):
    import warnings

    from reslab.experiments import run_id_of
    from reslab.models.config import load
    from reslab.models.resolve import validate_run_config

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        legacy = validate_run_config(load(RunConfig, {"optim": old}))
    flat = [k for k in old if k.startswith(("muon_", "cooldown_"))]
    assert len(seen) == len(flat) and all(issubclass(w.category, FutureWarning) for w in seen)
    assert all("\n" not in str(w.message) and "deprecated, write optim." in str(w.message) for w in seen)
    current = validate_run_config(load(RunConfig, {"optim": new}))
    assert legacy == current
    assert run_id_of(legacy) == run_id_of(current) == run_id


def test_a_flat_knob_of_a_kind_not_picked_is_dropped_with_its_line():
    from reslab.models.config import load

    with pytest.warns(FutureWarning, match=r"^optim.muon_momentum: deprecated, write optim.options.momentum "
                                           r"\(with optim.name: muon\); ignored beside optim.name: adamw$"):
        cfg = load(RunConfig, {"optim": {"muon_momentum": 0.9}})
    assert cfg.optim == OptimConfig()


def test_the_deprecation_is_one_line_once_a_process(tmp_path):
    """`reslab validate` of a study whose base and two arms repeat two flat fields: two lines on stderr."""
    import subprocess
    import sys

    study = tmp_path / "s.yaml"
    study.write_text("study: legacy\nbase: {model: {preset: tiny}, train: {steps: 5}, optim: {name: muon, "
                     "muon_momentum: 0.9, schedule: wsd, cooldown_fraction: 0.2}}\n"
                     "arms: {control: prenorm, attnres: attnres}\nseeds: 1\n")
    out = subprocess.run([sys.executable, "-m", "reslab.orchestrator.cli", "validate", str(study)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stderr.splitlines() == [
        "reslab config:0: DeprecatedField: optim.muon_momentum: deprecated, write optim.options.momentum "
        "(with optim.name: muon)",
        "reslab config:0: DeprecatedField: optim.cooldown_fraction: deprecated, write "
        "optim.schedule_options.cooldown_fraction (with optim.schedule: wsd)"]


def test_a_config_of_a_new_kind_is_hashed_as_it_is():
    from reslab.models.config import to_dict
    from reslab.models.optim import hashed_optim

    o = OptimConfig(name="adafactor", options={"d": 2.0})
    assert hashed_optim(to_dict(o)) == to_dict(o)
    assert "muon_momentum" in hashed_optim(to_dict(OptimConfig()))  # the flat form of before issue 50


@pytest.mark.parametrize("name,place,message", [
    ("muon", {"ranks": 2}, "optim.name: muon trains in one process (got 2 ranks); use adafactor, adamw"),
    ("muon", {"ranks": 2, "stages": 2}, "optim.name: muon with pipeline_stages is not supported; allowed: "
                                        "adafactor, adamw"),
    ("adafactor", {"ranks": 2, "sharding": "fsdp"}, "optim.name: adafactor with sharding: fsdp is not supported "
                                                     "(a rank holds shards); allowed: adamw"),
    ("adamw", {"ranks": 8, "stages": 2, "sharding": "fsdp"}, None),
    ("muon", {}, None),
])
def test_each_optimizer_declares_where_it_trains(name, place, message):
    from reslab.models.optim import optimizer_refusal

    if message is None:  # it trains there: no error
        optimizer_refusal(OptimConfig(name=name), **place)
    else:
        with pytest.raises(ConfigError) as e:
            optimizer_refusal(OptimConfig(name=name), **place)
        assert str(e.value) == message


def test_a_run_recorded_before_the_registries_is_the_same_run():
    """A run directory's `spec.json` and a checkpoint written before the registries hold the flat `optim` section
    (the form the run id still hashes, pinned above); resuming such a run compares it to today's config by that
    form (`same_config`), so an interrupted run resumes instead of being refused as a different config."""
    from reslab.models.config import load, to_dict
    from reslab.models.optim import hashed_config, same_config
    from reslab.models.resolve import validate_run_config

    def cfg(momentum: float) -> RunConfig:
        return validate_run_config(load(RunConfig, {"optim": {"name": "muon", "options": {"momentum": momentum}}}))

    recorded = hashed_config(cfg(0.9))
    assert recorded["optim"]["muon_momentum"] == 0.9 and "options" not in recorded["optim"]
    assert same_config(recorded, to_dict(cfg(0.9))) and same_config(to_dict(cfg(0.9)), recorded)
    assert not same_config(recorded, to_dict(cfg(0.8)))
