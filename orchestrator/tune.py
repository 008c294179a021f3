"""`reslab tune`: one Optuna study per arm, driven ask-and-tell from the driver; every trial is a run.

`tune(study, workspace, backend, tracker, options)`:

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
   Each ask uses a sampler seeded by (`tune.sampler.seed`, the arm's trial count): a restarted
   driver asks what the dead one would have, and a random phase (TPE's startup trials, `random`)
   draws the same candidates in every arm (common random numbers). A trial's config is the arm's config with the trial's
   parameters set and `train.seed = tune.seed`; its run id is that config's hash, so trials
   dispatch through the same `Backend`/`execute_run` path as study runs: a finished run is not
   trained again, a crashed attempt is retried.
4. pruning happens in the worker: the worker holds a `TrialLink` and, after each eval, reports the
   objective to its trial in the shared storage and asks the arm's pruner (`pruning_callback`);
   a pruned trial raises `StopRun` there, checkpointed, and comes back INTERRUPTED with a reason
   the driver tells Optuna as PRUNED. This channel needs no round trip to the driver and works
   wherever the storage is reachable (a shared workspace for the journal file, the database
   otherwise).
5. records every trial as the MLflow child of its run under this tune submission (tags
   `tune.trial`, `tune.state`, `tune.params`), then Optuna's matplotlib plots on the parent.

A run leased by another driver (or by a killed one, until its lease times out) is tried again every
few seconds. A run already finished when its trial is asked (the same parameters asked twice, or a driver that
died after the run finished) is told its recorded value without training. Ctrl-C leaves the trials
in flight RUNNING; the next `reslab tune` recovers them as in 2.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import tempfile
import time
import uuid
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from reslab.experiments.expand import RunSpec, resolve_config, run_id_of
from reslab.experiments.spec import Study
from reslab.experiments.tune import Param, TuneSpec, apply_tuned
from reslab.common.errors import ConfigError, ReslabError
from reslab.orchestrator.dispatch import Backend, Completion, Resources
from reslab.orchestrator.envinfo import submission_code
from reslab.orchestrator.storage import hold_workspace_study, pull_completed
from reslab.orchestrator.submit import StopOnSignal, SubmitOptions, mark_interrupted
from reslab.orchestrator.worker import RunTask
from reslab.orchestrator.workspace import FAILED, INTERRUPTED, SUCCESS, Workspace

PRUNED_REASON = "pruned by the tune pruner"


def _optuna() -> Any:
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return optuna


@dataclass(frozen=True, kw_only=True)
class TrialLink:
    """What a worker needs to report to its trial and ask the pruner; plain picklable data."""

    storage: str
    study: str
    number: int
    metric: str
    pruner: str
    pruner_options: dict[str, Any]
    steps: int


def default_storage(workspace: Workspace, study: str) -> str:
    return str(workspace.root / "tune" / f"{study}.journal")


class TuneStorageError(ReslabError, RuntimeError):
    """The search's storage cannot be opened (a database that does not answer, an unwritable path)."""


def make_storage(url: str) -> Any:
    """An RDB URL (`<dialect>://...`) or a journal file path."""
    optuna = _optuna()
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
    pruners = _optuna().pruners
    if name == "median":
        return pruners.MedianPruner(**options)
    if name == "successive_halving":
        return pruners.SuccessiveHalvingPruner(**options)
    if name == "hyperband":
        return pruners.HyperbandPruner(**{"max_resource": steps, **options})
    return pruners.NopPruner()


def make_sampler(spec: TuneSpec, arm: str, seed: int) -> Any:
    samplers = _optuna().samplers
    if spec.sampler == "cmaes":
        return samplers.CmaEsSampler(seed=seed)
    if spec.sampler == "random":
        return samplers.RandomSampler(seed=seed)
    if spec.sampler == "grid":
        return samplers.GridSampler({p.path: p.grid_values() for p in spec.space[arm]}, seed=seed)
    return samplers.TPESampler(seed=seed)


def distribution(p: Param) -> Any:
    d = _optuna().distributions
    if p.type == "categorical":
        return d.CategoricalDistribution(list(p.choices))
    if p.type == "int":
        return d.IntDistribution(int(p.low or 0), int(p.high or 0), log=p.log, step=int(p.step or 1))
    return d.FloatDistribution(float(p.low or 0.0), float(p.high or 0.0), log=p.log, step=p.step)


