"""A study's `ladder:`: paths zipped into rungs, each rung training every arm on the same seeds,
crossed with the grid; every mistake named with its field path and what is allowed."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from reslab.experiments import SpecError, expand, load_study
from reslab.experiments.spec import LADDER_AXIS
from reslab.orchestrator.cli import main

EXPERIMENTS = Path(__file__).resolve().parents[2] / "experiments"

LADDER = """
study: lad
base:
  model: {preset: tiny, seq_len: 32, n_heads: 2, n_kv_heads: 2}
  optim: {batch_size: 4}
  train: {steps: 6}
arms:
  control: prenorm
  attnres: {residual: attnres}
seeds: 3
ladder:
  model.d_model: [16, 32, 48]
  model.n_layers: [2, 3, 4]
  train.steps: [4, 6, 8]
comparisons:
  - {control: control, exploratory: true}
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "study.yaml"
    path.write_text(textwrap.dedent(text))
    return path


def error_of(tmp_path: Path, text: str) -> str:
    path = write(tmp_path, text)
    with pytest.raises(SpecError) as info:
        expand(load_study(path))
    message = str(info.value)
    assert message.startswith(str(path)) and "\n" not in message, message
    return message


def test_rungs_zip_the_paths_and_every_arm_trains_every_rung_on_the_same_seeds(tmp_path):
    study = load_study(write(tmp_path, LADDER))
    assert study.rungs() == [
        (("model.d_model", 16), ("model.n_layers", 2), ("train.steps", 4)),
        (("model.d_model", 32), ("model.n_layers", 3), ("train.steps", 6)),
        (("model.d_model", 48), ("model.n_layers", 4), ("train.steps", 8)),
    ]
    assert study.grid_sizes() == {LADDER_AXIS: 3}
    runs = expand(study)
    assert len(runs) == 2 * 3 * 3
    for rung in study.rungs():
        at = [r for r in runs if r.grid == rung]
        assert sorted((r.arm, r.seed) for r in at) == sorted((a, s) for a in ("control", "attnres") for s in (0, 1, 2))
        d_model, n_layers, steps = (v for _, v in rung)
        assert all((r.config.model.d_model, r.config.model.n_layers, r.config.train.steps) == (d_model, n_layers, steps)
                   for r in at)
    # seed-paired at each rung: the pair key carries the rung
    assert len({r.pair_key for r in runs}) == 3 * 3


def test_a_ladder_crosses_the_grid_rung_first(tmp_path):
    study = load_study(write(tmp_path, LADDER.replace("seeds: 3", "seeds: 3\ngrid:\n  optim.lr: [0.001, 0.002]")))
    assert study.grid_sizes() == {"optim.lr": 2, LADDER_AXIS: 3}
    assert study.scope_points() == [(("optim.lr", 0.001),), (("optim.lr", 0.002),)]
    points = study.grid_points()
    assert len(points) == 6 and points[1] == (*study.rungs()[0], ("optim.lr", 0.002))
    assert len(expand(study)) == 2 * 6 * 3


@pytest.mark.parametrize("ladder,expect", [
    ("  model.d_model: [16, 32]\n  train.steps: [4, 6, 8]",
     ["ladder: every path lists one value per rung", "model.d_model: 2", "train.steps: 3"]),
    ("  train.steps: [4]", ["ladder: 1 rung", "at least 2 rungs"]),
    ("  model.d_model: [16, 32, 16]\n  train.steps: [4, 6, 4]", ["ladder: rung 2 repeats rung 0"]),
    ("  residual.options.block_size: [1, 2]", ["ladder.residual.options.block_size", "with arms"]),
    ("  train.seed: [1, 2]", ["ladder.train.seed", "seeds come from the study's `seeds:`"]),
    ("  train.stpes: [1, 2]", ["ladder", "unknown field train.stpes", "did you mean 'steps'"]),
    ("  train.steps: 4", ["ladder.train.steps: expected a non-empty list"]),
    ("  {}", ["ladder: expected a mapping of field path -> list of values"]),
])
def test_ladder_mistakes_name_the_field(tmp_path, ladder, expect):
    text = LADDER.split("ladder:\n")[0] + "ladder:\n" + ladder + "\ncomparisons:\n  - {control: control}\n"
    message = error_of(tmp_path, text)
    for part in expect:
        assert part in message, message


