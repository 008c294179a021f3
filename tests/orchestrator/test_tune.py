"""`reslab tune`: pruning in the worker, equal budgets, kill-and-resume, `--from-tune`.

The library tests drive `orchestrator.driving.tune.tune` over the in-process `LocalBackend` (the same
`execute_run` path as Ray, see its docstring) on a d=32 decoder of 9 steps (~1 s a trial); the CLI
test at the end runs `reslab tune` and `reslab run --from-tune` for real on local Ray and MLflow.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
from orch_helpers import KilledDriver, dying_backend

from reslab.experiments import expand, load_study
from reslab.orchestrator.attempt.pruning import open_search_storage
from reslab.orchestrator.dispatch.local_backend import LocalBackend
from reslab.orchestrator.driving.loop import ExecutionOptions
from reslab.orchestrator.driving.tune import default_storage, from_tune, optuna_study_name, tune
from reslab.orchestrator.durability.workspace import Workspace

STUDY = """
study: {name}
base:
  model: {{preset: tiny, d_model: 32, n_layers: 2, n_heads: 2, n_kv_heads: 2, ffn_hidden: 64, seq_len: 32}}
  optim: {{batch_size: 4, warmup_steps: 1, lr: 3.0e-3}}
  train: {{steps: 9, eval_every: 3, log_every: 3, eval_windows: 8, tail_k: 2, checkpoint_every: 3}}
  cost: {{measure: false}}
arms:
  control: prenorm
  attnres: {{residual: attnres}}
seeds: 2
tune:
  trials: {trials}
  seed: 100
  objective: val_loss
  sampler: random
  pruner: {{name: median, n_startup_trials: 1}}
  space:
    optim.lr: {{type: float, low: 1.0e-5, high: 1.0e-2, log: true}}
comparisons:
  - {{name: main, control: control, treatments: [attnres], exploratory: true}}
"""


def _study(tmp_path: Path, name: str = "tn", trials: int = 3) -> Path:
    path = tmp_path / f"{name}.yaml"
    path.write_text(textwrap.dedent(STUDY.format(name=name, trials=trials)))
    return path


def _enqueue(study, url: str, lrs: list[float]) -> None:
    """Fix the first trials' learning rates (Optuna's public `enqueue_trial`) so that whether the
    pruner fires does not depend on what the sampler draws: a run at 1e-5 barely moves from its
    initial loss, so it is worse than the 1e-2 run at the first eval and the median pruner stops it."""
    import optuna

    for arm in study.arms:
        ost = optuna.create_study(study_name=optuna_study_name(study.name, arm.name), storage=open_search_storage(url),
                                  direction="minimize", load_if_exists=True)
        for lr in lrs:
            ost.enqueue_trial({"optim.lr": lr})


def _options() -> ExecutionOptions:
    return ExecutionOptions(max_concurrent=1, retries=0, poll_s=0.0)


def test_pruner_stops_trials_in_the_worker_and_budgets_are_equal(tmp_path, workspace):
    study = load_study(_study(tmp_path))
    url = default_storage(workspace, study.name)
    _enqueue(study, url, [1e-2, 1e-5])
    result = tune(study, workspace, LocalBackend(), None, _options(), say=lambda _: None)

    import optuna

    for arm in study.arms:
        state = result.arms[arm.name]
        assert state.finished == 3, state  # equal budget: every arm has exactly `trials` finished trials
        assert state.counts["pruned"] >= 1, state
        trials = optuna.load_study(study_name=optuna_study_name(study.name, arm.name),
                                   storage=open_search_storage(url)).trials
        assert len(trials) == 3
        pruned = [t for t in trials if t.state == optuna.trial.TrialState.PRUNED]
        assert trials[1].params == {"optim.lr": 1e-5} and trials[1] in pruned
        for t in pruned:
            # stopped in the worker: its run directory ends at the pruning step, before train.steps
            rd = workspace.run_dir(study.name, t.user_attrs["run_id"])
            steps = [r["step"] for r in rd.metrics() if r["kind"] == "eval"]
            assert max(steps) < 9 and max(steps) == max(t.intermediate_values)
            assert "pruned" in (rd.status() or {}).get("error", "")
    assert set(result.best) == {"control", "attnres"}


def test_killed_driver_resumes_without_repeating_trial_numbers(tmp_path, workspace):
    import optuna

    study = load_study(_study(tmp_path, trials=3))
    url = default_storage(workspace, study.name)
    with pytest.raises(KilledDriver):
        tune(study, workspace, dying_backend(3), None, _options(), say=lambda _: None)
    storage = open_search_storage(url)
    before = {a.name: optuna.load_study(study_name=optuna_study_name(study.name, a.name), storage=storage).trials
              for a in study.arms}
    running = {arm: [t for t in ts if t.state == optuna.trial.TrialState.RUNNING] for arm, ts in before.items()}
    assert sum(len(r) for r in running.values()) >= 1
    done = [sum(t.state.is_finished() for t in ts) for ts in before.values()]
    assert max(done) - min(done) <= 1  # arms take turns

    lines: list[str] = []
    result = tune(study, workspace, LocalBackend(), None, _options(), say=lines.append)
    storage = open_search_storage(url)
    for arm in study.arms:
        trials = optuna.load_study(study_name=optuna_study_name(study.name, arm.name), storage=storage).trials
        numbers = [t.number for t in trials]
        assert len(numbers) == len(set(numbers))
        assert result.arms[arm.name].finished == 3
        assert result.arms[arm.name].resumed == [t.number for t in running[arm.name]]
        for orphan in running[arm.name]:
            assert trials[orphan.number].state == optuna.trial.TrialState.FAIL
            again = [t for t in trials if t.user_attrs.get("resumes") == orphan.number]
            assert len(again) == 1 and again[0].params == orphan.params and again[0].number > orphan.number
            assert again[0].state in (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED)
        # everything finished before the kill kept its number and state
        for t in before[arm.name]:
            if t.state.is_finished():
                assert trials[t.number].state == t.state and trials[t.number].params == t.params
    assert any("driver that is gone" in line for line in lines)

    # a third run has nothing left to do and starts no backend
    again = tune(study, workspace, dying_backend(0), None, _options(), say=lambda _: None)
    assert again.trials_run == 0


def _candidates(study, workspace) -> dict[str, list[dict]]:
    """Each arm's candidates in the order they were asked: every trial's parameters by number, the copies
    that resume a dead driver's trial left out (they repeat its candidate)."""
    import optuna

    storage = open_search_storage(default_storage(workspace, study.name))
    trials = {a.name: optuna.load_study(study_name=optuna_study_name(study.name, a.name), storage=storage).trials
              for a in study.arms}
    return {arm: [t.params for t in ts if "resumes" not in t.user_attrs] for arm, ts in trials.items()}


