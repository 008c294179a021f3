"""A study's `evals:` block: the downstream tasks every finished run is evaluated on (lm-evaluation-harness).

    evals:
      tasks: [reslab_next_line]      # harness task (or group) names; reslab_next_line is the local task built
                                     # from the corpus's validation split (models.evals.next_line)
      num_fewshot: 0                 # optional: the harness's default per task when absent
      limit: 500                     # optional: the first N items of each task (all when absent)
      at: final                      # the run's final checkpoint (the only one a run keeps)

An evaluation is one (run, task, settings) and has its own content id (`eval_id`): the run id, the task, the
settings, the harness's version and the hash of a local task's data, so a new harness, other settings or
other task data evaluate again and nothing else does.
The task names are checked against the harness's registry (and each data set's availability offline) by
`models.evals.harness.check_tasks` before anything trains; here only the block's shape is checked.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Annotated, Any

from reslab.models.config import ConfigError, load, shown
from reslab.models.typed_load import Rule, missing

EVAL_KEYS = ("tasks", "num_fewshot", "limit", "at")
AT = ("final",)
TASKS_ALLOWED = "a non-empty list of task names (e.g. [reslab_next_line] or [hellaswag, arc_easy])"
TASKS = "{got} is not allowed; allowed: " + TASKS_ALLOWED


def count_allowed(least: int) -> str:
    return f"{{got}} is not allowed; allowed: an integer >= {least}, or leave it out"


@dataclass(frozen=True, kw_only=True)
class EvalSpec:
    """What every finished run of the study is evaluated on (module docstring)."""

    tasks: Annotated[tuple[str, ...], Rule(nonempty=True, one_or_list=True, message=TASKS)] \
        = field(metadata=missing(f"allowed: {TASKS_ALLOWED}"))
    num_fewshot: Annotated[int | None, Rule(low=0, message=count_allowed(0))] = None
    limit: Annotated[int | None, Rule(low=1, message=count_allowed(1))] = None
    at: Annotated[str, Rule(choices=AT, message="{got} is not allowed; allowed: final (a run keeps only its last "
                                                "checkpoint, so there is no earlier one to evaluate)")] = "final"

    def settings(self) -> dict[str, Any]:
        return {"num_fewshot": self.num_fewshot, "limit": self.limit, "at": self.at}


def check_evals(spec: EvalSpec) -> EvalSpec:
    """What the `evals:` block's fields (loaded by `models.config.load`) cannot say alone: each task named once,
    and a name, not blanks."""
    if not all(t.strip() for t in spec.tasks):
        raise ConfigError(f"evals.tasks: {shown(list(spec.tasks))} is not allowed; allowed: {TASKS_ALLOWED}")
    if len(set(spec.tasks)) != len(spec.tasks):
        raise ConfigError(f"evals.tasks: {shown(list(spec.tasks))} names a task twice; allowed: each task once")
    return spec


def parse_evals(raw: Any) -> EvalSpec:
    """The `evals:` mapping (a study's, or the `reslab evals` flags'), every error one line naming the field."""
    if not isinstance(raw, dict):
        raise ConfigError(f"evals: expected a mapping with keys {', '.join(EVAL_KEYS)}, got {shown(raw)}")
    return check_evals(load(EvalSpec, raw, "evals"))


def eval_id(run_id: str, task: str, spec: EvalSpec, harness: str, data: str | None = None) -> str:
    """The content id of one evaluation: the run, the task, the settings, the harness's version and, for a task
    read from local files, their hash (`data`, `models.evals.task_files`): a damaged file's items never stand in
    for the intact file's. A task of a hub data set (`data` None) keeps the id it had without it."""
    content = {"run": run_id, "task": task, "settings": spec.settings(), "harness": harness}
    text = json.dumps(content if data is None else {**content, "data": data}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]
