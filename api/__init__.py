"""reslab from Python: load or build a study, check and plan it, submit it, read its status, table and verdict.

Every function goes through the library code the `reslab` command runs (`validate`, `plan`, `run`, `status`,
`compare`, `verdict`), and raises the `ReslabError` that command would report, with its message. In a notebook:

    import reslab.api as rl

    study = rl.load("experiments/quickstart.yaml", overrides={"train.steps": 50})
    rl.validate(study)                       # a ConfigError naming the field, or None
    print(rl.plan(study).counts.summary())   # "9 runs: 9 to run, 0 to skip, 0 busy elsewhere"
    with rl.ray_session(num_cpus=2):         # one local Ray for every submission in the block
        run = rl.submit(study, workspace="ws")   # waits: the driver runs here, as `reslab run` does
    print(run.status().counts())             # {"succeeded": 9, ...}
    report = run.verdict()                   # per comparison: better / worse / equivalent / undecided ...
    table = rl.compare(study, workspace="ws")    # the paired table, a DataFrame

`submit(..., wait=False)` starts the same driver as a child process (`python -m reslab.orchestrator.cli run` on the
study's file; a built study's written to the workspace's `api/` folder, its output to a log there); the handle
knows its pid and log, and `.wait()` reaps it.

Above the orchestrator in the import direction: it imports every folder, none imports it.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import subprocess
import sys
import time
import weakref
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from reslab.common.errors import ConfigError, ReslabError
from reslab.experiments.spec import Study

if TYPE_CHECKING:
    import argparse

    import pandas as pd

    from reslab.experiments.expand import RunSpec
    from reslab.orchestrator.cli.study import StudyPlan
    from reslab.orchestrator.driving.progress import StudyStatus
    from reslab.orchestrator.durability.workspace import Workspace
    from reslab.orchestrator.gathering.verdicts import VerdictReport

Overrides = Mapping[str, Any] | Sequence[tuple[str, Any]]
PathLike = str | Path

# a built study's YAML text, by the study's id while it lives: what a child process's driver reads
_BUILT: dict[int, str] = {}


def _pairs(overrides: Overrides) -> tuple[tuple[str, Any], ...]:
    return tuple(overrides.items() if isinstance(overrides, Mapping) else overrides)


def load(path: PathLike, overrides: Overrides = ()) -> Study:
    """The study file at `path`, validated as `reslab validate` reads it; `overrides` are `--set` pairs
    ({"train.steps": 50}), applied last to every run. A bad file raises `SpecError` naming the file and field."""
    from reslab.experiments import load_study

    return load_study(path, _pairs(overrides))


def build(mapping: Mapping[str, Any], *, name: str | None = None, overrides: Overrides = ()) -> Study:
    """A study from a mapping with a study file's keys (`study`, `base`, `arms`, `seeds`, `comparisons`, ...),
    validated as a file is: written as YAML and read back, so it holds only what a file can. `name` replaces
    the mapping's `study:`; one of them is required."""
    from reslab.experiments.spec import parse_study

    if not isinstance(mapping, Mapping):
        raise ConfigError(f"top level: expected a mapping of a study file's keys, got {type(mapping).__name__}")
    data = {**mapping, **({"study": name} if name is not None else {})}
    if data.get("study") is None:
        raise ConfigError("study: a study built from a mapping needs a name; set `study:` or pass name=")
    try:
        text = yaml.safe_dump(data, sort_keys=False)
    except yaml.YAMLError as exc:
        raise ConfigError(f"top level: a study holds only what YAML can write (mappings, lists, strings, numbers, "
                          f"booleans, null): {' '.join(str(exc).split())}") from None
    study = parse_study(yaml.safe_load(text), Path(f"{data['study']}.yaml"), _pairs(overrides))
    _BUILT[id(study)] = text
    weakref.finalize(study, _BUILT.pop, id(study), None)
    return study


def validate(study: Study, *, allow_underpowered: bool = False) -> None:
    """The checks `reslab validate` makes (budgets, power, evaluation inputs); raises the first that fails."""
    from reslab.orchestrator.driving.preflight import check_study

    check_study(study, allow_underpowered)


def _workspace(study: Study, workspace: PathLike | None, storage: str | None,
               runs: list[RunSpec] | None = None) -> Workspace:
    """The workspace a read command names, never created; with run storage, the study's records pulled first."""
    from reslab.orchestrator.durability.workspace import Workspace

    ws = Workspace.at(workspace, storage)
    if ws.storage and runs is not None:
        from reslab.orchestrator.durability.storage import pull_study

        pull_study(ws, study.name, [r.run_id for r in runs])
    return ws