def ask_seed(seed: int, trials_so_far: int) -> int:
    """The sampler seed of one ask: the same after a restart, never a replay of an earlier ask's
    draws. Hashed, because numpy's first draws under consecutive small seeds are close (seeds 0 and
    3 both start at ~0.55), which would collapse a random search onto a few values."""
    digest = hashlib.sha256(f"{seed}:{trials_so_far}".encode()).digest()
    return int.from_bytes(digest[:4], "little")


def optuna_study_name(study: str, arm: str) -> str:
    return f"{study}.{arm}"


def pruning_callback(link: TrialLink, recorder: Any, steps: int, log: Callable[[str], None]) -> Callable[[int], None]:
    """The worker's `on_step`: after each eval, report the objective to the trial and stop the run
    (`StopRun`) when the pruner says so. Runs in the worker process."""
    from reslab.models.training import StopRun

    optuna = _optuna()
    storage = make_storage(link.storage)
    study = optuna.load_study(study_name=link.study, storage=storage,
                              pruner=make_pruner(link.pruner, link.pruner_options, link.steps))
    study_id = storage.get_study_id_from_name(link.study)
    trial = optuna.trial.Trial(study, storage.get_trial_id_from_study_id_trial_number(study_id, link.number))
    reported: set[int] = set()

    def on_step(done: int) -> None:
        last = recorder.last_eval
        if last is None or last[0] != done or done in reported or done >= steps:
            return
        reported.add(done)
        value = last[1].get(link.metric)
        if value is None:
            return
        trial.report(float(value), done)
        if trial.should_prune():
            log(f"trial {link.number} of {link.study}: pruned at step {done} ({link.metric} {value:.4f})")
            raise StopRun(done, PRUNED_REASON)

    return on_step


def trial_run(study: Study, arm_name: str, params: dict[str, Any]) -> RunSpec:
    """The run of one trial: the arm with the trial's parameters, on the tuning seed."""
    if study.tune is None:
        raise ConfigError(f"{study.path}: tune: missing; `reslab tune` needs a `tune:` block in the study")
    arm = next(a for a in study.arms if a.name == arm_name)
    tuned = dataclasses.replace(arm, overrides=apply_tuned(arm.overrides, params))
    where = f"tune.arms.{arm_name}"
    cfg = resolve_config(study.config_dict(tuned, (), study.tune.seed), where)
    return RunSpec(study=study.name, arm=arm_name, grid=(), seed=study.tune.seed, config=cfg, run_id=run_id_of(cfg))


class _NothingToDo(Exception):
    """Every arm already has its trials: no backend is started."""


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
    storage: str
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


def check_fingerprint(ost: Any, study: Study, arm_name: str, storage_url: str, *, stamp: bool) -> None:
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
    optuna = _optuna()
    assert study.tune is not None
    studies = {a.name: optuna.create_study(study_name=optuna_study_name(study.name, a.name), storage=storage,
                                           direction=study.tune.direction, load_if_exists=True)
               for a in study.arms}
    for arm, ost in studies.items():
        check_fingerprint(ost, study, arm, storage_url, stamp=True)
    return studies


def _recover(ost: Any, state: ArmState) -> None:
    """Fail the RUNNING trials of a dead driver and enqueue their parameters again (module doc, 2)."""
    ts = _optuna().trial.TrialState
    for t in ost.get_trials(deepcopy=False, states=(ts.RUNNING,)):
        ost.tell(t.number, state=ts.FAIL)
        ost.enqueue_trial(t.params, user_attrs={"resumes": t.number})
        state.resumed.append(t.number)


