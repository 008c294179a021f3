"""The plan at scale (issue 39): counted from the run directories that exist (`plan.plan_counts`), the same
counts as planning every run one by one (`plan_iter`, the reference); `reslab plan` counts a large study per
arm and lists its runs with `--ids`."""

from __future__ import annotations

from orch_helpers import write_study

from reslab.experiments import expand, load_study
from reslab.experiments.expand import iter_runs
from reslab.orchestrator.cli import main
from reslab.orchestrator.driving.plan import PlanCounts, plan_counts, plan_iter
from reslab.orchestrator.durability.workspace import Workspace, write_json
from reslab.orchestrator.tasks import FAILED, INTERRUPTED, SUCCESS

FINISHED = {"summary": {"val_loss": 4.2, "val_loss_tail": 4.3}, "info": {}}

STUDY = """
study: wide
base:
  model: {preset: tiny}
  train: {steps: 6}
arms:
  control: prenorm
  attnres: {residual: attnres}
seeds: 30
grid:
  optim.lr: [0.001, 0.002]
comparisons:
  - {control: control, exploratory: true}
"""


def _recorded(tmp_path):
    """The 120-run study with five run directories: two finished, one failed, one interrupted, and one of a
    run outside the study (another lr), which the plan must not count."""
    path = write_study(tmp_path, "wide", text=STUDY)
    ws = Workspace(tmp_path / "ws")
    runs = expand(load_study(path))
    states = {0: SUCCESS, 77: SUCCESS, 5: FAILED, 118: INTERRUPTED}
    for i, state in states.items():
        run = runs[i]
        rd = ws.run_dir("wide", run.run_id)
        rd.path.mkdir(parents=True)
        write_json(rd.spec_file, run.to_dict())
        if state == SUCCESS:
            write_json(rd.summary_file, FINISHED)
        rd.set_status(state, error="RuntimeError: boom" if state == FAILED else None)
    (tmp_path / "other").mkdir()
    other = expand(load_study(write_study(tmp_path / "other", "wide", text=STUDY.replace("0.001, 0.002", "0.003"))))[3]
    rd = ws.run_dir("wide", other.run_id)
    rd.path.mkdir(parents=True)
    write_json(rd.spec_file, other.to_dict())
    rd.set_status(SUCCESS)
    return path, ws


def test_counts_from_run_directories_are_the_counts_of_every_run_planned(tmp_path):
    path, ws = _recorded(tmp_path)
    study = load_study(path)
    for rerun_failed in (False, True):
        got = plan_counts(study, expand(study, study.seeds[:1]), ws, rerun_failed=rerun_failed)
        want = PlanCounts.of(plan_iter(iter_runs(study), ws, rerun_failed=rerun_failed))
        assert got is not None and (got.runs, got.actions, got.by_arm) == (want.runs, want.actions, want.by_arm)
    assert got.summary() == "120 runs: 118 to run, 2 to skip, 0 busy elsewhere"  # rerun_failed: the failure runs


def test_a_run_directory_without_its_spec_is_counted_by_planning_every_run(tmp_path, capsys):
    path, ws = _recorded(tmp_path)
    study = load_study(path)
    ws.run_dir("wide", "prenorm-000000000000").path.mkdir()  # claimed a moment ago: no spec.json yet
    assert plan_counts(study, expand(study, study.seeds[:1]), ws) is None
    assert main(["plan", str(path), "--workspace", str(ws.root)]) == 0
    assert "wide: 120 runs: 117 to run, 3 to skip, 0 busy elsewhere" in capsys.readouterr().out


def test_cli_plan_counts_a_large_study_and_lists_it_with_ids(tmp_path, capsys):
    path, ws = _recorded(tmp_path)
    runs = expand(load_study(path))
    assert main(["plan", str(path), "--workspace", str(ws.root)]) == 0
    out = capsys.readouterr().out
    assert "wide: 120 runs: 117 to run, 3 to skip, 0 busy elsewhere" in out
    rows = {line.split()[0]: line.split()[1:] for line in out.splitlines() if line.startswith("  control")
            or line.startswith("  attnres")}
    assert rows == {"control": ["60", "59", "1", "0"], "attnres": ["60", "58", "2", "0"]}
    assert not any(r.run_id in out for r in runs)
    assert "reslab plan --ids" in out
    assert main(["plan", str(path), "--workspace", str(ws.root), "--ids"]) == 0
    lines = capsys.readouterr().out.splitlines()
    header = next(i for i, line in enumerate(lines) if "run id" in line and line.rstrip().endswith("why"))
    listed = lines[header + 1:header + 1 + len(runs)]
    column = lines[header].rindex("why")
    for run, line in zip(runs, listed, strict=True):
        assert line.split()[1] == run.run_id and run.label in line
        assert line[column:] == ("succeeded" if run in (runs[0], runs[77]) else
                                 "failed: RuntimeError: boom (use --rerun-failed)" if run is runs[5] else
                                 "interrupted; no checkpoint yet: starts over" if run is runs[118] else "new")


def test_status_of_a_large_study_lists_the_runs_that_need_a_look_and_counts_the_rest(tmp_path, capsys):
    """`reslab status` on more than `LISTED_RUNS` runs: the failed run is listed, the finished and the to-run ones
    (the interrupted run resumes: to run) are counted in one line; `--ids` lists all 120."""
    path, ws = _recorded(tmp_path)
    assert main(["status", str(path), "--workspace", str(ws.root)]) == 0
    lines = capsys.readouterr().out.splitlines()
    listed = [line.split()[0] for line in lines if line.startswith("  ") and not line.startswith("  ...")]
    assert listed == ["failed"], lines
    assert "  ... 119 more runs not listed" in "\n".join(lines)
    assert main(["status", str(path), "--workspace", str(ws.root), "--ids"]) == 0
    out = capsys.readouterr().out
    assert sum(line.startswith(("  succeeded", "  to run", "  failed")) for line in out.splitlines()) == 120
