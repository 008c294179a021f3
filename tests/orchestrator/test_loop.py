"""The one dispatch loop, driven with scripted completions: no Ray, no training.

`ScriptedBackend` stands in for Ray the way Ray's own controller tests stand in fake actor managers
for real actors (`tune/tests/execution/utils.py`): the loop's decisions (concurrency, retries, held
runs, interrupts, what a study and a search record) are what is under test, and a scripted worker
answers in microseconds what a real one would after training. The plan, the run directories, the
Optuna search (a journal file) and the signal handling are the real ones. Each behaviour is checked
for both sources, `reslab run`'s study and `reslab tune`'s search.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest

from reslab.experiments import expand, load_study
from reslab.orchestrator.dispatch import BackendError
from reslab.orchestrator.driving.loop import ExecutionOptions
from reslab.orchestrator.driving.submit import submit
from reslab.orchestrator.driving.tune import tune
from reslab.orchestrator.durability.workspace import Workspace
from reslab.orchestrator.tasks import (
    FAILED,
    PRUNED,
    SUCCESS,
    Action,
    ClusterInfo,
    Completion,
    Resources,
    RunOutcome,
    RunState,
    RunTask,
)

STUDY = """
study: {name}
base:
  model: {{preset: tiny, d_model: 32, n_layers: 2, n_heads: 2, n_kv_heads: 2, ffn_hidden: 64, seq_len: 32}}
  optim: {{batch_size: 4, warmup_steps: 1}}
  train: {{steps: 6, eval_every: 3, log_every: 3, eval_windows: 8, tail_k: 1, device: {device}}}
  cost: {{measure: false}}
arms:
  control: prenorm
  attnres: {{residual: attnres}}
seeds: 3
tune:
  trials: 3
  seed: 100
  objective: val_loss
  sampler: random
  pruner: {{name: median, n_startup_trials: 1}}
  space:
    optim.lr: {{type: float, low: 1.0e-4, high: 1.0e-2, log: true}}
comparisons:
  - {{name: main, control: control, treatments: [attnres], exploratory: true}}
"""

Respond = Callable[[RunTask], RunOutcome | None]


def succeed(task: RunTask) -> RunOutcome:
    """A worker that trained the run: its val_loss falls with the learning rate, so a search has an optimum."""
    lr = task.run.config.optim.lr
    return RunOutcome(run_id=task.run_id, state=SUCCESS, summary={"val_loss": 3.0 + abs(lr - 3e-3)},
                      metrics=[{"kind": "eval", "step": 6, "val_loss": 3.0}])


class ScriptedBackend:
    """A backend whose workers are `respond(task)`: an outcome, or None for a worker that died. Each poll
    completes up to `per_poll` tasks in submission order; `interrupt_at` sends this process SIGINT at
    that poll, as a user's Ctrl-C would."""

    def __init__(self, respond: Respond = succeed, *, cpus: float = 2, gpus: float = 0, per_poll: int = 1,
                 interrupt_at: int | None = None) -> None:
        self.respond, self.cluster = respond, ClusterInfo(address="scripted", cpus=cpus, gpus=gpus, nodes=1)
        self.per_poll, self.interrupt_at = per_poll, interrupt_at
        self.pending: list[RunTask] = []
        self.submitted: list[RunTask] = []
        self.requested: Resources | None = None
        self.max_inflight = self.polls = 0
        self.cancelled: list[RunTask] = []
        self.shut = False

    def start(self) -> ClusterInfo:
        return self.cluster

    def resources(self, requested: Resources) -> None:
        self.requested = requested

    def submit(self, task: RunTask, resources: Resources) -> None:
        self.pending.append(task)
        self.submitted.append(task)
        self.max_inflight = max(self.max_inflight, len(self.pending))

    def poll(self, timeout: float) -> tuple[list[dict], list[Completion]]:
        self.polls += 1
        if self.polls == self.interrupt_at:
            os.kill(os.getpid(), signal.SIGINT)  # the loop's handler only sets a flag
            return [], []
        done, self.pending = self.pending[:self.per_poll], self.pending[self.per_poll:]
        completions = []
        for task in done:
            outcome = self.respond(task)
            completions.append(Completion(task, outcome=outcome) if outcome else Completion(task, error="worker died"))
        return [], completions

    def cancel(self) -> list[RunTask]:
        self.cancelled, self.pending = self.pending, []
        return self.cancelled

    def shutdown(self) -> None:
        self.shut = True

    def attempts(self, run_id: str) -> list[int]:
        return [t.attempt for t in self.submitted if t.run_id == run_id]


