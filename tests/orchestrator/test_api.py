"""`reslab.api`, the Python interface: the same studies, checks, plans, status and errors as the `reslab` commands.

The waiting submission and the verdict are run end to end by the research loop's test
(`tests/orchestrator/test_research_loop.py`); the child-process submission by the slow test here.
"""

from __future__ import annotations

import os

import pytest
import yaml
from orch_helpers import ONE_RUN, TINY_STUDY, write_study

import reslab.api as rl
from reslab.common.errors import ConfigError, ReslabError
from reslab.experiments import expand, load_study
from reslab.experiments.spec import SpecError
from reslab.orchestrator.cli import main


def test_both_import_forms_name_the_same_module():
    from reslab import api

    assert api is rl and callable(rl.submit)


def test_load_applies_overrides_as_the_cli_set_does(tmp_path):
    path = write_study(tmp_path)
    study = rl.load(path, overrides={"train.steps": 4})
    assert study.overrides == (("train.steps", 4),)
    ids = [r.run_id for r in expand(study)]
    assert ids == [r.run_id for r in expand(load_study(path, [("train.steps", 4)]))]
    assert ids != [r.run_id for r in expand(rl.load(path))]  # an override changes run ids, as `--set` does


def test_load_errors_are_the_commands_own(tmp_path, capsys):
    missing = tmp_path / "nope.yaml"
    with pytest.raises(SpecError) as exc:
        rl.load(missing)
    assert main(["validate", str(missing)]) == 2
    assert capsys.readouterr().err.strip() == f"reslab: error: {exc.value}"
    with pytest.raises(ConfigError, match=r"tiny\.yaml: --set optim\.lr: expected a number, got .fast.$"):
        rl.load(write_study(tmp_path), overrides=[("optim.lr", "fast")])


def test_build_reads_a_mapping_as_the_same_file_would_be_read(tmp_path):
    text = TINY_STUDY.format(name="built", steps=6)
    built = rl.build(yaml.safe_load(text))
    loaded = load_study(write_study(tmp_path, "built", text=text))
    assert built.name == "built" and [r.run_id for r in expand(built)] == [r.run_id for r in expand(loaded)]
    assert rl.build(yaml.safe_load(text), name="renamed").name == "renamed"


@pytest.mark.parametrize(("change", "message"), [
    (lambda d: d.pop("study"), r"^study: a study built from a mapping needs a name"),
    (lambda d: d["base"]["model"].update(presett="tiny"), r"^base\.model: unknown key\(s\) 'presett'"),
    (lambda d: d["base"]["optim"].update(lr=object()), r"^top level: a study holds only what YAML can write"),
    (lambda d: d["arms"].update(control="no_such_variant"), r"arms\.control"),
])
def test_build_errors_name_the_field(change, message):
    data = yaml.safe_load(TINY_STUDY.format(name="bad", steps=6))
    change(data)
    with pytest.raises(ConfigError, match=message):
        rl.build(data)
    with pytest.raises(ConfigError, match=r"^top level: expected a mapping"):
        rl.build(["not", "a", "mapping"])  # type: ignore[arg-type]


def test_validate_refuses_what_reslab_validate_refuses(tmp_path, capsys):
    # two seed pairs, a confirmatory comparison: the smallest sign-flip p is 2/2^2 = 0.5, above alpha 0.05
    text = TINY_STUDY.format(name="weak", steps=6).replace("exploratory: true", "exploratory: false")
    path = write_study(tmp_path, "weak", text=text)
    with pytest.raises(ReslabError) as exc:
        rl.validate(rl.load(path))
    assert main(["validate", str(path)]) == 2
    assert capsys.readouterr().err.strip() == f"reslab: error: {exc.value}"
    rl.validate(rl.load(path), allow_underpowered=True)
    assert main(["validate", str(path), "--allow-underpowered"]) == 0


def test_plan_and_status_count_what_the_commands_print(tmp_path, capsys):
    study = rl.load(write_study(tmp_path))
    ws = tmp_path / "ws"
    plan = rl.plan(study, workspace=ws)
    assert plan.counts.to_dict()["by_arm"] == {"control": {"to run": 2, "skipped": 0, "busy": 0},
                                               "attnres": {"to run": 2, "skipped": 0, "busy": 0}}
    assert [e.run.run_id for e in plan.entries()] == [r.run_id for r in expand(study)]
    main(["plan", str(study.path), "--workspace", str(ws)])
    assert f"tiny: {plan.counts.summary()}" in capsys.readouterr().out
    status = rl.status(study, workspace=ws)
    assert status.counts()["to run"] == 4 and not ws.exists()  # a read never creates the workspace


def test_submit_refuses_a_bad_flag_with_the_commands_line_before_anything_is_written(tmp_path):
    study = rl.load(write_study(tmp_path))
    with pytest.raises(ConfigError, match=r"^argument --cpus-per-run: expected a number > 0, got '-1'"):
        rl.submit(study, workspace=tmp_path / "ws", options=rl.Options(cpus_per_run=-1))
    assert not (tmp_path / "ws").exists()
    assert rl.Options(max_concurrent=2, rerun_failed=True, address="auto").argv() == [
        "--address", "auto", "--max-concurrent", "2", "--rerun-failed"]


def test_a_loaded_study_whose_file_is_gone_cannot_be_submitted_without_waiting(tmp_path):
    study = rl.load(write_study(tmp_path))
    study.path.unlink()
    with pytest.raises(ConfigError, match=r"its file .* is gone"):
        rl.submit(study, wait=False, workspace=tmp_path / "ws")


@pytest.mark.slow
def test_a_submission_without_waiting_runs_the_driver_as_a_child_process(tmp_path):
    """One run of the tiny decoder, built in Python, run by `python -m reslab.orchestrator.cli run` (its own local
    Ray); the handle reaps it, its log is the command's output, and the status reads the run as finished."""
    study = rl.build(yaml.safe_load(ONE_RUN.format(name="child")), overrides={"train.steps": 4})
    ws = tmp_path / "ws"
    sub = rl.submit(study, wait=False, workspace=ws, options=rl.Options(cpus_per_run=1, max_concurrent=1))
    assert sub.pid is not None and sub.running() and sub.log is not None and sub.log.parent == ws / "api"
    written = [p for p in (ws / "api").iterdir() if p.suffix == ".yaml"]
    assert [p.name.rsplit("-", 1)[0] for p in written] == ["child"]
    assert sub.wait(timeout=240) == 0, sub.log.read_text()
    assert sub.exit_code == 0 and not sub.running()
    with pytest.raises(ProcessLookupError):
        os.kill(sub.pid, 0)  # reaped: no zombie left
    log = sub.log.read_text()
    assert "child: 1 succeeded, 0 skipped, 0 failed" in log, log
    assert sub.status().counts()["succeeded"] == 1
    assert rl.status(study, workspace=ws).runs[0].step == 4


def test_a_child_driver_that_refuses_the_study_raises_its_message(tmp_path):
    """A refusal only the driver makes (run storage it cannot open) comes back from `.wait()` as the one line
    `reslab run` prints (the child refuses before it imports torch: under a second)."""
    study = rl.load(write_study(tmp_path, "refused", text=ONE_RUN.format(name="refused")))
    sub = rl.submit(study, wait=False, workspace=tmp_path / "ws", options=rl.Options(storage="nosuch://bucket/x"))
    with pytest.raises(ReslabError, match=r"^--storage nosuch://bucket/x: cannot be opened \(Unrecognized"):
        sub.wait(timeout=120)
    assert sub.exit_code == 2
