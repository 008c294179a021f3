"""A study's declared costs through the commands that read a study out (`compare`, `export`, `report`), on a
cached runs table (no training): the ratio rows are printed and exported, and a cost the runs never recorded
(a store written before reslab measured serving cost) is one line naming what they did record, exit 2."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
from orch_helpers import TINY_STUDY, write_study
from scipy import stats as sps

from reslab.experiments import expand, load_study
from reslab.orchestrator.cli import main
from reslab.orchestrator.durability.workspace import Workspace
from reslab.results.collect import cache_path

SPEED = {"control": 100.0, "attnres": 90.0}


def cached_study(tmp_path, costs: str, record: dict[str, float]) -> list[str]:
    """The tiny study declaring `costs`, its runs finished in the workspace's cache with `record` (metric ->
    the control's value at seed 0; the treatment's is 0.9 of it, seed 1's 1% and 2% more) besides the loss;
    the commands' common arguments."""
    path = write_study(tmp_path, text=TINY_STUDY.format(name="tiny", steps=6) + f"costs: {costs}\n")
    study = load_study(path)
    ws = Workspace.at(tmp_path / "ws")
    rows = [{"run_id": r.run_id, "arm": r.arm, "grid_key": r.grid_key, "seed": r.seed, "status": "FINISHED",
             "val_loss_tail": 3.0 + 0.01 * r.seed - 0.02 * (r.arm == "attnres"),
             **{m: v * (0.9 * (1 + 0.02 * r.seed) if r.arm == "attnres" else 1 + 0.01 * r.seed)
                for m, v in record.items()}}
            for r in expand(study)]
    target = cache_path(ws.cache, study.name)
    target.parent.mkdir(parents=True)
    pd.DataFrame(rows).to_parquet(target)
    return [str(path), "--workspace", str(ws.root), "--cached"]


def test_compare_and_export_show_the_cost_rows(tmp_path, capsys):
    args = cached_study(tmp_path, "[decode_tps]", {"decode_tps": 100.0})
    assert main(["compare", *args]) == 0
    out = capsys.readouterr().out
    costs = out[out.index("cost decode_tps (tokens/s), higher is better"):]
    line = next(x for x in costs.splitlines() if x.startswith("main"))
    logs = np.log([0.9, 0.9 * 1.02 / 1.01])  # seeds 0 and 1
    half = sps.t.ppf(0.975, 1) * logs.std(ddof=1) / math.sqrt(2)
    ratio = f"{math.exp(logs.mean()):.3f} [{math.exp(logs.mean() - half):.3f}, {math.exp(logs.mean() + half):.3f}]"
    assert ratio == "0.904 [0.850, 0.963]" and ratio in line and line.endswith("0/2  slower"), line
    assert main(["export", *args, "--format", "csv", "-o", str(tmp_path / "t.csv")]) == 0
    table = pd.read_csv(tmp_path / "t.csv")
    cost = table[table["role"] == "cost"].iloc[0]
    assert cost["metric"] == "decode_tps" and math.isclose(cost["ratio"], math.sqrt(0.9 * 0.9 * 1.02 / 1.01))
    assert cost["verdict"] == "slower" and cost["n"] == 2


def test_a_cost_the_runs_did_not_record_is_one_line(tmp_path, capsys):
    args = cached_study(tmp_path, "[decode_tps, tokens_per_s]", {"tokens_per_s": 1000.0})
    for command in (["compare"], ["export", "--format", "md", "-o", str(tmp_path / "t.md")],
                    ["report", "-o", str(tmp_path / "r.html")]):
        assert main([command[0], *args, *command[1:]]) == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0, err
        assert err.startswith("reslab: error: study tiny: costs: decode_tps was not recorded by any of its 4 "
                              "finished runs"), err
        assert "the runs recorded: tokens_per_s." in err
    assert not (tmp_path / "t.md").exists() and not (tmp_path / "r.html").exists()