def _study(tmp_path: Path, name: str = "loop", device: str = "cpu"):
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / f"{name}.yaml"
    path.write_text(textwrap.dedent(STUDY.format(name=name, device=device)))
    return load_study(path)


def _ws(tmp_path: Path) -> Workspace:
    ws = Workspace(tmp_path / "ws")
    ws.root.mkdir(parents=True, exist_ok=True)
    return ws


def run_study(tmp_path: Path, backend: ScriptedBackend, device: str = "cpu", **options):
    study = _study(tmp_path, device=device)
    runs = expand(study)
    opts = ExecutionOptions(poll_s=0.0, lease_timeout_s=10, **options)
    return runs, submit(study, runs, _ws(tmp_path), backend, None, opts, say=lambda *_: None)


def run_search(tmp_path: Path, backend: ScriptedBackend, said: list[str] | None = None, device: str = "cpu",
               **options):
    opts = ExecutionOptions(poll_s=0.0, lease_timeout_s=10, **options)
    return tune(_study(tmp_path, device=device), _ws(tmp_path), backend, None, opts,
                say=said.append if said is not None else lambda _: None)


def first_attempt(end: RunState | None, retryable: bool = True) -> Respond:
    """Attempt 1 ends as `end` (None: the worker died); later attempts succeed."""
    def respond(task: RunTask) -> RunOutcome | None:
        if task.attempt > 1:
            return succeed(task)
        if end is None:
            return None
        return RunOutcome(run_id=task.run_id, state=end, error=f"scripted {end}", retryable=retryable)
    return respond


class NamedBackend(ScriptedBackend):
    name = "Ray"


def test_a_study_says_what_it_waits_for_while_nothing_runs(tmp_path, capsys):
    """Issue 52, item 12: "running 0 ... ETA --" for minutes while Ray and its workers came up; the progress display
    says what the driver waits for, from before the backend starts until the first worker answers."""
    runs, result = run_study(tmp_path, NamedBackend())
    out = capsys.readouterr().out.splitlines()
    waits = [i for i, line in enumerate(out) if "waiting for" in line]
    assert [out[i].split("] ", 1)[1] for i in waits] == ["waiting for Ray to start", "waiting for workers"], out
    first_start = next(i for i, line in enumerate(out) if " succeeded " in line)
    assert waits[-1] < first_start and result.ok and len(result.states) == len(runs)


@pytest.mark.parametrize("end", [None, FAILED], ids=["worker-died", "retryable-failure"])
def test_a_study_retries_what_a_retry_can_fix(tmp_path, end):
    backend = ScriptedBackend(first_attempt(end))
    runs, result = run_study(tmp_path, backend, retries=1)
    assert result.ok and result.count("succeeded") == len(runs) == 6
    assert all(backend.attempts(r.run_id) == [1, 2] for r in runs)


def test_a_study_reports_a_deterministic_failure_at_once(tmp_path):
    backend = ScriptedBackend(first_attempt(FAILED, retryable=False))
    runs, result = run_study(tmp_path, backend, retries=3)
    assert result.count("failed") == 6 and not result.ok
    assert all(backend.attempts(r.run_id) == [1] for r in runs)
    assert set(result.errors.values()) == {"scripted FAILED"}


def test_a_study_gives_up_after_its_retries(tmp_path):
    backend = ScriptedBackend(lambda task: None)  # every worker dies
    runs, result = run_study(tmp_path, backend, retries=2)
    assert result.count("failed") == 6
    assert all(backend.attempts(r.run_id) == [1, 2, 3] for r in runs)


