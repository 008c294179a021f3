"""Coverage of the task readout's intervals by simulation (issue 34): the two-way interval (`results.tasks.two_way`)
covers at 93-97% when both seeds and items vary, and the item-only interval (what one model's stderr gives)
does not.

The model: 0/1 correctness. Item i has easiness u_i ~ U(0.2, 0.6) and a treatment gain g_i ~ U(-0.1, 0.3); a
seed shifts each arm's models by its own a_s, b_s ~ U(-0.1, 0.1). The control answers item i with probability
u_i + a_s, the treatment with u_i + g_i + b_s, so the true delta over seeds and items is E[g] = 0.1 exactly.
The seed component's variance, Var(b - a) = 0.0067, is about the item component's per item at S = 3,
N = 200. 2,000 draws per case: the binomial SE at 95% is 0.49%, so 93-97% is four SEs either side.
"""

import numpy as np
import pytest

from reslab.results.tasks import item_only, two_way

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("error")]

DRAWS = 2_000
TRUTH = 0.1


def draw(rng, seeds, items):
    """One study's paired table [seeds, items] of treatment - control correctness."""
    easy = rng.uniform(0.2, 0.6, items)
    gain = rng.uniform(-0.1, 0.3, items)
    a, b = rng.uniform(-0.1, 0.1, (2, seeds, 1))
    control = rng.random((seeds, items)) < easy + a
    treatment = rng.random((seeds, items)) < easy + gain + b
    return treatment.astype(float) - control


def covers(low, high):
    return low <= TRUTH <= high


@pytest.mark.parametrize(("seeds", "items"), [(3, 200), (5, 500), (10, 150)])
def test_two_way_covers_and_item_only_does_not(seeds, items):
    rng = np.random.default_rng(seeds * 1000 + items)
    two, one = 0, 0
    for _ in range(DRAWS):
        table = draw(rng, seeds, items)
        tw = two_way(table)
        two += covers(tw.ci_low, tw.ci_high)
        _, _, low, high = item_only(table)
        one += covers(low, high)
    assert 0.93 <= two / DRAWS <= 0.97
    assert one / DRAWS < 0.85


def test_suite_average_covers():
    """Three tasks sharing the seeds (the seed shifts are common to every task), items of their own."""
    rng = np.random.default_rng(7)
    hits = 0
    for _ in range(DRAWS):
        a, b = rng.uniform(-0.1, 0.1, (2, 4, 1))
        tables = []
        for n in (80, 150, 300):
            easy, gain = rng.uniform(0.2, 0.6, n), rng.uniform(-0.1, 0.3, n)
            tables.append((rng.random((4, n)) < easy + gain + b).astype(float) - (rng.random((4, n)) < easy + a))
        tw = two_way(tables)
        hits += covers(tw.ci_low, tw.ci_high)
    assert 0.93 <= hits / DRAWS <= 0.97
