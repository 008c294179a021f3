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
UNKNOWN = "the one loader names unknown keys as every section does: the mapping's path, the keys in file order"
FALSY = "a falsy value that is not a mapping or list was read as the section left out; the field's type refuses it"
MISSING = "a required field left out (or a control written as null) says `missing` and what to give"
CHANGED: dict[str, tuple[str, str]] = {
    "b85799aa7f": ("tune: unknown key(s) 'budget'; allowed: trials, seed, objective, sampler, pruner, space, arms",
                   UNKNOWN + " (was \"unknown key(s) ['budget']\", a Python list)"),
    "553e5c8fab": ("tune.sampler: unknown key(s) 'x'; allowed: name, seed", UNKNOWN + " (was a Python list)"),
    "00a38e0429": ("tune.objective: unknown key(s) 'foo'; allowed: metric, direction",
                   UNKNOWN + " (was: expected a metric name or {metric, direction}, got {...})"),
    "79aaeb6c53": ("evals: unknown key(s) 'shots', 'x'; allowed: tasks, num_fewshot, limit, at",
                   UNKNOWN + " (was `evals.shots: unknown key`, the first one only)"),
    "73e2498970": ("base.train: unknown key(s) 'stepz' (did you mean 'steps'?), 'evl'; allowed: steps, seed, "
                   "data_seed, eval_every, eval_windows, eval_batch_size, tail_k, log_every, checkpoint_every, device, "
                   "dtype, compile, diagnostics, magnitudes, deff_passages, deff_cka, init_from, divergence, "
                   "data_offset", UNKNOWN + " (was sorted)"),
    "b7955dca09": ("base: expected a run config mapping (model, residual, data, optim, train), got 0", FALSY),
    "e5c286bdb2": ("base: expected a run config mapping (model, residual, data, optim, train), got []", FALSY),
    "18b7bd8156": ("comparisons: expected a list of comparisons, got {}", FALSY),
    "922209e759": ("contrasts: expected a list of contrasts, got {}", FALSY),
    "1156355ebf": ("evals.tasks: missing; allowed: a non-empty list of task names (e.g. [reslab_next_line] or "
                   "[hellaswag, arc_easy])", MISSING + " (was `None is not allowed`)"),
    "c3a932dfde": ("tune.sampler.name: missing; allowed: tpe, cmaes, random, grid", MISSING),
    "e6efe5093c": ("tune.trials: missing; expected trials per arm, an integer from 1 to 10000", MISSING),
    "d78bb5c244": ("tune.seed: missing; expected one integer tuning seed from 0 to 2**63-1", MISSING),
    "963eb26a39": ("comparisons[0].control: missing; name the control arm (one of control, attnres)",
                   MISSING + " (was `None is not an arm`)"),
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
    assert "\n" not in got.get("error", "")
    want = case["outcome"]
    if case_id(case) in CHANGED:
        message, why = CHANGED[case_id(case)]
        assert why
        want = {"error": message}
    assert got == want