def test_a_search_retries_what_a_retry_can_fix_and_tells_optuna_once(tmp_path):
    backend = ScriptedBackend(first_attempt(None))
    result = run_search(tmp_path, backend, retries=1)
    assert {a: s.counts["complete"] for a, s in result.arms.items()} == {"control": 3, "attnres": 3}
    assert all(backend.attempts(t.run_id)[:2] == [1, 2] for t in backend.submitted)


def test_a_search_fails_a_trial_after_its_retries(tmp_path):
    backend = ScriptedBackend(lambda task: None)
    result = run_search(tmp_path, backend, retries=1)
    assert {a: s.counts["failed"] for a, s in result.arms.items()} == {"control": 3, "attnres": 3}
    assert {t.attempt for t in backend.submitted} == {1, 2}


def test_pruned_is_a_value_the_search_counts(tmp_path):
    """The worker's `PRUNED` (no error text at all) is told to Optuna as PRUNED."""
    def respond(task: RunTask) -> RunOutcome:
        if task.run.config.optim.lr < 1e-3:
            return RunOutcome(run_id=task.run_id, state=PRUNED)
        return succeed(task)

    said: list[str] = []
    result = run_search(tmp_path, ScriptedBackend(respond), said)
    counts = {a: (s.counts["pruned"], s.counts["complete"]) for a, s in result.arms.items()}
    assert sum(p for p, _ in counts.values()) >= 1 and all(p + c == 3 for p, c in counts.values())
    assert any(": pruned " in line for line in said)


@pytest.mark.parametrize("drive", ["study", "search"])
@pytest.mark.parametrize(("gpus_per_run", "limit"), [(2.0, 2), (None, 4), (0.0, 8)])
def test_concurrency_counts_gpus_for_both(tmp_path, drive, gpus_per_run, limit):
    """A cluster of 8 CPUs and 4 GPUs: 2 GPUs per run place 2 at once, the default 1 GPU 4, CPU-only
    runs 8 (one CPU each). `reslab tune` counted CPUs only before the loop was shared. The runs'
    `train.device: auto` (on `cpu` a run on 2 ranks would train on CPU ranks, asking for no GPU)."""
    backend = ScriptedBackend(cpus=8, gpus=4, per_poll=1)
    if drive == "study":
        run_study(tmp_path, backend, device="auto", gpus_per_run=gpus_per_run, cpus_per_run=1.0)
    else:
        run_search(tmp_path, backend, device="auto", gpus_per_run=gpus_per_run, cpus_per_run=1.0)
    assert backend.requested is not None and backend.requested.gpus == (1.0 if gpus_per_run is None else gpus_per_run)
    assert backend.max_inflight == min(limit, 6)  # a study has 6 runs; a search 3 trials x 2 arms


@pytest.mark.parametrize("drive", ["study", "search"])
def test_cuda_runs_without_a_gpu_are_refused_for_both(tmp_path, drive):
    backend = ScriptedBackend(cpus=8, gpus=0)
    study = _study(tmp_path, device="cuda")
    opts = ExecutionOptions(poll_s=0.0)
    with pytest.raises(BackendError, match="set train.device to cuda but runs get no GPU"):
        if drive == "study":
            submit(study, expand(study), _ws(tmp_path), backend, None, opts, say=lambda *_: None)
        else:
            tune(study, _ws(tmp_path), backend, None, opts, say=lambda _: None)
    assert not backend.submitted and backend.shut


