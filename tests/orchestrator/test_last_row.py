"""A report reads each run's last diagnostics row from the file's end (`workspace.read_last_row`) and builds
the depth profiles over seeds without parsing every row or keeping a row per value (`gather.read_records`;
issue 39). The reference for both is the whole file read by `read_jsonl`, as the readouts read it before, and
for the profiles pandas' groupby over one long row per recorded value."""

from __future__ import annotations

import json
import logging

import numpy as np
import pandas as pd
import pytest
from orch_helpers import write_study

from reslab.common.forks import Forked
from reslab.experiments import expand, load_study
from reslab.orchestrator.durability.workspace import Workspace, read_jsonl, read_last_row
from reslab.orchestrator.gathering.gather import read_records
from reslab.results.readouts.base import PROFILE_COLUMNS

ROW = {"step": 1, "x": [0.5, None]}
BIG = {"step": 9, "blob": "y" * 200_000}  # one line past several of the reader's 64 KiB blocks


def _line(row) -> str:
    return json.dumps(row) + "\n"


CASES = {
    "one row": _line(ROW),
    "several rows": _line(ROW) + _line({"step": 2}) + _line({"step": 3, "z": {"a": 1}}),
    "a torn last line": _line(ROW) + _line({"step": 2}) + '{"step": 3, "z',
    "a blank last line": _line(ROW) + _line({"step": 2}) + "\n",
    "broken JSON last": _line(ROW) + _line({"step": 2}) + "{nope}\n",
    "a row of the wrong shape last": _line(ROW) + _line({"step": 2}) + _line({"step": "3"}),
    "no newline at all": '{"step": 1}',
    "empty": "",
    "only a torn line after a big one": _line(BIG) + '{"ste',
    "a big last row": _line(ROW) + _line(BIG),
    "bytes that are not UTF-8 last": _line(ROW) + '{"step": 2, "s": "\udcff"}\n',
}


@pytest.mark.parametrize("text", CASES.values(), ids=CASES.keys())
def test_the_last_row_read_from_the_end_is_the_whole_files_last_row(tmp_path, text, caplog):
    path = tmp_path / "diagnostics.jsonl"
    path.write_bytes(text.encode("utf-8", "surrogateescape"))
    with caplog.at_level(logging.WARNING):
        whole = read_jsonl(path)
    warned = [r.getMessage() for r in caplog.records]
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        assert read_last_row(path) == (whole[-1] if whole else None)
    if warned and text.rstrip("\n").rsplit("\n", 1)[-1] in ("{nope}", '{"step": "3"}'):
        assert [r.getMessage() for r in caplog.records] == warned  # a bad last line is named, as a whole read does


def test_no_file_is_no_row(tmp_path):
    assert read_last_row(tmp_path / "absent.jsonl") is None


STUDY = """
study: last
base:
  model: {preset: tiny}
  optim: {batch_size: 2}
  train: {steps: 40, eval_every: 10}
arms:
  control: prenorm
  attnres: {residual: attnres}
seeds: 3
comparisons:
  - {control: control, exploratory: true}
"""


def _diagnostics(step: int, seed: int) -> dict:
    return {"step": step, "magnitudes": {"in_rms": [step + seed, 2.0], "out_rms": [1.0, None, 3.0 * seed],
                                         "grad_norm": [0.1 * step]},
            "moe": {"layers": [0, 1], "fraction": [[0.25, 0.75], [0.5, 0.5]]},
            "effective_depth": {"d_eff": 1.0 + step / 100, "f_l": 1.6}}


def _profile_rule(study, runs, workspace) -> pd.DataFrame:
    """The depth profiles from every row of every run: one long row per recorded value (a MoE layer's most loaded
    expert's share x experts as `moe_max_load`), per grid point the rows at the last step every run there
    reached, then per arm, quantity and index pandas' mean, min and max, and the seeds with a value."""
    rows = []
    for run in runs:
        for d in workspace.run_dir(study.name, run.run_id).diagnostics():
            key = (run.arm, run.grid_key, run.seed, d["step"])
            rows += [(*key, q, i, float(v)) for q, values in d["magnitudes"].items()
                     for i, v in enumerate(values) if v is not None]
            rows += [(*key, "moe_max_load", layer, max(f) * len(f))
                     for layer, f in zip(d["moe"]["layers"], d["moe"]["fraction"], strict=True)]
    long = pd.DataFrame(rows, columns=["arm", "grid_key", "seed", "step", "quantity", "index", "value"])
    common = long.groupby(["grid_key", "arm", "seed"])["step"].max().groupby("grid_key").min()
    at = long[long["step"] == long["grid_key"].map(common)]
    profile = at.groupby(["grid_key", "arm", "quantity", "index"])["value"].agg(["mean", "min", "max"]).reset_index()
    seeds = at.groupby(["grid_key", "arm", "quantity"])["seed"].nunique().rename("seeds").reset_index()
    profile = profile.merge(seeds).assign(step=lambda f: f["grid_key"].map(common))
    return profile[list(PROFILE_COLUMNS)].sort_values(["grid_key", "arm", "quantity", "index"], ignore_index=True)


@pytest.mark.parametrize("stopped", [None, 20], ids=["every run finished", "one run stopped at step 20"])
def test_the_depth_profiles_are_the_runs_at_the_last_step_every_run_reached(tmp_path, stopped):
    study = load_study(write_study(tmp_path, text=STUDY))
    runs = expand(study)
    workspace = Workspace(tmp_path / "ws")
    for i, run in enumerate(runs):
        rd = workspace.run_dir(study.name, run.run_id)
        rd.path.mkdir(parents=True)
        last = stopped if (stopped and i == 1) else 40
        rd.diagnostics_file.write_text("".join(_line(_diagnostics(s, run.seed)) for s in range(10, last + 1, 10))
                                       + ('{"step": 50, "magn' if i == 2 else ""))  # a torn line: never a row
    records = read_records(study, runs, workspace)
    got = records.depth_profiles.sort_values(["grid_key", "arm", "quantity", "index"], ignore_index=True)
    want = _profile_rule(study, runs, workspace)
    keys = ["grid_key", "step", "arm", "quantity", "seeds", "index"]
    assert got[keys].values.tolist() == want[keys].values.tolist()
    stats = ["mean", "min", "max"]
    np.testing.assert_allclose(got[stats].to_numpy(float), want[stats].to_numpy(float), rtol=1e-12)
    assert set(got["step"]) == {stopped or 40} and set(got["seeds"]) == {3}
    assert sorted(records.depths["d_eff"]) == sorted(1.0 + (stopped if (stopped and i == 1) else 40) / 100
                                                     for i in range(len(runs)))
    # `reslab report` on a large study reads them in a forked copy (`gather.study_data`): the same records
    forked = Forked(lambda: read_records(study, runs, workspace)).value()
    for name in ("evals", "depths", "depth_profiles"):
        pd.testing.assert_frame_equal(getattr(forked, name), getattr(records, name))
