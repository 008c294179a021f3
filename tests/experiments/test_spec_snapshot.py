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


# case id -> why its recorded outcome was taken again after 7652683: an item of the same round that changes what a
# study reads as, on purpose (the loader's own changes are `CHANGED`, above); `spec_snapshot.json` holds the new one
SEQUENTIAL = "issue 51 item 2: the default sequential test is `flip` (a study's `sequential.test`, the allowed list)"
METRICS = "issue 51 item 6: the metric registry gains `decode_step_bytes` (the allowed lists name it)"
OPTIM_FIELDS = "issue 50 item 5: the optimizer and schedule knobs moved under `optim.options` / `schedule_options`"
ARMS = "issue 52 item 16: an error every arm shares is said once, naming the arms"
OPTIMIZERS = "issue 50 item 5: the optimizer registry names every optimizer a pipeline allows (Adafactor)"
EXTERNAL = "issue 53 item 1: a variant may come from an entry point or a path (the unknown-variant error says so)"
IMPLS = "issue 53 item 3: `residual.impl` allows the field's kernels (fla, liger, flash_attn_res)"
GATES = "issue 54 item 1: the study file gains `gates:` (the top level's allowed keys name it)"
RERECORDED: dict[str, str] = {
    "968e814ce7": EXTERNAL,
    "78aee5a7e2": EXTERNAL,
    "d18f9a0473": EXTERNAL,
    "b5525d63c5": SEQUENTIAL,
    "7cf205776b": SEQUENTIAL,
    "1e7e548ef6": SEQUENTIAL,
    "663319e2c4": SEQUENTIAL,
    "ddl_beta_init_sequential.yaml": SEQUENTIAL,
    "9ed1d049c1": METRICS,
    "4506afb524": METRICS,
    "52e6181811": METRICS,
    "2a06a990b8": METRICS,
    "bc32f3e416": METRICS,
    "82926581db": METRICS,
    "c69db555a3": METRICS,
    "c28981de6d": METRICS,
    "06027db9cb": METRICS,
    "2ad1ed1a38": METRICS,
    "6de22b2019": METRICS,
    "3fb694c369": METRICS,
    "c9be25c525": OPTIM_FIELDS,
    "f9d9f9d888": OPTIM_FIELDS,
    "3d7e6c7ab4": OPTIM_FIELDS,
    "90d4940967": OPTIM_FIELDS,
    "ada41fb2ea": ARMS,
    "7359703337": ARMS,
    "46945cc570": ARMS,
    "e236b63b79": ARMS,
    "ecb9209d1e": ARMS,
    "6c551ddc2c": ARMS,
    "25742a5892": ARMS,
    "fa1224fd28": ARMS,
    "delta_from_pretrained.yaml": ARMS,
    "7ef9b5d3ef": OPTIMIZERS,
    "6d74b07d80": IMPLS,
    "9df2a06039": GATES,
    "1d6bd7fa3a": GATES,
    "afbdbd374b": GATES,
    "8c96453da9": GATES,
    "fc8c87de1a": GATES,
    "cc9fd5a526": GATES,
    "6b637e462a": GATES,
}


def test_every_rerecorded_case_is_in_the_snapshot_and_says_why():
    ids = {case_id(c) for c in CASES}
    assert set(RERECORDED) <= ids and all(RERECORDED.values())
    assert not set(RERECORDED) & set(CHANGED)


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