@pytest.mark.parametrize("drive", ["study", "search"])
def test_ctrl_c_cancels_what_is_in_flight_and_restores_the_handlers(tmp_path, drive):
    before = signal.getsignal(signal.SIGINT)
    backend = ScriptedBackend(per_poll=1, interrupt_at=3)
    if drive == "study":
        runs, result = run_study(tmp_path, backend, max_concurrent=2)
        assert result.interrupted and result.count("succeeded") == 2
        assert result.count("interrupted") == 2 and result.count("to run") == 2
        assert {t.run_id for t in backend.cancelled} == {r for r, s in result.states.items() if s == "interrupted"}
    else:
        result = run_search(tmp_path, backend, max_concurrent=2)
        assert result.interrupted and sum(s.finished for s in result.arms.values()) == 2
        assert len(backend.cancelled) == 2
    assert signal.getsignal(signal.SIGINT) is before and backend.shut


def test_a_search_holds_a_run_another_driver_leases_and_tries_again(tmp_path):
    """A BUSY run is held (it counts against the limit) and resubmitted after the wait; a study instead
    reports it busy."""
    def respond(task: RunTask) -> RunOutcome:
        if not any(t.run_id == task.run_id for t in held):
            held.append(task)
            return RunOutcome(run_id=task.run_id, state=Action.BUSY, error="held by submission x")
        return succeed(task)

    held: list[RunTask] = []
    said: list[str] = []
    backend = ScriptedBackend(respond)
    result = run_search(tmp_path, backend, said, max_concurrent=2)
    assert {a: s.counts["complete"] for a, s in result.arms.items()} == {"control": 3, "attnres": 3}
    assert any("trying again in" in line for line in said)
    assert backend.max_inflight <= 2

    held.clear()
    runs, study_result = run_study(tmp_path / "study", ScriptedBackend(respond))
    assert study_result.count("busy") == len(runs)


def candidates(result_storage: str, study_name: str, arms: list[str]) -> dict[str, list[dict]]:
    """Each arm's candidate sequence: the parameters of its trials in order, a dead driver's orphaned
    trials left out (their parameters come back as the trial that resumes them)."""
    from reslab.orchestrator.attempt.pruning import open_search_storage, optuna_module
    from reslab.orchestrator.driving.tune import optuna_study_name

    out = {}
    for arm in arms:
        ost = optuna_module().load_study(study_name=optuna_study_name(study_name, arm),
                                         storage=open_search_storage(result_storage))
        trials = ost.get_trials(deepcopy=False)
        orphans = {t.user_attrs["resumes"] for t in trials if "resumes" in t.user_attrs}
        out[arm] = [t.params for t in trials if t.number not in orphans]
    return out


@pytest.mark.parametrize("sampler", ["random", "tpe"])
@pytest.mark.parametrize("interrupt_at", [2, 4])
def test_an_interrupted_search_asks_what_the_uninterrupted_one_asks(tmp_path, sampler, interrupt_at):
    """Issue 23: each candidate is a pure function of the search's seed and its completed trials, so a
    Ctrl-C and a rerun change nothing: the same learning rates, in the same order, in every arm."""
    def search(where: Path, backend: ScriptedBackend):
        study = _study(where)
        assert study.tune is not None
        study = dataclasses.replace(study, tune=dataclasses.replace(study.tune, sampler=sampler))
        opts = ExecutionOptions(poll_s=0.0, lease_timeout_s=10, max_concurrent=1)
        return study, tune(study, _ws(where), backend, None, opts, say=lambda _: None)

    study, straight = search(tmp_path / "straight", ScriptedBackend())
    _, first = search(tmp_path / "resumed", ScriptedBackend(interrupt_at=interrupt_at))
    assert first.interrupted
    _, second = search(tmp_path / "resumed", ScriptedBackend())
    assert sum(len(s.resumed) for s in second.arms.values()) == 1  # the trial in flight at Ctrl-C
    arms = [a.name for a in study.arms]
    want = candidates(straight.search_storage, study.name, arms)
    assert candidates(second.search_storage, study.name, arms) == want
    assert want["control"] == want["attnres"]  # common random numbers: every arm sees the same candidates
    # the same best candidate and value; its trial number differs by the orphan's (numbers never repeat)
    assert {a: (b["params"], b["value"]) for a, b in second.best.items()} == \
        {a: (b["params"], b["value"]) for a, b in straight.best.items()}