def _count(ost: Any, state: ArmState) -> None:
    ts = _optuna().trial.TrialState
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
    optuna = _optuna()
    if study.tune is None:
        raise ConfigError(f"{study.path}: --from-tune: the study has no `tune:` block")
    if "://" not in storage_url and not Path(storage_url).is_file():
        raise ConfigError(f"--from-tune: no search at {storage_url}; run `reslab tune {study.path}` first, or name "
                          "its storage with --tune-storage")
    storage = make_storage(storage_url)
    ts = optuna.trial.TrialState
    best: dict[str, dict[str, Any]] = {}
    for arm in study.arms:
        name = optuna_study_name(study.name, arm.name)
        try:
            ost = optuna.load_study(study_name=name, storage=storage)
        except KeyError:
            raise ConfigError(f"--from-tune: no search for arm {arm.name!r} in {storage_url}; run "
                              f"`reslab tune {study.path}` first") from None
        check_fingerprint(ost, study, arm.name, storage_url, stamp=False)
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


def _log_plots(tracker: Any, studies: dict[str, Any], say: Callable[[str], None]) -> None:
    """Optuna's history, parallel-coordinate and importance plots per arm on the parent run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    vis = _optuna().visualization.matplotlib
    plots = {"history": vis.plot_optimization_history, "parallel_coordinate": vis.plot_parallel_coordinate,
             "param_importances": vis.plot_param_importances}
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        # the matplotlib plots are marked experimental; the warning says nothing about our use
        warnings.simplefilter("ignore", _optuna().exceptions.ExperimentalWarning)
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


def tune(study: Study, workspace: Workspace, backend: Backend, tracker: Any | None,
         options: SubmitOptions | None = None, *, storage_url: str | None = None,
         say: Callable[[str], None] = print) -> TuneResult:
    """Run each arm's search to `tune.trials` finished trials; see the module docstring."""
    if study.tune is None:
        raise ConfigError(f"{study.path}: tune: missing; `reslab tune` needs a `tune:` block in the study")
    options = options or SubmitOptions()
    submission = f"tune-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
    # one driver per study on run storage, as for `reslab run` (`storage.hold_study`)
    with hold_workspace_study(workspace, study.name, submission, options.lease_timeout_s, options.heartbeat_s):
        return _tune(study, workspace, backend, tracker, options, submission, storage_url, say)


