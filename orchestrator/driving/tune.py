"""`reslab tune`: one Optuna study per arm, driven ask-and-tell from the driver; every trial is a run.

`tune(study, workspace, backend, tracker, options)` drives a `SearchSource` on the one dispatch
loop (`orchestrator.driving.loop`), which owns concurrency (GPU-aware), the device check, retries, held
runs and signals exactly as for `reslab run`; the search only asks and tells:

1. opens (or creates) one Optuna study per arm, `<study>.<arm>`, in `storage`: a journal file
   (`<workspace>/tune/<study>.journal` by default; any path) or an RDB URL (`sqlite:///...`,
   `postgresql://...`). The search lives there, not in the driver.
2. recovers what a dead driver left: a trial still RUNNING (its driver was killed) is told FAIL
   and its parameters are enqueued as a new trial tagged `resumes=<number>`; the new trial has a
   new number (numbers never repeat) and the same parameters, hence the same run id, so its run
   resumes from the checkpoint the dead driver's worker left. Such failed orphans do not count
   toward the budget; every other finished trial (complete, pruned or failed) does.
3. asks the arm with the fewest trials so far for the next one until each has `tune.trials`
   finished ones (equal budgets, no arm ahead of another), at most `max_concurrent` runs in flight.
   Each ask uses a sampler seeded by (`tune.sampler.seed`, the candidate's index in its arm, copies
   that resume an orphan not counted): a restarted driver asks what the dead one would have, and
   a random phase (TPE's startup trials, `random`) draws the same candidates in every arm (common
   random numbers). A trial's config is the arm's config with the trial's parameters set and
   `train.seed = tune.seed`; its run id is that config's hash, so trials dispatch through the
   same `Backend`/`execute_run` path as study runs: a finished run is not trained again, a
   crashed attempt is retried.
4. pruning happens in the worker (`orchestrator.attempt.pruning`): the worker holds a `TrialLink` and,
   after each eval, reports the objective to its trial in the shared storage and asks the arm's
   pruner (`PruningHook`); a pruned trial raises `StopRun` there, checkpointed, and comes back as
   `RunState.PRUNED`, which the driver tells Optuna as PRUNED. This channel needs no round trip
   to the driver and works wherever the storage is reachable (a shared workspace for the journal
   file, the database otherwise).
5. records every trial as the MLflow child of its run under this tune submission (tags
   `tune.trial`, `tune.state`, `tune.params`), then Optuna's matplotlib plots on the parent.

A run leased by another driver (or by a killed one, until its lease times out) is held by the loop
and tried again every few seconds. A run already finished when its trial is asked (the same
parameters asked twice, or a driver that died after the run finished) is told its recorded value
without training. Ctrl-C leaves the trials
in flight RUNNING; the next `reslab tune` recovers them as in 2.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from reslab.common.errors import ConfigError
from reslab.experiments.expand import RunSpec, resolve_config, run_id_of
from reslab.experiments.spec import Study
from reslab.experiments.tune import Param, TuneSpec, apply_tuned
from reslab.orchestrator.attempt.envinfo import submission_code
from reslab.orchestrator.attempt.pruning import TrialLink, open_search_storage, optuna_module
from reslab.orchestrator.dispatch import Backend
from reslab.orchestrator.driving.loop import DispatchLoop, ExecutionOptions, TaskMaker, new_submission
from reslab.orchestrator.durability.storage import hold_workspace_study
from reslab.orchestrator.durability.workspace import Workspace
from reslab.orchestrator.tasks import FAILED, PRUNED, SUCCESS, Action, Completion, RunTask
from reslab.orchestrator.tracking.protocol import DriverTracker, NullTracker


def default_storage(workspace: Workspace, study: str) -> str:
    """Where a search lives by default: a journal file in the workspace."""
    return str(workspace.root / "tune" / f"{study}.journal")


def make_sampler(spec: TuneSpec, arm: str, seed: int) -> Any:
    samplers = optuna_module().samplers
    if spec.sampler == "cmaes":
        return samplers.CmaEsSampler(seed=seed)
    if spec.sampler == "random":
        return samplers.RandomSampler(seed=seed)
    if spec.sampler == "grid":
        return samplers.GridSampler({p.path: p.grid_values() for p in spec.space[arm]}, seed=seed)
    return samplers.TPESampler(seed=seed)


def distribution(p: Param) -> Any:
    d = optuna_module().distributions
    if p.type == "categorical":
        return d.CategoricalDistribution(list(p.choices))
    if p.type == "int":
        return d.IntDistribution(int(p.low or 0), int(p.high or 0), log=p.log, step=int(p.step or 1))
    return d.FloatDistribution(float(p.low or 0.0), float(p.high or 0.0), log=p.log, step=p.step)


def ask_seed(seed: int, trials_so_far: int) -> int:
    """The sampler seed of one ask: a function of the search's seed and the candidate's index in its
    arm (`trials_so_far` counts candidates, not the copies that resume a dead driver's trials), so an
    interrupted and resumed search asks what the uninterrupted one asks, and never replays an earlier
    ask's draws. Hashed, because numpy's first draws under consecutive small seeds are close (seeds 0 and
    3 both start at ~0.55), which would collapse a random search onto a few values."""
    digest = hashlib.sha256(f"{seed}:{trials_so_far}".encode()).digest()
    return int.from_bytes(digest[:4], "little")


def optuna_study_name(study: str, arm: str) -> str:
    return f"{study}.{arm}"


def trial_run(study: Study, arm_name: str, params: dict[str, Any]) -> RunSpec:
    """The run of one trial: the arm with the trial's parameters, on the tuning seed."""
    if study.tune is None:
        raise ConfigError(f"{study.path}: tune: missing; `reslab tune` needs a `tune:` block in the study")
    arm = next(a for a in study.arms if a.name == arm_name)
    tuned = dataclasses.replace(arm, overrides=apply_tuned(arm.overrides, params))
    where = f"tune.arms.{arm_name}"
    cfg = resolve_config(study.config_dict(tuned, (), study.tune.seed), where)
    return RunSpec(study=study.name, arm=arm_name, grid=(), seed=study.tune.seed, config=cfg,
                   run_id=run_id_of(cfg))


@dataclass
class ArmState:
    """One arm's search as this driver sees it."""

    arm: str
    finished: int = 0  # complete + pruned + failed, orphans of dead drivers excluded
    counts: dict[str, int] = field(default_factory=lambda: {"complete": 0, "pruned": 0, "failed": 0})
    resumed: list[int] = field(default_factory=list)  # RUNNING trials of a dead driver, failed and re-asked
    inflight: int = 0


@dataclass
class TuneResult:
    submission: str
    search_storage: str  # the Optuna storage URL of the search (a journal file or a database)
    arms: dict[str, ArmState]
    best: dict[str, dict[str, Any]] = field(default_factory=dict)
    trials_run: int = 0  # trials this driver dispatched
    interrupted: bool = False
    parent_run_id: str | None = None
    wall_s: float = 0.0


FINGERPRINT_ATTR = "reslab_fingerprint"


def search_fingerprint(study: Study, arm_name: str) -> str:
    """What a search's trials depend on: the arm's config at the tuning seed (base, arm overrides and
    `--set`) and the tune block except its trial budget (raising `trials` continues a search)."""
    assert study.tune is not None
    arm = next(a for a in study.arms if a.name == arm_name)
    tune = {k: v for k, v in dataclasses.asdict(study.tune).items() if k != "trials"}
    tune["space"] = tune["space"].get(arm_name, ())
    payload = {"config": study.config_dict(arm, (), study.tune.seed), "tune": tune}
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=repr).encode()).hexdigest()[:16]


