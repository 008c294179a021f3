"""`reslab power` for downstream tasks (`results.power.two_way_power`, `task_power`): the power of the task
rows' two-way test, cross-checked against simulated studies analysed with `results.tasks.two_way` itself: crossed
normal components, and 0/1 items whose seeds shift the treatment's accuracy (the accuracy model the CLI uses,
items' share 0). The seeds and items it reports are the fewest whose power reaches the target."""

import math

import numpy as np
import pytest

from reslab.common.errors import ConfigError
from reslab.results.power import TaskVariance, task_power, two_way_power
from reslab.results.tasks import two_way

REPS = 1500


def simulated_power(draw, level, reps=REPS):
    """Share of `reps` simulated [S, N] paired tables whose two-way p is at or below `level`, and its MC SE."""
    rng = np.random.default_rng(7)
    hits = np.mean([two_way(draw(rng)).p <= level for _ in range(reps)])
    return hits, math.sqrt(hits * (1 - hits) / reps)


@pytest.mark.parametrize(("gain", "sds", "seeds", "items"), [
    (0.03, (0.02, 0.15, 0.5), 4, 200),
    (0.02, (0.01, 0.05, 0.6), 6, 400),
    (0.05, (0.04, 0.10, 0.4), 3, 100),
])
def test_power_matches_simulated_studies_with_every_component(gain, sds, seeds, items):
    variance = TaskVariance(*sds)

    def draw(rng):
        a = rng.normal(0, sds[0], (seeds, 1))
        b = rng.normal(0, sds[1], (1, items))
        return gain + a + b + rng.normal(0, sds[2], (seeds, items))

    hits, se = simulated_power(draw, 0.05)
    assert 0.1 < hits < 0.95  # a config that discriminates
    assert two_way_power(gain, variance, seeds, items, 0.05) == pytest.approx(hits, abs=3 * se + 0.03)


def test_power_matches_simulated_accuracy_items():
    """0/1 items: control correct with p, treatment with p + gain + a_s (a seed's own shift), independently per
    item: the accuracy model of `TaskVariance.of_accuracy` with item share 0."""
    p, gain, seed_sd, seeds, items = 0.4, 0.04, 0.015, 4, 500
    variance = TaskVariance.of_accuracy(gain, seed_sd, p, item_share=0.0)

    def draw(rng):
        shift = rng.normal(0, seed_sd, (seeds, 1))
        control = rng.random((seeds, items)) < p
        treated = rng.random((seeds, items)) < p + gain + shift
        return treated.astype(float) - control.astype(float)

    hits, se = simulated_power(draw, 0.05)
    assert 0.2 < hits < 0.95
    assert two_way_power(gain, variance, seeds, items, 0.05) == pytest.approx(hits, abs=3 * se + 0.03)


def test_the_null_rejects_at_the_level():
    variance = TaskVariance(0.02, 0.1, 0.5)
    assert two_way_power(0.0, variance, 5, 300, 0.05) == pytest.approx(0.05, abs=1e-9)


def test_sizing_is_the_fewest_seeds_and_items_reaching_the_target():
    gain, seeds, items = 0.04, 4, 1000
    variance = TaskVariance.of_accuracy(gain, 0.01, 0.5, item_share=0.02)
    row = task_power("t", gain, variance, seeds, items, 0.05)
    assert row.power_now == pytest.approx(two_way_power(gain, variance, seeds, items, 0.05)) and row.power_now < 0.8
    for n, target in ((row.seeds_80, 0.8), (row.seeds_90, 0.9)):
        assert n is not None and two_way_power(gain, variance, n, items, 0.05) >= target
        assert two_way_power(gain, variance, n - 1, items, 0.05) < target
    for n, target in ((row.items_80, 0.8), (row.items_90, 0.9)):
        assert n is not None and two_way_power(gain, variance, seeds, n, 0.05) >= target
        assert two_way_power(gain, variance, seeds, n - 1, 0.05) < target
    assert row.seeds_80 <= row.seeds_90 and row.items_80 <= row.items_90


def test_seed_noise_no_item_count_overcomes():
    """With 2 seeds the seeds' part alone (SD 0.05 / sqrt 2 against a gain of 0.02) keeps the power below 80%
    whatever the items: the row says so (None), and more seeds do reach it."""
    variance = TaskVariance.of_accuracy(0.02, 0.05, 0.5, item_share=0.0)
    row = task_power("t", 0.02, variance, 2, 1000, 0.05)
    assert row.items_80 is None and row.seeds_80 is not None and row.seeds_80 > 2


def test_bad_accuracy_is_one_line():
    with pytest.raises(ConfigError, match="both accuracies in"):
        TaskVariance.of_accuracy(0.1, 0.01, 0.95, 0.5)
