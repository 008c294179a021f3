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
from dataclasses import dataclass
from typing import Any

from reslab.models.config import ConfigError, shown

EVAL_KEYS = ("tasks", "num_fewshot", "limit", "at")
AT = ("final",)


@dataclass(frozen=True, kw_only=True)
class EvalSpec:
    """What every finished run of the study is evaluated on (module docstring)."""

    tasks: tuple[str, ...]
    num_fewshot: int | None = None
    limit: int | None = None
    at: str = "final"

    def settings(self) -> dict[str, Any]:
        return {"num_fewshot": self.num_fewshot, "limit": self.limit, "at": self.at}


def _count(value: Any, where: str, least: int) -> int | None:
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < least:
        raise ConfigError(f"{where}: {shown(value)} is not allowed; allowed: an integer >= {least}, or leave it out")
    return value


def parse_evals(raw: Any) -> EvalSpec:
    """The `evals:` mapping, every error one line naming the field."""
    if not isinstance(raw, dict):
        raise ConfigError(f"evals: expected a mapping with keys {', '.join(EVAL_KEYS)}, got {shown(raw)}")
    unknown = [k for k in raw if k not in EVAL_KEYS]
    if unknown:
        raise ConfigError(f"evals.{unknown[0]}: unknown key; allowed: {', '.join(EVAL_KEYS)}")
    tasks = raw.get("tasks")
    if isinstance(tasks, str):
        tasks = [tasks]
    if not isinstance(tasks, list) or not tasks or not all(isinstance(t, str) and t.strip() for t in tasks):
        raise ConfigError(f"evals.tasks: {shown(tasks)} is not allowed; allowed: a non-empty list of task names "
                          "(e.g. [reslab_next_line] or [hellaswag, arc_easy])")
    if len(set(tasks)) != len(tasks):
        raise ConfigError(f"evals.tasks: {shown(tasks)} names a task twice; allowed: each task once")
    at = raw.get("at", "final")
    if at not in AT:
        raise ConfigError(f"evals.at: {shown(at)} is not allowed; allowed: final (a run keeps only its last "
                          "checkpoint, so there is no earlier one to evaluate)")
    return EvalSpec(tasks=tuple(tasks), num_fewshot=_count(raw.get("num_fewshot"), "evals.num_fewshot", 0),
                    limit=_count(raw.get("limit"), "evals.limit", 1), at=at)


def eval_id(run_id: str, task: str, spec: EvalSpec, harness: str, data: str | None = None) -> str:
    """The content id of one evaluation: the run, the task, the settings, the harness's version and, for a task
    read from local files, their hash (`data`, `models.evals.task_files`): a damaged file's items never stand in
    for the intact file's. A task of a hub data set (`data` None) keeps the id it had without it."""
    content = {"run": run_id, "task": task, "settings": spec.settings(), "harness": harness}
    text = json.dumps(content if data is None else {**content, "data": data}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]
