"""A search's side of a run, in the worker: report each eval to the run's trial and stop the run
when the trial's pruner says so. Also how the search's own storage is opened (a journal file or a
database URL), which the driver (`orchestrator.driving.tune`) and the worker share.

The worker imports this module, never the driver's search: `RunTask.trial` is a `TrialLink`
(plain data), and `PruningHook` is the `on_step` callback it builds from it. A pruned run raises
`StopRun` there (`train` checkpoints it first) and the hook records that it pruned, so the worker
reports `RunState.PRUNED` as a value.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from reslab.common.errors import ReslabError

PRUNED_REASON = "pruned by the tune pruner"


def optuna_module() -> Any:
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return optuna


class TuneStorageError(ReslabError, RuntimeError):
    """The search's storage cannot be opened (a database that does not answer, an unwritable path)."""


def open_search_storage(url: str) -> Any:
    """The Optuna storage of a search: an RDB URL (`<dialect>://...`) or a journal file path."""
    optuna = optuna_module()
    try:
        if "://" in url:
            return optuna.storages.RDBStorage(url)
        from optuna.storages.journal import JournalFileBackend

        Path(url).parent.mkdir(parents=True, exist_ok=True)
        return optuna.storages.JournalStorage(JournalFileBackend(url))
    except Exception as exc:  # sqlalchemy and OS errors arrive in many types
        first = str(exc).splitlines()[0] if str(exc) else ""
        raise TuneStorageError(f"--tune-storage {url}: cannot open the search's storage ({type(exc).__name__}: "
                               f"{first}); give a writable journal file path or a reachable database URL") from None


def make_pruner(name: str, options: dict[str, Any], steps: int) -> Any:
    pruners = optuna_module().pruners
    if name == "median":
        return pruners.MedianPruner(**options)
    if name == "successive_halving":
        return pruners.SuccessiveHalvingPruner(**options)
    if name == "hyperband":
        return pruners.HyperbandPruner(**{"max_resource": steps, **options})
    return pruners.NopPruner()


@dataclass(frozen=True, kw_only=True)
class TrialLink:
    """What a worker needs to report to its trial and ask the pruner; plain picklable data."""

    search_storage: str  # the search's Optuna storage URL (`open_search_storage`), not run storage
    study: str
    number: int
    metric: str
    pruner: str
    pruner_options: dict[str, Any]
    steps: int


class PruningHook:
    """The worker's `on_step`: after each eval, report the objective to the trial and stop the run
    (`StopRun`) when the pruner says so; `pruned` then says so to the worker. Runs in the worker."""

    def __init__(self, link: TrialLink, recorder: Any, log: Callable[[str], None]) -> None:
        optuna = optuna_module()
        storage = open_search_storage(link.search_storage)
        study = optuna.load_study(study_name=link.study, storage=storage,
                                  pruner=make_pruner(link.pruner, link.pruner_options, link.steps))
        study_id = storage.get_study_id_from_name(link.study)
        self.trial = optuna.trial.Trial(study, storage.get_trial_id_from_study_id_trial_number(study_id, link.number))
        self.link, self.recorder, self.log = link, recorder, log
        self.reported: set[int] = set()
        self.pruned = False

    def __call__(self, done: int) -> None:
        from reslab.models.training import StopRun

        last = self.recorder.last_eval
        if last is None or last[0] != done or done in self.reported or done >= self.link.steps:
            return
        self.reported.add(done)
        value = last[1].get(self.link.metric)
        if value is None:
            return
        self.trial.report(float(value), done)
        if self.trial.should_prune():
            self.log(f"trial {self.link.number} of {self.link.study}: pruned at step {done} "
                     f"({self.link.metric} {value:.4f})")
            self.pruned = True
            raise StopRun(done, PRUNED_REASON)


__all__ = ["PRUNED_REASON", "PruningHook", "TrialLink", "TuneStorageError", "make_pruner", "open_search_storage",
           "optuna_module"]