@pytest.mark.slow
@pytest.mark.parametrize("sampler", ["random", "tpe"])
def test_an_interrupted_search_asks_what_the_uninterrupted_one_asks(tmp_path, sampler):
    """The candidate sequence is a function of the search's seed and the candidate's index in its arm, so a
    driver killed mid-search and run again asks exactly the uninterrupted search's candidates, and both arms
    (one shared space) get the same ones; `--from-tune` then pairs the same run ids."""
    path = _study(tmp_path, trials=3)
    path.write_text(path.read_text().replace("sampler: random", f"sampler: {sampler}"))
    study = load_study(path)
    straight, broken = Workspace(tmp_path / "straight"), Workspace(tmp_path / "broken")
    tune(study, straight, LocalBackend(), None, _options(), say=lambda _: None)
    with pytest.raises(KilledDriver):
        tune(study, broken, dying_backend(3), None, _options(), say=lambda _: None)
    resumed = tune(study, broken, LocalBackend(), None, _options(), say=lambda _: None)
    assert sum(len(a.resumed) for a in resumed.arms.values()) >= 1  # the kill left a trial to resume
    expected = _candidates(study, straight)
    assert _candidates(study, broken) == expected
    assert expected["control"] == expected["attnres"] and len({p["optim.lr"] for p in expected["control"]}) == 3
    runs = {ws.root.name: sorted(r.run_id for r in expand(from_tune(study, default_storage(ws, study.name))[0]))
            for ws in (straight, broken)}
    assert runs["straight"] == runs["broken"]


def test_from_tune_freezes_each_arms_best_params_into_the_runs(tmp_path, workspace):
    import optuna

    study = load_study(_study(tmp_path, trials=2))
    url = default_storage(workspace, study.name)
    _enqueue(study, url, [1e-2, 1e-4])
    tune(study, workspace, LocalBackend(), None, _options(), say=lambda _: None)
    tuned, best = from_tune(study, url)
    for arm in tuned.arms:
        ost = optuna.load_study(study_name=optuna_study_name(study.name, arm.name), storage=open_search_storage(url))
        assert dict(arm.tuned) == ost.best_trial.params == best[arm.name]["params"]
    runs = expand(tuned)
    assert {r.seed for r in runs} == set(study.seeds)  # comparison seeds, not the tuning seed
    for r in runs:
        assert r.config.optim.lr == best[r.arm]["params"]["optim.lr"]
    assert not {r.run_id for r in runs} & {r.run_id for r in expand(study)}