def test_a_ladder_path_is_set_in_one_place(tmp_path):
    grid = LADDER.replace("seeds: 3", "seeds: 3\ngrid:\n  train.steps: [10, 20]")
    assert "ladder.train.steps: grid axis 'train.steps' sweeps it too" in error_of(tmp_path, grid)
    arm = LADDER.replace("attnres: {residual: attnres}", "attnres: {residual: attnres, train: {steps: 9}}")
    message = error_of(tmp_path, arm)
    assert "arms.attnres: sets train.steps, which the ladder 'train.steps' also sweeps" in message


def test_the_run_limit_counts_rungs(tmp_path):
    message = error_of(tmp_path, LADDER.replace("seeds: 3", "seeds: 3\nlimits: {max_runs: 17}"))
    assert "ladder: 2 arms x 3 rungs x 1 grid points x 3 seeds = 18 runs, over the limit of 17 runs" in message


def test_a_rung_that_does_not_fit_the_model_is_named(tmp_path):
    message = error_of(tmp_path, LADDER.replace("[16, 32, 48]", "[16, 30, 48]"))
    assert "at grid point model.d_model=30, model.n_layers=3, train.steps=6" in message and "head_dim=15" in message


def test_a_ladder_cannot_be_tuned(tmp_path):
    text = LADDER + "tune:\n  trials: 2\n  seed: 100\n  space: {optim.lr: {type: float, low: 1.0e-4, high: 1.0e-2}}\n"
    assert "tune: a study with grid axes or a ladder cannot be tuned" in error_of(tmp_path, text)


def test_plan_prints_each_rungs_cost_and_validate_names_the_ladder(tmp_path, capsys, monkeypatch):
    spec = write(tmp_path, LADDER)
    assert main(["validate", str(spec)]) == 0
    assert "ladder model.d_model + model.n_layers + train.steps[3 rungs] -> 18 runs" in capsys.readouterr().out
    # on a machine without a GPU the runs train on CPUs: each rung's FLOPs, no GPU-hours
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    assert main(["plan", str(spec), "--workspace", str(tmp_path / "ws")]) == 0
    out = capsys.readouterr().out
    table = out[out.index("\nrung "):out.index("\nplacement:")].strip().splitlines()
    assert table[0].split() == ["rung", "params", "tokens/run", "FLOPs/run", "runs", "FLOPs", "cumulative"]
    assert main(["plan", str(spec), "--workspace", str(tmp_path / "ws"), "--cluster-gpus", "8"]) == 0
    out = capsys.readouterr().out
    table = out[out.index("\nrung "):out.index("\nplacement:")].strip().splitlines()
    assert table[0].split() == ["rung", "params", "tokens/run", "FLOPs/run", "runs", "GPU-h", "cumulative"]
    assert [line.split(":")[0] for line in table[1:]] == ["0", "1", "2"]
    assert "d_model=16, n_layers=2, steps=4" in table[1]
    flops = [float(line.split()[-4].split("-")[-1]) for line in table[1:]]
    assert flops == sorted(flops) and flops[2] > 10 * flops[0]  # bigger and longer: more FLOPs per run
    assert all(line.split()[-3] == "6" for line in table[1:])  # 2 arms x 3 seeds per rung


def test_the_shipped_cpu_ladder_is_a_four_rung_two_arm_study():
    study = load_study(EXPERIMENTS / "scaling_ladder_cpu.yaml")
    runs = expand(study)
    assert len(study.rungs()) == 4 and len(study.arms) == 2 and len(study.seeds) >= 6
    assert {r.config.model.d_model for r in runs} == {32, 48, 64, 80}