def check_search_fingerprint(ost: Any, study: Study, arm_name: str, storage_url: str, *, stamp: bool) -> None:
    """A search continues (or feeds `--from-tune`) only for the study it was made for; `reslab tune`
    stamps a new search (`stamp`), readers never write."""
    want = search_fingerprint(study, arm_name)
    have = ost.user_attrs.get(FINGERPRINT_ATTR)
    if have is None:
        if stamp:
            ost.set_user_attr(FINGERPRINT_ATTR, want)
    elif have != want:
        raise ConfigError(
            f"tune: the search for arm {arm_name!r} in {storage_url} was made for another configuration (the "
            "base, the arm, a --set or the tune block changed since); name a new --tune-storage, or delete that one "
            "to search again")


def _open_studies(study: Study, storage: Any, storage_url: str) -> dict[str, Any]:
    optuna = optuna_module()
    assert study.tune is not None
    studies = {a.name: optuna.create_study(study_name=optuna_study_name(study.name, a.name), storage=storage,
                                           direction=study.tune.direction, load_if_exists=True)
               for a in study.arms}
    for arm, ost in studies.items():
        check_search_fingerprint(ost, study, arm, storage_url, stamp=True)
    return studies


def _recover(ost: Any, state: ArmState) -> None:
    """Fail the RUNNING trials of a dead driver and enqueue their parameters again (module doc, 2)."""
    ts = optuna_module().trial.TrialState
    for t in ost.get_trials(deepcopy=False, states=(ts.RUNNING,)):
        ost.tell(t.number, state=ts.FAIL)
        ost.enqueue_trial(t.params, user_attrs={"resumes": t.number})
        state.resumed.append(t.number)