def plan(study: Study, *, workspace: PathLike | None = None, storage: str | None = None,
         rerun_failed: bool = False) -> StudyPlan:
    """`reslab plan`'s plan: `.counts` (per arm: to run, to skip, busy), `.entries()` (each run and why),
    `.looks` (a sequential study's), `.firsts` (the runs at the first seed)."""
    from reslab.experiments.expand import expand
    from reslab.orchestrator.cli.study import plan_study

    return plan_study(study, _workspace(study, workspace, storage, expand(study)), rerun_failed=rerun_failed)


def status(study: Study, *, workspace: PathLike | None = None, storage: str | None = None,
           lease_timeout: float = 120.0) -> StudyStatus:
    """`reslab status`'s data: each run's state, step and latest losses (`.runs`), `.counts()`, the ETA; read
    from the run directories alone."""
    from reslab.experiments.expand import expand
    from reslab.orchestrator.driving.progress import study_status_of

    runs = expand(study)
    return study_status_of(study, runs, _workspace(study, workspace, storage, runs), lease_timeout)


def compare(study: Study, *, workspace: PathLike | None = None, tracking_uri: str | None = None,
            storage: str | None = None, alpha: float = 0.05) -> pd.DataFrame:
    """`reslab compare`'s table as data: one row per comparison row (estimate, interval, p, verdict, seeds)."""
    from reslab.experiments.expand import expand
    from reslab.orchestrator.gathering.gather import gather

    runs = expand(study)
    ws = _workspace(study, workspace, storage, runs)
    return gather(study, runs, ws, ws.tracking_uri(tracking_uri), alpha=alpha).table


def verdict(study: Study, *, workspace: PathLike | None = None, tracking_uri: str | None = None,
            storage: str | None = None, alpha: float = 0.05) -> VerdictReport:
    """`reslab verdict`'s data: `.verdicts`, one `results.verdict.Verdict` per comparison row (its `decision`:
    better, worse, equivalent, undecided or futility; `estimate`, `low`, `high`, `p_value` or `e_value`, `seeds`,
    `compute`, `next`), held to the analysis plan frozen at the study's first submission (`.plan`); `.to_json()`."""
    from reslab.experiments.expand import expand
    from reslab.orchestrator.gathering.verdicts import study_verdicts

    runs = expand(study)
    ws = _workspace(study, workspace, storage, runs)
    return study_verdicts(study, ws, ws.tracking_uri(tracking_uri), runs=runs, alpha=alpha)


@dataclass(frozen=True)
class Options:
    """`reslab run`'s execution flags for `submit` (None: the command's default, the study's `resources:`)."""

    address: str | None = None  # --address: a Ray cluster; default $RAY_ADDRESS, else a local instance
    storage: str | None = None  # --storage: run storage
    max_concurrent: int | None = None
    cpus_per_run: float | None = None
    gpus_per_run: float | None = None
    retries: int | None = None
    rerun_failed: bool = False
    allow_underpowered: bool = False

    def argv(self) -> list[str]:
        """The flags, as `reslab run` reads them."""
        out: list[str] = []
        for key, value in vars(self).items():
            flag = "--" + key.replace("_", "-")
            if isinstance(value, bool):
                out += [flag] if value else []
            elif value is not None:
                out += [flag, str(value)]
        return out


def _parse(argv: list[str]) -> argparse.Namespace:
    """`argv` parsed by the `reslab` parser itself (its defaults, its checks of each flag); a bad flag is a
    `ConfigError` with the command's own one line."""
    from reslab.orchestrator.cli import build_parser

    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return build_parser().parse_args(argv)
    except SystemExit:
        line = err.getvalue().strip().splitlines()[-1] if err.getvalue().strip() else "bad arguments"
        raise ConfigError(line.removeprefix("reslab run: error: ")) from None


def _spec_file(study: Study, root: Path) -> Path:
    """The file a driver reads the study from: a built study's YAML written into the workspace's `api/` folder
    (named by its content), a loaded one's own file."""
    text = _BUILT.get(id(study))
    if text is None:
        if not study.path.is_file():
            raise ConfigError(f"study {study.name!r}: its file {study.path} is gone; load it again or use build()")
        return study.path.resolve()
    from reslab.common.io import write_atomic

    path = root / "api" / f"{study.name}-{hashlib.sha256(text.encode()).hexdigest()[:12]}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, text)
    return path


