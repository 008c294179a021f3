"""Checks a command makes before it submits anything, beside `loop.preflight`'s (issue 52, item 6): what an
evaluation reads (its tasks, the local next-line task's cached items, the device `--device` names), so that a
name, a file or a device that cannot work is one line at once, not a failed evaluation after every run trained.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import TYPE_CHECKING

from reslab.common.errors import ConfigError
from reslab.experiments.evals import EvalSpec
from reslab.experiments.expand import RunSpec

if TYPE_CHECKING:
    from reslab.experiments.budget import RunBudget
    from reslab.experiments.spec import Study


def check_study(study: Study, allow_underpowered: bool = False) -> tuple[list[RunSpec], list[tuple[RunBudget, int]]]:
    """The checks `reslab validate` makes (those `run` makes before it starts anything, but the devices and the
    corpus being prepared): budgets, power, the evaluations' tasks and data. Returns the runs at the first seed
    and the budgets counted over every seed.

    Every check is per (arm, grid point): a seed sets train.seed alone, the same in every arm (a data seed left
    to follow it stays null in the config), so two arms' configs coincide at one seed exactly when they do at
    all. The first seed's runs carry every check and the others are counted, not built: a 10^6-run study
    validates in seconds (bench/bench_validate.py)."""
    from reslab.experiments import expand
    from reslab.experiments.budget import check_budget, study_budget
    from reslab.orchestrator.driving.submit import check_power

    runs = expand(study, study.seeds[:1])
    per_seed = len(study.seeds)
    budgets = [(b, n * per_seed) for b, n in study_budget(runs)]
    check_budget(budgets, require_prepared=False)
    check_power(study, allow_underpowered)  # what `run` would refuse, refused here too
    if study.evals is not None:  # task names and their data, as `run` checks them
        check_eval_inputs(study.evals, runs)
    return runs, budgets


def check_eval_inputs(spec: EvalSpec, runs: Iterable[RunSpec]) -> None:
    """The tasks exist and their data reads here (`evaluations.check_evals`), and the next-line items the cache
    holds for the runs' corpora are whole (`models.evals.task_files.check_next_line_items`)."""
    from reslab.models.data.prepare import corpus_dir
    from reslab.models.evals.next_line import TASK_NAME
    from reslab.models.evals.task_files import check_next_line_items
    from reslab.orchestrator.driving.evaluations import check_evals

    check_evals(spec)
    if TASK_NAME in spec.tasks:
        data = {repr(r.config.data): r.config.data for r in runs}
        check_next_line_items(corpus_dir(d) for d in data.values())


def check_eval_device(device: str | None, address: str | None) -> None:
    """`--device` of `reslab eval`: a device name (`train.device`'s form), which a local instance (no address,
    nor `RAY_ADDRESS`) must have; a cluster's workers check their own."""
    if device is None:
        return
    from reslab.models.config import DEVICE_RE
    from reslab.models.training import pick_device

    address = address or os.environ.get("RAY_ADDRESS")
    try:
        if address in (None, "local"):
            pick_device(device)
        elif DEVICE_RE.match(device) is None:
            raise ConfigError(f"train.device: {device!r} is not a device; allowed: auto, cpu, mps, cuda, cuda:N")
    except ConfigError as exc:
        raise ConfigError(str(exc).replace("train.device", "--device", 1)) from None


__all__ = ["check_eval_device", "check_eval_inputs"]
