"""`reslab validate` checks a study per (arm, grid point) and counts the seeds instead of building
every run (bench/bench_validate.py times it up to 10^6 runs); what it reports must equal what the
full expansion gives, including the one case where seeds matter to the checks (a pinned data seed)."""

from __future__ import annotations

import textwrap

from reslab.experiments import SpecError, expand, load_study
from reslab.orchestrator.cli import main

STUDY = """
study: many
base:
  model: {preset: tiny, d_model: 32, n_layers: 2, seq_len: 32}
  optim: {batch_size: 4}
  train: {steps: 6}
arms:
  control: prenorm
  attnres: {residual: attnres}
  block: {residual: {name: block_attnres, options: {block_size: 2}}}
seeds: 50
grid:
  optim.lr: [1.0e-3, 2.0e-3]
  train.steps: [6, 8]
comparisons:
  - {control: control, exploratory: true}
"""


def test_validate_counts_what_the_full_expansion_builds(tmp_path, capsys):
    spec = tmp_path / "many.yaml"
    spec.write_text(textwrap.dedent(STUDY))
    study = load_study(spec)
    assert len(expand(study)) == 3 * 4 * 50
    assert main(["validate", str(spec)]) == 0
    assert "3 arms (control, attnres, block), 50 seeds, grid optim.lr[2] x train.steps[2] -> 600 runs" in (
        capsys.readouterr().out)


def test_validate_finds_two_arms_with_one_config_as_the_full_expansion_does(tmp_path, capsys):
    """A pinned data seed equal to the seed is still a different config (null follows the seed), so
    only arms equal in every field but train.seed coincide, and they do at every seed."""
    text = textwrap.dedent(STUDY).replace("  attnres: {residual: attnres}\n", "  twin: {residual: prenorm}\n")
    spec = tmp_path / "twin.yaml"
    spec.write_text(text)
    try:
        expand(load_study(spec))
    except SpecError as exc:
        expected = str(exc)
    else:
        raise AssertionError("the full expansion found no duplicate")
    assert main(["validate", str(spec)]) == 2
    assert "resolves to the same config as arms.control" in expected and expected in capsys.readouterr().err
    pinned = textwrap.dedent(STUDY).replace("  attnres: {residual: attnres}\n",
                                            "  twin: {residual: prenorm, train: {data_seed: 1}}\n")
    spec.write_text(pinned)
    assert len(expand(load_study(spec))) == 600  # data seed 1 at seed 1 is not the control's null
