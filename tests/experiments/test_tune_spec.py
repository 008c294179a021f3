"""The `tune:` block: what it accepts, and one-line errors naming the field for what it does not."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from reslab.experiments import SpecError, load_study

EXPERIMENTS = Path(__file__).resolve().parents[2] / "experiments"

STUDY = """
study: s
base:
  model: {preset: tiny, d_model: 32, seq_len: 32, n_layers: 2}
  optim: {batch_size: 4}
  train: {steps: 6}
arms:
  control: prenorm
  block: {residual: {name: block_attnres, options: {block_size: 2}}}
seeds: 2
tune:
"""

GOOD = """
  trials: 4
  seed: 9
  space:
    optim.lr: {type: float, low: 1e-4, high: 1.0e-2, log: true}
    optim.warmup_steps: {type: int, low: 0, high: 4}
  arms:
    block: {residual.options.block_size: {type: categorical, choices: [1, 2]}}
"""


def load(tmp_path: Path, tune: str):
    path = tmp_path / "s.yaml"
    path.write_text(textwrap.dedent(STUDY) + textwrap.indent(textwrap.dedent(tune).strip("\n"), "  ") + "\n")
    return load_study(path)


def test_shared_and_per_arm_spaces_with_defaults(tmp_path):
    spec = load(tmp_path, GOOD).tune
    assert spec is not None
    assert [p.path for p in spec.space["control"]] == ["optim.lr", "optim.warmup_steps"]
    assert spec.space["control"][0].low == 1e-4  # `1e-4` is a string to YAML 1.1, a number here
    assert [p.path for p in spec.space["block"]] == ["optim.lr", "optim.warmup_steps", "residual.options.block_size"]
    assert (spec.sampler, spec.pruner, spec.metric, spec.direction) == ("tpe", "median", "val_loss_tail", "minimize")


def test_grid_sampler_needs_a_grid_and_enough_points(tmp_path):
    grid = """
      trials: 3
      seed: 9
      sampler: grid
      space: {optim.warmup_steps: {type: int, low: 0, high: 2}}
    """
    spec = load(tmp_path, grid).tune
    assert spec is not None and spec.grid_size("control") == 3
    with pytest.raises(SpecError, match=r"tune.trials: 4 is more than arm 'control''s grid of 3 points"):
        load(tmp_path, grid.replace("trials: 3", "trials: 4"))
    with pytest.raises(SpecError, match=r"tune.sampler: grid needs categoricals"):
        load(tmp_path, GOOD.replace("trials: 4", "trials: 4\n  sampler: grid"))


@pytest.mark.parametrize(("old", "new", "message"), [
    ("seed: 9", "seed: 1", r"tune.seed: 1 is also a comparison seed \(seeds: \[0, 1\]\)"),
    ("trials: 4", "trials: 0", r"tune.trials: expected trials per arm"),
    # the one loader's words for unknown keys (before: "unknown key(s) ['budget']")
    ("trials: 4", "trials: 4\nbudget: 3", r"tune: unknown key\(s\) 'budget'; allowed: trials, seed"),
    ("optim.lr:", "optim.lrr:", r"tune.space: 'optim.lrr': unknown field optim.lrr \(did you mean 'lr'\?\)"),
    ("log: true}", "log: true, step: 0.1}", r"tune.space.optim.lr.step: expected a positive step on a linear scale"),
    ("low: 1e-4, high: 1.0e-2", "low: 1.0e-2, high: 1.0e-4", r"tune.space.optim.lr: low \(0.01\) must be below"),
    ("low: 1e-4", "low: abc", r"tune.space.optim.lr.low: expected a number, got 'abc'"),
    ("type: float", "type: loguniform", r"tune.space.optim.lr.type: 'loguniform' is not a parameter type"),
    ("choices: [1, 2]", "choices: [1, 1]", r"tune.arms.block.residual.options.block_size.choices: values repeat"),
    ("block: {residual", "nope: {residual", r"tune.arms.nope: not an arm of this study; arms: control, block"),
    ("trials: 4", "trials: 4\nsampler: bayes", r"tune.sampler.name: 'bayes' is not allowed; allowed: tpe, cmaes"),
    ("trials: 4", "trials: 4\npruner: {name: median, patience: 2}", r"tune.pruner.patience: not a knob of the median"),
    ("trials: 4", "trials: 4\nobjective: tokens_per_s", r"tune.pruner: pruning compares per-eval values"),
    ("trials: 4", "trials: 4\nobjective: {metric: bleu}", r"tune.objective.metric: 'bleu' is not a metric"),
    ("optim.lr:", "train.seed:", r"tune.space: train.seed cannot be tuned"),
    ("low: 0, high: 4", "low: 0.5, high: 4", r"tune.space.optim.warmup_steps.low: an int parameter needs an integer"),
])
def test_errors_name_the_field(tmp_path, old, new, message):
    assert old in GOOD, old
    text = GOOD.replace(old, new.replace("\n", "\n  " if old.startswith("trials") else "\n"))
    with pytest.raises(SpecError, match=message) as exc:
        load(tmp_path, text)
    assert "\n" not in str(exc.value)


def test_maximize_metric_without_pruner_is_allowed(tmp_path):
    spec = load(tmp_path, GOOD.replace("trials: 4", "trials: 4\n  objective: tokens_per_s\n  pruner: none")).tune
    assert spec is not None and (spec.metric, spec.direction, spec.pruner) == ("tokens_per_s", "maximize", "none")


def test_shipped_tune_study_loads_and_its_seeds_are_disjoint():
    study = load_study(EXPERIMENTS / "tune_lr_tiny.yaml")
    assert study.tune is not None and study.tune.seed not in study.seeds
    assert {a.name for a in study.arms} == set(study.tune.space)
    gpu = load_study(EXPERIMENTS / "tune_lr_100m.yaml")
    assert gpu.tune is not None and gpu.tune.seed not in gpu.seeds
    assert gpu.base["model"]["preset"] == "100m" and {a.name for a in gpu.arms} == {a.name for a in study.arms}
