"""The workspace's ledger of tries (issue 55 item 4): a comparison is keyed by its content, so the same comparison
under another study name or other arm names is one key; a re-submission is not a new try, a replicate (or another
count) is; two writers at once lose nothing; a line a crash cut short is skipped. No training: the ledger is
recorded from the study alone (`submit.record_study_tries`, what `submit` calls first)."""

from __future__ import annotations

import multiprocessing
from pathlib import Path

from reslab.experiments.spec import parse_study
from reslab.orchestrator.driving.submit import record_study_tries
from reslab.orchestrator.durability.ledger import ledger_path, read_ledger, record_tries, tries_of
from reslab.orchestrator.durability.workspace import Workspace

BASE = {"model": {"preset": "tiny", "d_model": 32, "seq_len": 32, "n_layers": 2}, "optim": {"batch_size": 4},
        "train": {"steps": 6}}


def study(name: str, seeds, control: str = "control", treatment: str = "attnres", metric: str = "val_loss_tail",
          lr: float = 1e-3):
    data = {"study": name, "base": {**BASE, "optim": {**BASE["optim"], "lr": lr}},
            "arms": {control: "prenorm", treatment: {"residual": "attnres"}}, "seeds": seeds,
            "comparisons": [{"name": f"{name}-cmp", "control": control, "metric": metric, "exploratory": True}]}
    return parse_study(data, Path(f"{name}.yaml"))


def keys(ws: Workspace) -> set[str]:
    return {r["key"] for r in read_ledger(ws.root)}


def test_the_same_comparison_under_other_names_is_one_key_and_its_seeds_one_try(tmp_path):
    ws = Workspace(tmp_path)
    assert record_study_tries(study("first", 3), ws) == 1
    assert record_study_tries(study("second", 3, control="base", treatment="routed"), ws) == 1
    (key,) = keys(ws)
    (one,) = tries_of(ws.root, [key])[key]  # same seeds: the same runs' data, not a new try
    assert one.number == 1 and one.design == "3 seeds, replicate 0"
    assert one.studies == (("first", "first-cmp", "attnres"), ("second", "second-cmp", "routed"))


def test_a_resubmission_is_not_a_new_try_and_a_replicate_or_another_count_is(tmp_path):
    ws = Workspace(tmp_path)
    first = study("s", 3)
    assert record_study_tries(first, ws) == 1
    assert record_study_tries(first, ws) == 0  # resumed or re-submitted: nothing new
    record_study_tries(study("s-again", {"count": 3, "replicate": 1}), ws)
    record_study_tries(study("s-more", 5), ws)
    record_study_tries(study("s-seq", {"sequential": {"start": 2, "batch": 1, "max": 3}}), ws)
    (key,) = keys(ws)
    tries = tries_of(ws.root, [key])[key]
    assert [(t.number, t.design) for t in tries] == [
        (1, "3 seeds, replicate 0"), (2, "3 seeds, replicate 1"), (3, "5 seeds, replicate 0"),
        (4, "sequential (start 2, batch 1, max 3), replicate 0")]


def test_another_config_or_metric_is_another_comparison(tmp_path):
    ws = Workspace(tmp_path)
    record_study_tries(study("a", 2), ws)
    record_study_tries(study("b", 2, lr=2e-3), ws)
    record_study_tries(study("c", 2, metric="val_loss"), ws)
    assert len(keys(ws)) == 3
    assert tries_of(ws.root, ["never"]) == {"never": []}


def _append(root: str, writer: int, count: int) -> None:
    for i in range(count):
        record_tries(Path(root), [{"key": f"k{writer}", "try": f"t{i}", "study": f"w{writer}", "comparison": "c",
                                   "treatment": "t", "point": "", "metric": "m", "design": "d", "replicate": i}])


def test_two_writers_at_once_lose_nothing(tmp_path):
    ctx = multiprocessing.get_context("fork")
    writers = [ctx.Process(target=_append, args=(str(tmp_path), w, 150)) for w in range(2)]
    for p in writers:
        p.start()
    for p in writers:
        p.join(timeout=120)
        assert p.exitcode == 0
    lines = ledger_path(tmp_path).read_text().splitlines()
    assert len(lines) == 300 and len(read_ledger(tmp_path)) == 300
    got = tries_of(tmp_path, ["k0", "k1"])
    assert [t.id for t in got["k0"]] == [f"t{i}" for i in range(150)] == [t.id for t in got["k1"]]


def test_a_line_cut_short_is_skipped_and_the_next_append_starts_a_new_line(tmp_path):
    _append(str(tmp_path), 0, 1)
    with open(ledger_path(tmp_path), "a") as f:
        f.write('{"key": "k0", "try": "cut')  # a crash mid-line
    _append(str(tmp_path), 1, 1)
    assert [r["key"] for r in read_ledger(tmp_path)] == ["k0", "k1"]