def _count(ost: Any, state: ArmState) -> None:
    ts = optuna_module().trial.TrialState
    trials = ost.get_trials(deepcopy=False)
    orphans = {t.user_attrs["resumes"] for t in trials if "resumes" in t.user_attrs}
    names = {ts.COMPLETE: "complete", ts.PRUNED: "pruned", ts.FAIL: "failed"}
    state.counts = {"complete": 0, "pruned": 0, "failed": 0}
    for t in trials:
        if t.state in names and not (t.state == ts.FAIL and t.number in orphans):
            state.counts[names[t.state]] += 1
    state.finished = sum(state.counts.values())


def best_trials(study: Study, storage_url: str) -> dict[str, dict[str, Any]]:
    """arm -> {number, value, params} of its best complete trial; `ConfigError` when an arm has none."""
    optuna = optuna_module()
    if study.tune is None:
        raise ConfigError(f"{study.path}: --from-tune: the study has no `tune:` block")
    if "://" not in storage_url and not Path(storage_url).is_file():
        raise ConfigError(f"--from-tune: no search at {storage_url}; run `reslab tune {study.path}` first, or name "
                          "its storage with --tune-storage")
    storage = open_search_storage(storage_url)
    ts = optuna.trial.TrialState
    best: dict[str, dict[str, Any]] = {}
    for arm in study.arms:
        name = optuna_study_name(study.name, arm.name)
        try:
            ost = optuna.load_study(study_name=name, storage=storage)
        except KeyError:
            raise ConfigError(f"--from-tune: no search for arm {arm.name!r} in {storage_url}; run "
                              f"`reslab tune {study.path}` first") from None
        check_search_fingerprint(ost, study, arm.name, storage_url, stamp=False)
        if not ost.get_trials(deepcopy=False, states=(ts.COMPLETE,)):
            raise ConfigError(f"--from-tune: arm {arm.name!r} has no complete trial in {storage_url}; run "
                              f"`reslab tune {study.path}` until it has")
        t = ost.best_trial
        best[arm.name] = {"number": t.number, "value": t.value, "params": dict(t.params)}
    return best


def from_tune(study: Study, storage_url: str) -> tuple[Study, dict[str, dict[str, Any]]]:
    """The study with each arm's best parameters as arm overrides (`Arm.tuned` names them)."""
    best = best_trials(study, storage_url)
    arms = tuple(dataclasses.replace(a, overrides=apply_tuned(a.overrides, best[a.name]["params"]),
                                     tuned=tuple(best[a.name]["params"].items())) for a in study.arms)
    return dataclasses.replace(study, arms=arms), best


