"""The study schema before and after its move to dataclasses: every study input the suite and the shipped
studies feed the loader gives the same validated study, the same run ids and the same one-line error as the
hand-written parsers did (`spec_snapshot.json`, recorded on commit 7652683 by `spec_snapshot.py`)."""

from __future__ import annotations

import hashlib
import json

import pytest

from tests.experiments.spec_snapshot import SNAPSHOT, outcome

CASES = json.loads(SNAPSHOT.read_text())


def case_id(case: dict) -> str:
    key = json.dumps({k: case[k] for k in ("data", "overrides", "max_runs", "stem")}, sort_keys=True)
    return case.get("shipped") or hashlib.sha256(key.encode()).hexdigest()[:10]


# case id -> (the error the typed loader gives instead, why it differs); every other case is unchanged
CHANGED: dict[str, tuple[str, str]] = {
    "b85799aa7f": ("tune: unknown key(s) 'budget'; allowed: trials, seed, objective, sampler, pruner, space, arms",
                   "tune: is read by the one loader, which names unknown keys as every section does (was "
                   "\"unknown key(s) ['budget']\", a Python list)"),
}


def test_the_snapshot_covers_every_shipped_study_and_every_kind_of_error():
    from tests.experiments.spec_snapshot import ROOT

    shipped = {c["shipped"] for c in CASES if "shipped" in c}
    assert shipped == {p.name for p in (ROOT / "experiments").glob("*.yaml")}
    errors = [c["outcome"]["error"] for c in CASES if "error" in c["outcome"]]
    assert len(errors) > 150
    for section in ("resources", "limits", "comparisons[0]", "contrasts[0]", "seeds", "grid", "ladder", "evals",
                    "interventions", "tune", "arms", "costs", "mechanisms", "description", "study", "base"):
        assert any(e.startswith(section) for e in errors), section


# a study of 10^6 runs takes a minute to expand: the slow tier checks it
SLOW_RUNS = 100_000


@pytest.mark.parametrize("case", [pytest.param(c, id=case_id(c), marks=[pytest.mark.slow] * (
    c["outcome"].get("runs", 0) > SLOW_RUNS)) for c in CASES])
def test_the_loader_gives_what_it_gave_before(case):
    got = outcome(case)
    want = case["outcome"]
    if case_id(case) in CHANGED:
        message, why = CHANGED[case_id(case)]
        assert "error" in want and why
        want = {"error": message}
    assert got == want