@pytest.mark.slow
def test_cli_tune_then_run_from_tune_on_ray(tmp_path, workspace, capsys):
    """The whole path for real: local Ray workers, MLflow children per trial, plots on the parent,
    then the paired study at the tuned configs with its table naming them."""
    from reslab.orchestrator.cli import main
    from reslab.orchestrator.tracking.store import import_mlflow

    spec = _study(tmp_path, name="tncli", trials=2)
    ws = ["--workspace", str(workspace.root)]
    assert main(["tune", str(spec), *ws, "--max-concurrent", "2"]) == 0
    out = capsys.readouterr().out
    assert "control: " in out and "best per arm" in out

    client = import_mlflow()(tracking_uri=workspace.tracking_uri(None))
    exp = client.get_experiment_by_name("tncli")
    runs = client.search_runs([exp.experiment_id])
    trials = [r for r in runs if "tune.trial" in r.data.tags]
    assert {r.data.tags["tune.state"] for r in trials} <= {"complete", "pruned", "failed"}
    assert len({(r.data.tags["tune.study"], r.data.tags["tune.trial"]) for r in trials}) >= 2
    parent = next(r for r in runs if r.data.params.get("settings.mode") == "tune")
    plots = [a.path for a in client.list_artifacts(parent.info.run_id, "tune_plots")]
    assert any(p.endswith("control_history.png") for p in plots)

    # a re-run finds every arm done: no trial, no Ray, no new parent run
    assert main(["tune", str(spec), *ws]) == 0
    assert "0 trial(s) finished" in capsys.readouterr().out
    assert len(client.search_runs([exp.experiment_id])) == len(runs)

    assert main(["plan", str(spec), *ws, "--from-tune"]) == 0
    assert "configs from tuning" in capsys.readouterr().out
    assert main(["run", str(spec), *ws, "--from-tune", "--max-concurrent", "2"]) == 0
    out = capsys.readouterr().out
    head, table = out.split("succeeded", 1)
    assert "configs from tuning" in head and "(trial " in head
    assert "attnres" in table and "arms at their tuned configs: control: optim.lr=" in table


def test_ctrl_c_stops_the_search_and_the_next_run_finishes_it(tmp_path, workspace):
    study = load_study(_study(tmp_path, trials=2))
    first = tune(study, workspace, dying_backend(1, KeyboardInterrupt), None, _options(), say=lambda _: None)
    assert first.interrupted and sum(s.finished for s in first.arms.values()) == 1
    second = tune(study, workspace, LocalBackend(), None, _options(), say=lambda _: None)
    assert not second.interrupted
    assert [s.finished for s in second.arms.values()] == [2, 2]
    assert sum(len(s.resumed) for s in second.arms.values()) == 1  # the trial queued at Ctrl-C, asked again


def test_ask_seeds_are_stable_and_spread():
    """Consecutive small numpy seeds start with nearly equal draws (RandomState(0) and (3) both
    give ~0.55 first), which collapsed a 4-trial random search onto two learning rates; hashed
    seeds are reproducible across restarts and spread over the unit interval."""
    import numpy as np

    from reslab.orchestrator.driving.tune import ask_seed

    seeds = [ask_seed(0, n) for n in range(16)]
    assert seeds == [ask_seed(0, n) for n in range(16)] and len(set(seeds)) == 16
    first = sorted(np.random.RandomState(s).uniform() for s in seeds)
    assert first[0] < 0.1 and first[-1] > 0.9  # seeds 0..3 give 0.42..0.55
    assert max(b - a for a, b in zip(first, first[1:], strict=False)) < 0.25


def test_a_search_continues_only_for_the_configuration_it_was_made_for(tmp_path, workspace):
    """Editing the base (here the model width) after a search must not let `tune` continue it, nor
    `--from-tune` freeze its results into the changed study; raising the trial budget may continue it."""
    from reslab.common.errors import ConfigError

    path = _study(tmp_path, name="fp", trials=1)
    study = load_study(path)
    tune(study, workspace, LocalBackend(), None, _options(), say=lambda _: None)
    more = load_study(_study(tmp_path, name="fp", trials=2))
    tune(more, workspace, LocalBackend(), None, _options(), say=lambda _: None)  # same search, bigger budget
    path.write_text(path.read_text().replace("d_model: 32", "d_model: 48"))
    changed = load_study(path)
    with pytest.raises(ConfigError, match="was made for another configuration"):
        tune(changed, workspace, LocalBackend(), None, _options(), say=lambda _: None)
    with pytest.raises(ConfigError, match="was made for another configuration"):
        from_tune(changed, default_storage(workspace, changed.name))