def tuned_study(study: Study, workspace: Workspace, storage: str | None) -> tuple[Study, list[str]]:
    """`--from-tune`: the study frozen at each arm's best trial, and the lines that say so."""
    if study.tune is None:
        raise ConfigError(f"--from-tune: {study.path} has no `tune:` block to take configs from")
    url = storage or default_storage(workspace, study.name)
    tuned, best = from_tune(study, url)
    head = (f"configs from tuning ({url}; best {study.tune.direction} {study.tune.metric} on tuning seed "
            f"{study.tune.seed}):")
    return tuned, [head, *tuned_lines(best, study.tune.metric)]


def tuned_lines(best: dict[str, dict[str, Any]], metric: str) -> list[str]:
    """One line per arm: its tuned parameters and the trial they came from."""
    return [f"  {arm}: " + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                     for k, v in b["params"].items())
            + f"  (trial {b['number']}, {metric} {b['value']:.4f})" for arm, b in best.items()]


def _log_plots(tracker: DriverTracker, studies: dict[str, Any], say: Callable[[str], None]) -> None:
    """Optuna's history, parallel-coordinate and importance plots per arm on the parent run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    vis = optuna_module().visualization.matplotlib
    plots = {"history": vis.plot_optimization_history, "parallel_coordinate": vis.plot_parallel_coordinate,
             "param_importances": vis.plot_param_importances}
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        # the matplotlib plots are marked experimental; the warning says nothing about our use
        warnings.simplefilter("ignore", optuna_module().exceptions.ExperimentalWarning)
        for arm, ost in studies.items():
            for name, plot in plots.items():
                try:
                    ax = plot(ost)
                except (ValueError, RuntimeError) as exc:  # too few complete trials, one parameter
                    say(f"  plot {name} of {arm}: skipped ({exc})")
                    continue
                fig = (ax.flat[0] if hasattr(ax, "flat") else ax).figure
                fig.savefig(Path(tmp) / f"{arm}_{name}.png", dpi=80, bbox_inches="tight")
                plt.close(fig)
        tracker.log_parent_files(Path(tmp), "tune_plots")


class SearchSource:
    """Each arm's Optuna search as the loop's task source (module docstring, 3-5)."""

    resume_hint = "the next `reslab tune` resumes its trial"

    def __init__(self, study: Study, studies: dict[str, Any], search_storage: Any, result: TuneResult, maker: TaskMaker,
                 tracker: DriverTracker, say: Callable[[str], None]) -> None:
        assert study.tune is not None
        self.study, self.spec, self.studies, self.search_storage = study, study.tune, studies, search_storage
        self.result, self.maker, self.tracker, self.say = result, maker, tracker, say
        self.trials: dict[str, list[tuple[str, int]]] = {}  # run id in flight -> the (arm, trial number)s it answers
        self.runs: dict[str, RunSpec] = {}  # every trial run dispatched, for late events

    def run_of(self, run_id: str) -> RunSpec | None:
        return self.runs.get(run_id)

    def next_task(self) -> RunTask | None:
        """Ask the arm with the fewest trials asked so far (no arm runs ahead) until a trial needs a new run."""
        arms = self.result.arms
        while True:
            asked = {a: arms[a].finished + arms[a].inflight for a in arms}
            open_arms = [a for a in arms if asked[a] < self.spec.trials]
            if not open_arms:
                return None
            task = self._ask(min(open_arms, key=asked.__getitem__))
            self.result.trials_run += 1
            if task is not None:
                return task

    def _ask(self, arm: str) -> RunTask | None:
        """One trial of `arm`: its run's task, or None when the run is already in flight for another trial."""
        optuna, spec = optuna_module(), self.spec
        # the candidate's index: trials that resume a dead driver's orphan repeat its candidate, not a new one
        n_before = sum("resumes" not in t.user_attrs for t in self.studies[arm].get_trials(deepcopy=False))
        ost = optuna.load_study(study_name=optuna_study_name(self.study.name, arm), storage=self.search_storage,
                                sampler=make_sampler(spec, arm, ask_seed(spec.sampler_seed, n_before)))
        trial = ost.ask({p.path: distribution(p) for p in spec.space[arm]})
        run = trial_run(self.study, arm, trial.params)
        trial.set_user_attr("run_id", run.run_id)
        self.result.arms[arm].inflight += 1
        if run.run_id in self.trials:  # the same parameters asked twice: one run answers both trials
            self.trials[run.run_id].append((arm, trial.number))
            return None
        self.trials[run.run_id] = [(arm, trial.number)]
        self.runs[run.run_id] = run
        link = TrialLink(search_storage=self.result.search_storage, study=ost.study_name, number=trial.number,
                         metric=spec.metric, pruner=spec.pruner, pruner_options=spec.pruner_options,
                         steps=run.config.train.steps)
        return self.maker.task(run, trial=link)

    def on_event(self, event: dict[str, Any]) -> None: ...

    def tick(self) -> None: ...

    def on_retry(self, c: Completion) -> None:
        self.tracker.fail(c.task.run, c.error_text, final=False)
        self.say(f"  {c.task.run.label} ({c.task.run_id}): attempt {c.task.attempt} failed ({c.error_text}); retrying")

    def waiting(self, what: str | None) -> None:
        """A search shows no progress display: its lines say what each trial came to."""

    def on_interrupted(self, task: RunTask, finished: bool) -> None:
        """Its trials stay RUNNING in the search; the next `reslab tune` recovers them (module docstring, 2)."""

    def on_complete(self, c: Completion) -> float | None:
        """Tell Optuna how one trial's run ended; a run another driver's lease holds is held and tried again."""
        run, end = c.task.run, c.end
        if end == Action.BUSY:
            wait = max(1.0, min(10.0, self.maker.options.lease_timeout_s / 4))
            self.say(f"  {run.label} ({run.run_id}): {c.error_text}; trying again in {wait:.0f}s")
            return wait
        ts = optuna_module().trial.TrialState
        value: float | None = None
        if c.outcome is not None and end in (SUCCESS, Action.SKIP):
            value = c.outcome.summary.get(self.spec.metric)
            state, label = (ts.COMPLETE, "complete") if value is not None else (ts.FAIL, "failed")
            if end == SUCCESS:
                self.tracker.finish(run, c.outcome.summary, metrics=c.outcome.metrics, env=c.outcome.env,
                                    info=c.outcome.info)
            else:  # finished by an earlier driver: its records, pulled by the loop, are the truth
                self.tracker.sync(run, self.maker.workspace.run_dir(run.study, run.run_id))
        elif end == PRUNED:
            state, label = ts.PRUNED, "pruned"
            self.tracker.kill(run)
        else:
            state, label = ts.FAIL, "failed"
            self.tracker.fail(run, c.error_or("failed"))
        for arm, number in self.trials.pop(run.run_id):
            self._tell(arm, number, run, (state, label, value), c)
        return None

    def _tell(self, arm: str, number: int, run: RunSpec, told: tuple[Any, str, float | None], c: Completion) -> None:
        state, label, value = told
        ost, arm_state = self.studies[arm], self.result.arms[arm]
        ost.tell(number, value if label == "complete" else None, state=state)
        arm_state.inflight -= 1
        _count(ost, arm_state)
        params = json.dumps(ost.trials[number].params)
        shown = f"{self.spec.metric} {value:.4f}" if label == "complete" and value is not None else c.error_or("")
        self.say(f"  {arm} trial {number}: {label} {params} {shown} [{arm_state.finished}/{self.spec.trials}]")
        self.tracker.tag_child(run, {"tune.trial": number, "tune.study": ost.study_name, "tune.state": label,
                                     "tune.params": params})


