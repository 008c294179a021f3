"""Power before compute on the command line: `plan` prints the attainable p, `run` refuses an
underpowered confirmatory study before anything is dispatched, `power` sizes seeds."""

from __future__ import annotations

import pytest
from orch_helpers import TINY_STUDY, write_study

from reslab.experiments import expand, load_study
from reslab.orchestrator.cli import main
from reslab.orchestrator.driving.submit import check_power
from reslab.orchestrator.durability.workspace import Workspace
from reslab.results.power import UnderpoweredStudy

CONFIRMATORY = TINY_STUDY.replace(", exploratory: true}}", ", mei: 0.02}}")


def test_plan_prints_the_attainable_p_per_comparison(tmp_path, capsys):
    path = write_study(tmp_path, text=CONFIRMATORY.format(name="tiny", steps=6))
    assert main(["plan", str(path), "--workspace", str(tmp_path / "ws")]) == 0
    out = capsys.readouterr().out
    assert ("power: main (confirmatory, superiority): 2 pairs per row, family 'default' of 1 (holm): smallest "
            "attainable p 0.5 CANNOT reach alpha=0.05") in out


def test_run_refuses_before_dispatch_and_the_flag_overrides(tmp_path, capsys):
    path = write_study(tmp_path, text=CONFIRMATORY.format(name="tiny", steps=6))
    ws = tmp_path / "ws"
    # an existing, empty workspace: `run` prestarts a local Ray only for a new one, which a refusal then waits
    # to stop (3-4 s; bench/RESULTS.md, issue 19); refused, it must stay empty
    ws.mkdir()
    assert main(["run", str(path), "--workspace", str(ws)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith("reslab: error: tiny: comparisons cannot reach alpha=0.05: main (smallest attainable p 0.5 "
                          "with 2 seeds, family of 1; needs 6 seeds)")
    assert "exploratory: true" in err and "--allow-underpowered" in err
    assert not any(ws.iterdir())  # nothing written, nothing dispatched
    # validate refuses what run refuses, with the same line, and takes the same flag
    assert main(["validate", str(path)]) == 2
    assert capsys.readouterr().err == err
    assert main(["validate", str(path), "--allow-underpowered"]) == 0
    assert ": ok." in capsys.readouterr().out

    # The library's one check, which every command makes before it writes; the flag's value lets it through.
    study = load_study(path)
    with pytest.raises(UnderpoweredStudy):
        check_power(study)
    check_power(study, allow_underpowered=True)


def test_power_sizes_seeds_from_a_declared_sd(tmp_path, capsys):
    path = write_study(tmp_path, text=CONFIRMATORY.format(name="tiny", steps=6))
    assert main(["power", str(path), "--sd", "0.012"]) == 0
    out = capsys.readouterr().out
    # Paired t: statsmodels TTestPower().solve_power(0.02 / 0.012, power=0.8 | 0.9, alpha=0.05) = 5.05 | 6.02 -> 6 | 7.
    # Sign flip, which decides the verdict: at 6 seeds only the two one-sign patterns reach p = 2/64 <= 0.05, so
    # its power is Phi(5/3)**6 + Phi(-5/3)**6 = 0.745 < 0.8 by hand; at 7 it is 0.93 (checked against brute-force
    # enumeration in tests/results/test_results_power.py). 2 seeds now: the floor 2/4 > 0.05, exactly 0.
    assert ("main (superiority; mei 0.02; SD 0.012; family 'default' of 1, holm, level 0.05): power now 0% "
            "(sign flip, exact: the floor exceeds the level; paired t 15%) with 2 seeds; seeds for 80%: 7, 90%: 7 "
            "(paired t: 6, 7); sign-flip floor needs 6; recommended 7\n") in out
    assert "Monte Carlo over 20000 normal draws of the deltas" in out
    # one of --sd and --pilot is required, and the usage says so (issue 35, item 13)
    with pytest.raises(SystemExit) as exit_:
        main(["power", str(path), "--help"])
    assert exit_.value.code == 0 and "(--sd SD | --pilot PILOT_SPEC | --task-gain GAIN)" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_:
        main(["power", str(path)])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "error: one of the arguments --sd --pilot --task-gain is required" in err


def test_power_from_a_pilot_reads_its_paired_deltas(tmp_path, capsys):
    import numpy as np
    import pandas as pd

    from reslab.results.collect import cache_path

    path = write_study(tmp_path, text=CONFIRMATORY.format(name="tiny", steps=6))
    study = load_study(path)
    ws = Workspace.at(tmp_path / "ws")
    deltas = {0: -0.030, 1: -0.010}
    rows = [{"run_id": r.run_id, "arm": r.arm, "grid_key": r.grid_key, "seed": r.seed, "status": "FINISHED",
             "val_loss_tail": 3.0 + r.seed + (deltas[r.seed] if r.arm == "attnres" else 0.0)} for r in expand(study)]
    target = cache_path(ws.cache, study.name)
    target.parent.mkdir(parents=True)
    pd.DataFrame(rows).to_parquet(target)
    assert main(["power", str(path), "--pilot", str(path), "--cached", "--workspace", str(ws.root)]) == 0
    out = capsys.readouterr().out
    sd = float(np.std(list(deltas.values()), ddof=1))  # 0.01414
    assert f"paired SD pooled over its rows {sd:.3g}" in out
    assert f"SD {sd:.3g};" in out


def test_power_sizes_a_studys_tasks_in_seeds_and_items(tmp_path, capsys):
    """`power --task-gain`: per declared task, the power now and the seeds and items for 80% and 90%, at alpha /
    the number of tasks (the figures are `results.power.task_power`'s, which tests/results/test_task_power.py
    checks against simulated studies); a missing --seed-sd is one line."""
    from reslab.results.power import TaskVariance, task_power

    text = TINY_STUDY.format(name="tiny", steps=6) + "evals: {tasks: [reslab_next_line, other_task], limit: 1000}\n"
    path = write_study(tmp_path, text=text)
    assert main(["power", str(path), "--task-gain", "0.04", "--seed-sd", "0.01", "--item-share", "0.02"]) == 0
    out = capsys.readouterr().out
    assert "alpha / 2 task(s) = 0.025" in out
    r = task_power("other_task", 0.04, TaskVariance.of_accuracy(0.04, 0.01, 0.5, 0.02), 2, 1000, 0.025)
    # at 2 seeds the seeds' part has 1 df: no item count reaches 80%, and the line says so
    assert r.seeds_80 is not None and r.items_80 is None
    assert (f"  other_task: power now {100 * r.power_now:.0f}% with 2 seeds x 1000 items; seeds for 80%: "
            f"{r.seeds_80}, 90%: {r.seeds_90} (at 1000 items); items for 80%: unreachable (the seeds' variance "
            "alone is too wide)") in out
    assert main(["power", str(path), "--task-gain", "0.04"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--seed-sd: required with --task-gain" in err


def test_power_simulates_a_gates_study_against_the_full_ladder(capsys):
    """`reslab power` on a gates study (issue 54): its plan and the full ladder through `results.gates_power`, the
    rows the library gives for the same seed and reps, and a one-line error for a wrong --losses."""
    from pathlib import Path

    import numpy as np

    from reslab.experiments.budget import budgets_by_point
    from reslab.experiments.expand import rung_keys
    from reslab.results.gates_power import gates_power, gates_scenarios

    spec = str(Path(__file__).resolve().parents[2] / "experiments" / "gates_cpu.yaml")
    assert main(["power", spec, "--sd", "0.01", "--losses", "2.4,2.2,2.05", "--reps", "4", "--seed", "3"]) == 0
    out = capsys.readouterr().out
    study = load_study(spec)
    gates = study.gates
    budgets = budgets_by_point(expand(study, study.seeds[:1]))
    compute = np.array([budgets[gates.control, key][0].flops for key in rung_keys(study, study.scope_points()[0])])
    rows = gates_power(gates.plan, gates_scenarios(gates.plan, compute, np.array([2.4, 2.2, 2.05]), 0.01 / 2**0.5),
                       reps=4, seed=3)
    for r in rows:
        g, f = r.gates, r.fixed
        assert (f"| {r.scenario} | {r.true_k[0]:.3g} | gates | {g.promoted:.3f} | {g.dropped:.3f} | "
                f"{g.undecided:.3f} | {g.wrong_promotion:.3f} | {g.wrong_drop:.3f} | {g.mean_compute:.3g} | "
                f"{r.saved:+.0%} |") in out
        assert f"| {r.scenario} | {r.true_k[0]:.3g} | full ladder | {f.promoted:.3f} |" in out
    assert main(["power", spec, "--sd", "0.01", "--losses", "2.4,2.2"]) == 2
    assert capsys.readouterr().err.startswith("reslab: error: --losses: 2 value(s) for a ladder of 3 rungs")
