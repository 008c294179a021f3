"""`reslab plan` and `reslab status` on a sequential study (issue 35, item 14): the looks, what is decided and
the most that can still run, read from run directories (finished runs written here, nothing trained)."""

from __future__ import annotations

import textwrap

import pytest

from reslab.experiments import expand, load_study
from reslab.orchestrator.cli import main
from reslab.orchestrator.driving.sequential import where_it_stands
from reslab.orchestrator.durability.workspace import Workspace, write_json
from reslab.orchestrator.tasks import SUCCESS

STUDY = """
study: seqplan
base:
  model: {preset: tiny, d_model: 32, n_layers: 2, n_heads: 2, n_kv_heads: 2, ffn_hidden: 64, seq_len: 32}
  optim: {batch_size: 4}
  train: {steps: 6, device: cpu}
arms:
  still: {residual: prenorm, optim: {lr: 1.0e-6}}
  moving: prenorm
seeds: {sequential: {start: 4, batch: 2, max: 10, test: t}}  # the t e-process decides at 6 seeds
comparisons:
  - {name: lr, control: still, treatments: [moving], metric: val_loss}
"""


@pytest.fixture
def study(tmp_path):
    path = tmp_path / "seqplan.yaml"
    path.write_text(textwrap.dedent(STUDY))
    return path, load_study(path), Workspace(tmp_path / "ws")


def _finish(ws: Workspace, runs, seeds: range) -> None:
    """Finished run directories for `seeds`: `moving` 1.0 nat below `still`, nearly the same every seed (a large,
    steady effect: undecided at 4 seeds, where the e-process cannot reach 1/alpha, decided at 6)."""
    for r in runs:
        if r.seed in seeds:
            rd = ws.run_dir(r.study, r.run_id)
            rd.path.mkdir(parents=True, exist_ok=True)
            loss = (4.0 if r.arm == "moving" else 5.0) + 0.001 * r.seed
            write_json(rd.summary_file, {"summary": {"val_loss": loss}, "info": {}})
            rd.set_status(SUCCESS)


def _cli(capsys, *argv: str) -> str:
    assert main(list(argv)) == 0
    return capsys.readouterr().out


def test_mid_study_status_and_plan_show_the_look_in_progress_and_the_most_left(study, capsys):
    path, spec, ws = study
    runs = expand(spec)
    assert len(runs) == 20
    _finish(ws, runs, range(4))  # the first look ran; undecided: the look at 6 seeds is in progress

    looks = where_it_stands(spec, runs, ws)
    assert (looks.read, looks.current, len(looks.pending), len(looks.later), looks.most) == ([4], 6, 4, 8, 12)

    out = _cli(capsys, "status", str(path), "--workspace", str(ws.root))
    assert "seqplan: 20 runs: 8 succeeded, 0 running, 0 failed, 4 to run, 8 later look, 0 not needed" in out
    assert "sequential: looks at 4 (read), [6], 8, 10 seeds" in out
    assert "lr: moving vs still: undecided after 4 seeds, mean delta -1" in out
    assert "now: the look at 6 seeds, 4 of its runs not finished; at most 12 run(s) can still run (8 in later looks" \
        in out

    out = _cli(capsys, "plan", str(path), "--workspace", str(ws.root))
    assert "seqplan: 20 runs: 12 to run, 8 to skip, 0 busy elsewhere; 8 of those to run are in later looks" in out
    assert out.count("later look, only if still undecided; new") == 8
    assert "(a sequential study: the budget counts its maximum, 10 seeds" in out


def test_a_decided_study_has_nothing_left_to_run(study, capsys):
    path, spec, ws = study
    runs = expand(spec)
    _finish(ws, runs, range(6))  # the look at 6 seeds decides: the other 8 runs are never needed

    looks = where_it_stands(spec, runs, ws)
    assert (looks.read, looks.current, looks.most) == ([4, 6], None, 0)
    assert looks.table.iloc[0]["decision"] == "better"

    out = _cli(capsys, "status", str(path), "--workspace", str(ws.root))
    assert "seqplan: 20 runs: 12 succeeded, 0 running, 0 failed, 0 to run, 0 later look, 8 not needed" in out
    assert "lr: moving vs still: better after 6 seeds" in out and "done: every row decided; no run is left" in out
    assert "ETA" not in out

    out = _cli(capsys, "plan", str(path), "--workspace", str(ws.root))
    assert "seqplan: 20 runs: 0 to run, 20 to skip, 0 busy elsewhere\n" in out
    assert out.count("not needed: the rows that need it are decided") == 8


def test_a_fixed_study_keeps_its_status(study, capsys, tmp_path):
    """The sequential words appear for a sequential study only."""
    fixed = tmp_path / "fixed.yaml"
    fixed.write_text(textwrap.dedent(STUDY).replace("{sequential: {start: 4, batch: 2, max: 10, test: t}}", "2"))
    out = _cli(capsys, "status", str(fixed), "--workspace", str(tmp_path / "ws"))
    assert "seqplan: 4 runs: 0 succeeded, 0 running, 0 failed, 4 to run\n" in out and "sequential" not in out