def tune(study: Study, workspace: Workspace, backend: Backend, tracker: DriverTracker | None,
         options: ExecutionOptions | None = None, *, storage_url: str | None = None,
         say: Callable[[str], None] = print) -> TuneResult:
    """Run each arm's search to `tune.trials` finished trials; see the module docstring."""
    if study.tune is None:
        raise ConfigError(f"{study.path}: tune: missing; `reslab tune` needs a `tune:` block in the study")
    options = options or ExecutionOptions()
    submission = new_submission("tune-")
    t0 = time.time()
    # one driver per study on run storage, as for `reslab run` (`storage.hold_study`)
    with hold_workspace_study(workspace, study.name, submission, options.lease_timeout_s, options.heartbeat_s):
        url = storage_url or default_storage(workspace, study.name)
        search_storage = open_search_storage(url)
        studies = _open_studies(study, search_storage, url)
        result = TuneResult(submission=submission, search_storage=url,
                            arms={a.name: ArmState(a.name) for a in study.arms})
        _recover_all(study, studies, result, say)
        maker = TaskMaker(workspace, submission, submission_code(), options)
        source = SearchSource(study, studies, search_storage, result, maker, tracker or NullTracker(), say)
        _search(source, backend, say)
    result.wall_s = time.time() - t0
    return result