def _tune(study: Study, workspace: Workspace, backend: Backend, tracker: Any | None, options: SubmitOptions,
          submission: str, storage_url: str | None, say: Callable[[str], None]) -> TuneResult:
    spec = study.tune
    assert spec is not None  # checked by `tune`
    optuna = _optuna()
    t0 = time.time()
    url = storage_url or default_storage(workspace, study.name)
    storage = make_storage(url)
    studies = _open_studies(study, storage, url)
    result = TuneResult(submission=submission, storage=url, arms={a.name: ArmState(a.name) for a in study.arms})
    for arm, ost in studies.items():
        _recover(ost, result.arms[arm])
        _count(ost, result.arms[arm])
        if result.arms[arm].resumed:
            say(f"  {arm}: trial(s) {result.arms[arm].resumed} were RUNNING under a driver that is gone; "
                "failed them and asked their parameters again")
    say(f"{study.name}: tuning {len(studies)} arms x {spec.trials} trials ({spec.sampler}, pruner {spec.pruner}, "
        f"objective {spec.direction} {spec.metric}, seed {spec.seed}); storage {url}; "
        + ", ".join(f"{a} {s.finished}/{spec.trials} done" for a, s in result.arms.items()))
    code = submission_code()  # the git version and the fingerprint every worker checks its code against
    nothing_to_do = all(s.finished >= spec.trials for s in result.arms.values())
    if tracker is not None and not nothing_to_do:  # a no-op re-run leaves no empty parent run
        result.parent_run_id = tracker.begin(
            study.name, submission=submission, code=code, plan=[], study_file=study.path,
            settings={"mode": "tune", "trials_per_arm": spec.trials, "sampler": spec.sampler,
                      "pruner": spec.pruner, "objective": f"{spec.direction} {spec.metric}",
                      "tune_seed": spec.seed, "storage": url, "retries": options.retries})

    ts = optuna.trial.TrialState
    inflight: dict[str, tuple[RunTask, list[tuple[str, int]]]] = {}  # run id -> task, (arm, trial number)s
    held: list[tuple[float, RunTask]] = []  # (not before, task): runs another driver's lease still holds
    status = FAILED
    arm_order = [a.name for a in study.arms]
    stop = StopOnSignal()  # SIGINT/SIGTERM -> a flag checked between ticks, as in `submit`
    try:
        if nothing_to_do:
            raise _NothingToDo
        cluster = backend.start()
        gpus = options.gpus_per_run if options.gpus_per_run is not None else (1.0 if cluster.gpus > 0 else 0.0)
        resources = Resources(cpus=options.cpus_per_run, gpus=gpus)
        backend.resources(resources)
        stop.__enter__()  # after the backend: `ray.init` installs its own SIGTERM handler
        limit = options.max_concurrent or max(1, int(cluster.cpus // max(resources.cpus, 1e-9)))
        say(f"  cluster {cluster.address}: {cluster.cpus:g} CPU, {cluster.gpus:g} GPU; up to {limit} trials at once")
        while True:
            while len(inflight) < limit:
                asked = {a: result.arms[a].finished + result.arms[a].inflight for a in arm_order}
                open_arms = [a for a in arm_order if asked[a] < spec.trials]
                if not open_arms:
                    break
                arm = min(open_arms, key=asked.__getitem__)  # fewest asked first: no arm runs ahead
                _ask(study, arm, studies, storage, spec, workspace, submission, code, options, inflight,
                     backend, resources, result.arms[arm], url)
                result.trials_run += 1
            if not inflight:
                break
            if stop.requested:
                raise KeyboardInterrupt
            now = time.time()
            for when, task in [w for w in held if w[0] <= now]:
                held.remove((when, task))
                backend.submit(task, resources)
            if len(held) == len(inflight):  # nothing is running, only runs waiting for a lease
                time.sleep(max(options.poll_s, 0.2))
                continue
            events, done = backend.poll(options.poll_s)
            if tracker is not None:
                for ev in events:
                    entry = inflight.get(ev.get("run_id", ""))
                    if entry is not None:
                        tracker.on_event(entry[0].run, ev)
                tracker.flush()
            for c in done:
                if c.outcome is not None and c.outcome.state == "BUSY":
                    # its run is leased by another driver, or by a killed one until the lease expires
                    wait = max(1.0, min(10.0, options.lease_timeout_s / 4))
                    say(f"  {c.task.run.label} ({c.task.run_id}): {c.outcome.error}; trying again in {wait:.0f}s")
                    held.append((time.time() + wait, c.task))
                    continue
                retry = _complete(c, inflight, studies, result, tracker, options, spec, workspace, say)
                if retry is not None:
                    backend.submit(retry, resources)
        status = SUCCESS
    except _NothingToDo:
        status = SUCCESS
    except KeyboardInterrupt:
        status = INTERRUPTED
        result.interrupted = True
        for task in backend.cancel():
            mark_interrupted(workspace.run_dir(study.name, task.run_id), submission,
                              "interrupted (Ctrl-C); the next `reslab tune` resumes its trial")
        say(f"\n{study.name}: tuning interrupted; run the same command again to continue the search")
    finally:
        stop.__exit__()
        backend.shutdown()
        for arm, ost in studies.items():
            _count(ost, result.arms[arm])
            if ost.get_trials(deepcopy=False, states=(ts.COMPLETE,)):
                t = ost.best_trial
                result.best[arm] = {"number": t.number, "value": t.value, "params": dict(t.params)}
        if tracker is not None and result.parent_run_id is not None:
            if status == SUCCESS:
                _log_plots(tracker, studies, say)
            counts = {f"{arm}_{k}": v for arm, s in result.arms.items() for k, v in s.counts.items()}
            tracker.end(status, counts)
    result.wall_s = time.time() - t0
    return result


def _ask(study: Study, arm: str, studies: dict[str, Any], storage: Any, spec: TuneSpec, workspace: Workspace,
         submission: str, code: dict[str, Any], options: SubmitOptions,
         inflight: dict[str, tuple[RunTask, list[tuple[str, int]]]], backend: Backend, resources: Resources,
         state: ArmState, url: str) -> None:
    """Ask `arm`'s study for one trial and dispatch its run (or join a run already in flight)."""
    optuna = _optuna()
    n_before = len(studies[arm].get_trials(deepcopy=False))
    ost = optuna.load_study(study_name=optuna_study_name(study.name, arm), storage=storage,
                            sampler=make_sampler(spec, arm, ask_seed(spec.sampler_seed, n_before)))
    trial = ost.ask({p.path: distribution(p) for p in spec.space[arm]})
    run = trial_run(study, arm, trial.params)
    trial.set_user_attr("run_id", run.run_id)
    state.inflight += 1
    if run.run_id in inflight:  # the same parameters asked twice: one run answers both trials
        inflight[run.run_id][1].append((arm, trial.number))
        return
    link = TrialLink(storage=url, study=optuna_study_name(study.name, arm), number=trial.number, metric=spec.metric,
                     pruner=spec.pruner, pruner_options=spec.pruner_options, steps=run.config.train.steps)
    run_storage = workspace.run_storage()
    task = RunTask(run=run, run_dir=str(workspace.run_dir(study.name, run.run_id).path), submission=submission,
                   threads=max(1, int(resources.cpus)), code=code, lease_timeout_s=options.lease_timeout_s,
                   heartbeat_s=options.heartbeat_s, trial=link,
                   storage=run_storage.run_uri(study.name, run.run_id) if run_storage else None)
    inflight[run.run_id] = (task, [(arm, trial.number)])
    backend.submit(task, resources)


def _complete(c: Completion, inflight: dict[str, tuple[RunTask, list[tuple[str, int]]]], studies: dict[str, Any],
              result: TuneResult, tracker: Any, options: SubmitOptions, spec: TuneSpec, workspace: Workspace,
              say: Callable[[str], None]) -> RunTask | None:
    """Tell Optuna how one trial's run ended; returns the next attempt's task when it is retried."""
    ts, metric = _optuna().trial.TrialState, spec.metric
    task, outcome = c.task, c.outcome
    run = task.run
    if (outcome is None or (outcome.state == FAILED and outcome.retryable)) and task.attempt <= options.retries:
        error = (outcome.error if outcome is not None else c.error) or "unknown error"
        say(f"  {run.label} ({run.run_id}): attempt {task.attempt} failed ({error}); retrying")
        if tracker is not None:
            tracker.fail(run, error, final=False)
        retry = dataclasses.replace(task, attempt=task.attempt + 1)
        inflight[run.run_id] = (retry, inflight[run.run_id][1])
        return retry
    _, trials = inflight.pop(run.run_id)
    value: float | None = None
    if outcome is not None and outcome.state in (SUCCESS, "DONE"):
        value = outcome.summary.get(metric)
        state, label = ts.COMPLETE, "complete"
        if tracker is not None:
            if outcome.state == SUCCESS:
                tracker.finish(run, outcome.summary, metrics=outcome.metrics, env=outcome.env, info=outcome.info)
            else:
                pull_completed(workspace, run.study, run.run_id)  # finished on a node whose scratch the driver lacks
                tracker.sync(run, workspace.run_dir(run.study, run.run_id))
    elif outcome is not None and outcome.state == INTERRUPTED and (outcome.error or "").startswith(PRUNED_REASON):
        state, label = ts.PRUNED, "pruned"
        if tracker is not None:
            tracker.kill(run)
    else:
        state, label = ts.FAIL, "failed"
        if tracker is not None:
            tracker.fail(run, (outcome.error if outcome is not None else c.error) or "failed")
    for arm, number in trials:
        ost = studies[arm]
        if label == "complete" and value is None:
            state, label = ts.FAIL, "failed"
        ost.tell(number, value if label == "complete" else None, state=state)
        arm_state = result.arms[arm]
        arm_state.inflight -= 1
        _count(ost, arm_state)
        shown = f"{metric} {value:.4f}" if value is not None and label == "complete" else (
            (outcome.error if outcome is not None else c.error) or "")
        say(f"  {arm} trial {number}: {label} {json.dumps(ost.trials[number].params)} {shown} "
            f"[{arm_state.finished}/{spec.trials}]")
        if tracker is not None:
            tracker.tag_child(run, {"tune.trial": number, "tune.study": ost.study_name, "tune.state": label,
                                    "tune.params": json.dumps(ost.trials[number].params)})
    return None


__all__ = ["PRUNED_REASON", "TrialLink", "TuneResult", "best_trials", "default_storage", "from_tune",
           "make_storage", "pruning_callback", "trial_run", "tune", "tuned_lines"]