@dataclass
class Submission:
    """A submitted study: waited for (`result`, `exit_code` set) or running as a child process (`pid`, `log`)."""

    study: Study
    workspace: Path
    tracking_uri: str | None
    storage: str | None
    argv: list[str]
    result: Any = None  # driving.submit.SubmitResult, when the driver ran in this process
    exit_code: int | None = None
    process: subprocess.Popen | None = field(default=None, repr=False)
    log: Path | None = None

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def wait(self, timeout: float | None = None) -> int:
        """The driver's exit code (0 done, 1 a run failed, 130 interrupted), once it ended; the child reaped.
        A driver that refused the study (exit 2) raises `ReslabError` with its message; `TimeoutError` when it
        is still running after `timeout` seconds."""
        if self.process is not None and self.exit_code is None:
            try:
                self.exit_code = self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                raise TimeoutError(f"study {self.study.name!r}: its driver (pid {self.pid}) still runs after "
                                   f"{timeout:g}s; its log: {self.log}") from None
        assert self.exit_code is not None
        if self.exit_code == 2 and self.log is not None:
            errors = [line for line in self.log.read_text(errors="replace").splitlines()
                      if line.startswith("reslab: error: ")]
            raise ReslabError(errors[-1].removeprefix("reslab: error: ") if errors else
                              f"study {self.study.name!r}: its driver exited with 2; its log: {self.log}")
        return self.exit_code

    def status(self) -> StudyStatus:
        """The study's status now (`status`)."""
        return status(self.study, workspace=self.workspace, storage=self.storage)

    def verdict(self) -> VerdictReport:
        """The study's verdicts now (`verdict`)."""
        return verdict(self.study, workspace=self.workspace, tracking_uri=self.tracking_uri, storage=self.storage)


def submit(study: Study, *, wait: bool = True, workspace: PathLike | None = None, tracking_uri: str | None = None,
           options: Options | None = None) -> Submission:
    """Run the study's driver as `reslab run` does: in this process when `wait` (returns once every run ended),
    else as a child process `python -m reslab.orchestrator.cli run` (returns at once; `.wait()` reaps it). Runs
    already done in the workspace are skipped (run ids are content addresses), so submissions of one study share
    their runs. Waiting, it handles SIGTERM as `reslab run` does (an interrupt: runs stopped, exit 130)."""
    from reslab.orchestrator.durability.workspace import resolve_workspace

    options = options or Options()
    root = resolve_workspace(workspace)
    spec = _spec_file(study, root) if not wait else study.path
    argv = ["run", str(spec), "--workspace", str(root), *options.argv()]
    argv += [f"--set={key}={json.dumps(value)}" for key, value in study.overrides]
    argv += ["--tracking-uri", tracking_uri] if tracking_uri else []
    args = _parse(argv)
    handle = Submission(study, root, tracking_uri, options.storage, argv)
    if wait:
        from reslab.orchestrator.cli.study import run_study

        result = run_study(args, study).result
        handle.result, handle.exit_code = result, 130 if result.interrupted else 0 if result.ok else 1
        return handle
    handle.log = root / "api" / f"{study.name}-{time.strftime('%Y%m%dT%H%M%S')}-{time.monotonic_ns() % 10**6}.log"
    handle.log.parent.mkdir(parents=True, exist_ok=True)
    with open(handle.log, "wb") as out:
        handle.process = subprocess.Popen([sys.executable, "-m", "reslab.orchestrator.cli", *argv], stdout=out,
                                          stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    return handle


@contextlib.contextmanager
def ray_session(*, address: str | None = None, num_cpus: int | None = None,
                workspace: PathLike | None = None) -> Iterator[None]:
    """One Ray instance (local unless `address`) for every waiting `submit` inside the block: each uses it and
    leaves it running, instead of starting and stopping its own (~6 s on 2 cores)."""
    from reslab.orchestrator.dispatch.ray_backend import RayBackend
    from reslab.orchestrator.durability.workspace import resolve_workspace

    backend = RayBackend(address, workspace=resolve_workspace(workspace), num_cpus=num_cpus)
    try:
        backend.start()
        yield
    finally:
        backend.shutdown()


__all__ = ["Options", "Study", "Submission", "build", "compare", "load", "plan", "ray_session", "status", "submit",
           "validate", "verdict"]
