"""The `evals:` block (`experiments.evals`): the shipped studies' blocks load, every mistake is one line naming the
field, and an evaluation's content id moves with the run, the task, the settings and the harness version only."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from reslab.experiments import SpecError, load_study
from reslab.experiments.evals import EvalSpec, eval_id, parse_evals

EXPERIMENTS = Path(__file__).resolve().parents[2] / "experiments"

BASE = """
study: s
base:
  model: {preset: tiny, d_model: 32, seq_len: 32, n_layers: 2}
  train: {steps: 6}
arms:
  control: prenorm
  attnres: {residual: attnres}
seeds: 2
comparisons:
  - control: control
"""


def test_shipped_studies_declare_their_tasks():
    tiny = load_study(EXPERIMENTS / "evals_tiny.yaml")
    assert tiny.evals == EvalSpec(tasks=("reslab_next_line",), limit=400)
    delta = load_study(EXPERIMENTS / "delta_vs_cumulative.yaml").evals
    assert delta is not None and len(delta.tasks) == 8 and delta.num_fewshot == 0
    assert load_study(EXPERIMENTS / "quickstart.yaml").evals is None


def test_the_block_in_a_study(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text(textwrap.dedent(BASE) + "evals: {tasks: [reslab_next_line, hellaswag], num_fewshot: 0}\n")
    assert load_study(path).evals == EvalSpec(tasks=("reslab_next_line", "hellaswag"), num_fewshot=0)
    path.write_text(textwrap.dedent(BASE) + "evals: {tasks: []}\n")
    with pytest.raises(SpecError, match=r"s.yaml: evals.tasks: \[\] is not allowed"):
        load_study(path)


@pytest.mark.parametrize(("raw", "message"), [
    ([1], "evals: expected a mapping"),
    # the one loader's words for an unknown key, as for every section (before: "evals.shots: unknown key; ...")
    ({"tasks": ["a"], "shots": 1}, r"evals: unknown key\(s\) 'shots'; allowed: tasks, num_fewshot, limit, at"),
    ({"tasks": [1]}, "evals.tasks: .* allowed: a non-empty list of task names"),
    ({"tasks": ["a", "a"]}, "names a task twice"),
    ({"tasks": ["a"], "num_fewshot": -1}, "evals.num_fewshot: -1 is not allowed; allowed: an integer >= 0"),
    ({"tasks": ["a"], "limit": 0}, "evals.limit: 0 is not allowed; allowed: an integer >= 1"),
    ({"tasks": ["a"], "limit": True}, "evals.limit: True is not allowed"),
    ({"tasks": ["a"], "at": "every checkpoint"}, "evals.at: .* allowed: final"),
])
def test_bad_blocks_are_one_line(raw, message):
    with pytest.raises(Exception, match=message) as info:
        parse_evals(raw)
    assert "\n" not in str(info.value)


def test_the_content_id_moves_with_what_the_evaluation_is():
    spec = EvalSpec(tasks=("a", "b"), limit=10)
    base = eval_id("run1", "a", spec, "0.4.9")
    assert base == eval_id("run1", "a", EvalSpec(tasks=("a",), limit=10), "0.4.9")  # the other tasks do not count
    assert len({base, eval_id("run2", "a", spec, "0.4.9"), eval_id("run1", "b", spec, "0.4.9"),
                eval_id("run1", "a", EvalSpec(tasks=("a",), limit=11), "0.4.9"),
                eval_id("run1", "a", spec, "0.4.10")}) == 5
