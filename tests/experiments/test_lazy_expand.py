"""The lazy expansion (`expand.iter_runs`, issue 39): the same runs as resolving every (arm, grid point, seed)
from scratch, and `count_runs` without building one."""

from __future__ import annotations

import itertools
import tracemalloc
from pathlib import Path

import pytest

from reslab.experiments import load_study
from reslab.experiments.expand import SeedIds, count_runs, iter_runs, resolve_config, run_id_of
from reslab.experiments.spec import SpecError

SHIPPED = Path(__file__).parents[2] / "experiments"

BIG = """
study: big
base:
  model: {{preset: tiny}}
  train: {{steps: 20}}
arms:
  control: prenorm
  attnres: {{residual: attnres}}
seeds: {seeds}
limits: {{max_runs: 1000000}}
grid:
  optim.lr: [{lrs}]
  train.eval_every: [5, 10]
comparisons:
  - {{control: control, exploratory: true}}
"""


def _big(tmp_path: Path, seeds: int, lrs: int) -> Path:
    path = tmp_path / "big.yaml"
    path.write_text(BIG.format(seeds=seeds, lrs=", ".join(f"{1e-4 * (i + 1):.4g}" for i in range(lrs))))
    return path


def _brute_force(study):
    """Every run resolved from its own merged config (what `expand` did before it was lazy): the reference."""
    for seed in study.seeds:
        for point in study.grid_points():
            for arm in study.arms:
                cfg = resolve_config(study.config_dict(arm, point, seed), f"arms.{arm.name}")
                yield arm.name, point, seed, cfg, run_id_of(cfg, arm.name)


@pytest.mark.parametrize("name", ["quickstart", "scaling_ladder_cpu", "head_sweep", "attnres_vs_prenorm"])
def test_lazy_runs_are_the_brute_force_runs_of_shipped_studies(name):
    study = load_study(SHIPPED / f"{name}.yaml")
    got = [(r.arm, r.grid, r.seed, r.config, r.run_id) for r in iter_runs(study)]
    assert got == list(_brute_force(study))
    assert count_runs(study) == len(got)


def test_lazy_runs_past_the_point_cache_are_the_same(tmp_path):
    """A grid larger than the configs kept between seeds is resolved again per seed: the same runs."""
    study = load_study(_big(tmp_path, seeds=3, lrs=4))
    want = [(r.arm, r.grid, r.seed, r.config, r.run_id) for r in iter_runs(study)]
    assert want == list(_brute_force(study))
    assert [(r.arm, r.grid, r.seed, r.config, r.run_id) for r in iter_runs(study, cache_points=3)] == want


def test_seed_ids_are_run_id_of_the_config_at_each_seed():
    """`SeedIds` against `run_id_of` of the config resolved from scratch at each seed (the reference)."""
    study = load_study(SHIPPED / "quickstart.yaml")
    for arm in study.arms:
        ids = SeedIds(resolve_config(study.config_dict(arm, (), 0), "x"), arm.name)
        for seed in (0, 1, 9, 10, 123456789):
            assert ids(seed) == run_id_of(resolve_config(study.config_dict(arm, (), seed), "x"), arm.name)


def test_a_million_runs_are_counted_and_iterated_without_being_held(tmp_path):
    """10^6 runs (2 arms x 20 grid points x 25,000 seeds): counted without building one, and the first 2,000
    iterated in bounded memory (tracemalloc: the configs of one seed, not of the study)."""
    study = load_study(_big(tmp_path, seeds=25_000, lrs=10))
    assert count_runs(study) == 1_000_000
    tracemalloc.start()
    first = list(itertools.islice(iter_runs(study), 2_000))
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert [r.seed for r in first[:40]] == [0] * 40 and first[40].seed == 1
    assert peak < 50 * 2**20, peak


def test_two_arms_resolving_to_one_config_are_refused_lazily(tmp_path):
    path = tmp_path / "dup.yaml"
    path.write_text(BIG.format(seeds=2, lrs=2).replace("attnres: {residual: attnres}", "again: prenorm"))
    with pytest.raises(SpecError, match="arms.again: resolves to the same config as arms.control"):
        next(itertools.islice(iter_runs(load_study(path)), 1, None))
