"""The research loop of `examples/research_loop/` end to end on one local Ray instance, through `reslab.api`: its
proposals' verdicts, the control's runs trained once and shared, and the compute budget's bound."""

from __future__ import annotations

import importlib.util
import io
import itertools
import json
import sys
from pathlib import Path

import numpy as np
import pytest

import reslab.api as rl
from reslab.results.verdict import DECISIONS

LOOP = Path(__file__).resolve().parents[2] / "examples" / "research_loop" / "loop.py"


def _loop_module():
    spec = importlib.util.spec_from_file_location("research_loop", LOOP)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["research_loop"] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _seed_deltas(runs_dir: Path, seeds: tuple[int, ...]) -> np.ndarray:
    """Per seed, treatment - control of `val_loss_tail`, read from each run folder's spec.json and summary.json."""
    value: dict[tuple[str, int], float] = {}
    for d in runs_dir.iterdir():
        spec = json.loads((d / "spec.json").read_text())
        value["control" if spec["arm"] == "control" else "treatment", spec["seed"]] = json.loads(
            (d / "summary.json").read_text())["summary"]["val_loss_tail"]
    return np.array([value["treatment", s] - value["control", s] for s in seeds])


@pytest.mark.slow
def test_the_research_loop_asks_for_verdicts_within_its_compute_budget(tmp_path):
    loop = _loop_module()
    seeds, per_run = loop.SEEDS, loop.TOKENS_PER_RUN
    # the first proposal trains both arms; the second would train only its treatment (the control's runs are
    # the first's), which is one run more than the budget has left
    budget = (2 * seeds + seeds - 1) * per_run
    ws = str(tmp_path / "ws")
    log = io.StringIO()
    with rl.ray_session(num_cpus=2, workspace=ws):
        rows = loop.run_loop(ws, budget, seed=0, log=log)
    tried = [r for r in rows if r.decision != "not run"]
    assert [r.new_runs for r in rows] == [2 * seeds, seeds], loop.table(rows, budget)
    assert len(tried) == 1 and rows[-1].tokens == 0 and not rows[-1].kept
    spent = sum(r.tokens for r in rows)
    assert spent == 2 * seeds * per_run <= budget < spent + rows[-1].new_runs * per_run
    runs_dir = Path(ws) / "runs" / "research-loop"
    assert len([d for d in runs_dir.iterdir() if d.name.startswith("prenorm-")]) == seeds
    assert len(list(runs_dir.iterdir())) == 2 * seeds
    assert not tried[0].exploratory  # the first submission froze the study's analysis plan

    for row in tried:
        assert row.decision in DECISIONS and row.kept == (row.decision == "better")
        study = loop.study_of(row.knobs)
        # the verdict read every seed pair, and says the same as the paired table `reslab compare` prints
        report = rl.verdict(study, workspace=ws)
        (v,) = report.verdicts
        assert (v.decision, v.estimate, (v.low, v.high)) == (row.decision, row.estimate, row.interval)
        assert len(v.seeds) == seeds and v.compute.runs == 2 * seeds and report.plan.frozen
        # independent of the readouts: the deltas from the run folders, the exact two-sided sign flip by brute force
        deltas = _seed_deltas(runs_dir, v.seeds)
        assert v.estimate == pytest.approx(float(np.mean(deltas)), abs=1e-9)
        flips = np.array(list(itertools.product((-1.0, 1.0), repeat=seeds)))
        p = float(np.mean(np.abs(flips @ deltas) >= abs(deltas.sum()) - 1e-12))
        assert v.p_value == pytest.approx(p)
        (table_row,) = rl.compare(study, workspace=ws).to_dict("records")
        assert table_row["mean_delta"] == pytest.approx(v.estimate) and table_row["n"] == seeds
        assert row.interval is not None and row.interval[0] <= row.estimate <= row.interval[1]
        assert rl.status(study, workspace=ws).counts()["succeeded"] == 2 * seeds

    text = loop.table(rows, budget).splitlines()
    assert text[0].split()[:3] == ["proposal", "decision", "kept"] and len(text) == len(rows) + 2
    assert text[-1].startswith(f"compute: {spent:,} of {budget:,} training tokens spent; kept "
                               f"{sum(r.kept for r in rows)} of 1 proposals tried")
    assert "not run" in text[-2] and "succeeded" in log.getvalue()  # the drivers' output went to the log
