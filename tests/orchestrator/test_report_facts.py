"""The report's "what was run" covers every grid point and arm, not the first run's config."""

from __future__ import annotations

from orch_helpers import write_study

from reslab.experiments import expand, load_study
from reslab.orchestrator.gathering.gather import study_facts

# Two grid axes (d_model x steps) and an arm with its own batch size: sizes and token counts differ.
STUDY = """
study: facts
base:
  model: {preset: tiny, seq_len: 32}
  optim: {batch_size: 4, warmup_steps: 2, lr: 3.0e-3}
  train: {steps: 6, eval_every: 3}
arms:
  control: prenorm
  attnres: {residual: attnres, optim: {batch_size: 8}}
seeds: 2
grid:
  model.d_model: [32, 64]
  train.steps: [6, 12]
comparisons:
  - {name: main, control: control, treatments: [attnres], exploratory: true}
"""


def test_facts_name_every_grid_point_and_arm_where_they_differ(tmp_path):
    study = load_study(write_study(tmp_path, text=STUDY))
    runs = expand(study)
    facts = dict(study_facts(study, runs))
    assert facts["grid"] == "model.d_model = 32, 64; train.steps = 6, 12"
    model = facts["model"]
    points_32 = sorted(r.grid_key for r in runs if "model.d_model=32" in r.grid_key)
    assert len(set(points_32)) == 2, points_32  # the grid key format this test relies on
    for d_model in (32, 64):
        value = f"tiny: d_model {d_model}, 4 layers, 4 heads, seq_len 32"  # the tiny preset's layers and heads
        assert value in model, model
        points = sorted({r.grid_key for r in runs if f"model.d_model={d_model}" in r.grid_key})
        assert f"{value} [{', '.join(points)}]" in model, model
    # tokens per run = steps x batch x grad_accum (1) x seq_len, by hand: each arm at each steps value
    tokens = facts["tokens per run"]
    for arm, batch in (("control", 4), ("attnres", 8)):
        for steps in (6, 12):
            points = sorted({r.grid_key for r in runs if r.arm == arm and r.config.train.steps == steps})
            where = ", ".join(f"{arm} at {p}" for p in points)
            assert f"{steps * batch * 32:,} ({steps} steps) [{where}]" in tokens, tokens
    assert facts["corpus"].count("[") == 0  # one corpus for every run: stated once


def test_a_fact_every_run_shares_is_stated_once(tmp_path):
    study = load_study(write_study(tmp_path))
    facts = dict(study_facts(study, expand(study)))
    assert facts["model"] == "tiny: d_model 32, 2 layers, 2 heads, seq_len 32"
    assert facts["tokens per run"] == f"{6 * 4 * 32:,} (6 steps)"


def test_a_sequential_study_names_the_seeds_it_ran_not_its_whole_design(tmp_path):
    text = STUDY.replace("seeds: 2", "seeds: {sequential: {start: 4, batch: 2, max: 10}}").replace(
        "exploratory: true", "mei: 0.02")
    study = load_study(write_study(tmp_path, text=text))
    facts = dict(study_facts(study, expand(study), finished_seeds=[0, 1, 2, 3, 5, 4, 4]))
    assert facts["seeds"] == "sequential: 4, +2 per look, at most 10; 6 run (0, 1, 2, 3, 4, 5)"