def _recover_all(study: Study, studies: dict[str, Any], result: TuneResult, say: Callable[[str], None]) -> None:
    """What dead drivers left, recovered (module docstring, 2), and each arm's count; then one line saying where
    the search stands."""
    spec = study.tune
    assert spec is not None
    for arm, ost in studies.items():
        _recover(ost, result.arms[arm])
        _count(ost, result.arms[arm])
        if result.arms[arm].resumed:
            say(f"  {arm}: trial(s) {result.arms[arm].resumed} were RUNNING under a driver that is gone; "
                "failed them and asked their parameters again")
    say(f"{study.name}: tuning {len(studies)} arms x {spec.trials} trials ({spec.sampler}, pruner {spec.pruner}, "
        f"objective {spec.direction} {spec.metric}, seed {spec.seed}); storage {result.search_storage}; "
        + ", ".join(f"{a} {s.finished}/{spec.trials} done" for a, s in result.arms.items()))


def _search(source: SearchSource, backend: Backend, say: Callable[[str], None]) -> None:
    """The loop over the search (nothing starts when every arm has its trials), then the best trials and
    the parent run's plots and counts."""
    study, spec, result, tracker = source.study, source.spec, source.result, source.tracker
    options = source.maker.options
    assert spec is not None
    status = SUCCESS
    if any(s.finished < spec.trials for s in result.arms.values()):  # a no-op re-run leaves no empty parent run
        result.parent_run_id = tracker.begin(
            study.name, submission=result.submission, code=source.maker.code, plan={}, study_file=study.path,
            settings={"mode": "tune", "trials_per_arm": spec.trials, "sampler": spec.sampler,
                      "pruner": spec.pruner, "objective": f"{spec.direction} {spec.metric}",
                      "tune_seed": spec.seed, "storage": result.search_storage, "retries": options.retries})
        loop = DispatchLoop(source, backend, tracker, source.maker.workspace, options, say)
        status = FAILED
        try:
            outcome = loop.run([trial_run(study, a, {}) for a in result.arms], result.submission)
            status, result.interrupted = outcome.status, outcome.interrupted
        finally:
            _finish(source, status, say)
        if result.interrupted:
            say(f"\n{study.name}: tuning interrupted; run the same command again to continue the search")
    else:
        _finish(source, status, say)


def _finish(source: SearchSource, status: Any, say: Callable[[str], None]) -> None:
    result, tracker = source.result, source.tracker
    for arm, ost in source.studies.items():
        _count(ost, result.arms[arm])
        if ost.get_trials(deepcopy=False, states=(optuna_module().trial.TrialState.COMPLETE,)):
            t = ost.best_trial
            result.best[arm] = {"number": t.number, "value": t.value, "params": dict(t.params)}
    if result.parent_run_id is not None:
        if status == SUCCESS:
            _log_plots(tracker, source.studies, say)
        tracker.end(status, {f"{arm}_{k}": v for arm, s in result.arms.items() for k, v in s.counts.items()})


__all__ = ["SearchSource", "TuneResult", "best_trials", "default_storage", "from_tune", "trial_run", "tune",
           "tuned_lines"]
