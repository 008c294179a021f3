"""The dashboard shows the study: headless Chromium against `reslab dashboard`, driven over its DevTools
protocol as a user clicks. "Group by" -> arm on the runs page shows one group per arm with its runs; the
link `reslab dashboard` prints opens the same grouping (the experiment's saved view) in the "Model training"
view; a child run's metrics tab opens on its curves (the summary is tags, not single-point charts); the
parent run shows the study's result artifacts, and the experiment's description (on its runs page) the paired
table with a link to the report; one parent per submission that did something. Names, tags,
params and experiment tags are read from the REST API the page itself calls."""

from __future__ import annotations

import asyncio
import base64
import importlib.util
import io
import json
import os
import re
import signal
import zlib
from collections import Counter
from pathlib import Path

import pytest
from cdp_helpers import open_page
from orch_helpers import write_study
from test_dashboard import api, free_port, serve_dashboard
from test_report import CHROMIUM, chromium

from reslab.experiments import expand, load_study
from reslab.orchestrator.dispatch.local_backend import LocalBackend
from reslab.orchestrator.driving.submit import submit
from reslab.orchestrator.gathering.gather import publish_result
from reslab.orchestrator.tracking.guarded import GuardedTracker
from reslab.orchestrator.tracking.views import (
    BY_ARM_VIEW_NAME,
    BY_ARM_VIEW_TAG,
    EXPERIMENT_KIND,
    EXPERIMENT_KIND_TAG,
    study_view_url,
)

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]

# The preset's sizes are left unset (only seq_len is shortened): params must show them resolved.
STUDY = """
study: dash
base:
  model: {preset: tiny, seq_len: 32}
  optim: {batch_size: 4, warmup_steps: 2, lr: 3.0e-3}
  train: {steps: 6, eval_every: 3, log_every: 1, eval_windows: 8, tail_k: 2, checkpoint_every: 3}
  cost: {measure: false}
arms:
  control: prenorm
  attnres: {residual: attnres}
seeds: 2
comparisons:
  - {name: main, control: control, treatments: [attnres], exploratory: true}
"""


def submit_and_publish(study, runs, workspace) -> str | None:
    """What `reslab run` does (cli/study.py `_submit_study`), with the in-process backend: the study's result
    published on the parent run before the submission ends it."""
    tracker = GuardedTracker(workspace.default_tracking_uri(), workspace)

    def publish(result):
        result.published = publish_result(study, result.runs, workspace, tracker, result.result_key)

    tracker.publisher = publish
    result = submit(study, runs, workspace, LocalBackend(), tracker, stream=io.StringIO(),
                    say=lambda *_: None)
    return result.parent_run_id


# The runs table's rows (the pinned name column), in display order, as their text.
ROWS = """[...document.querySelectorAll('.ag-pinned-left-cols-container .ag-row')]
  .sort((a, b) => a.getAttribute('row-index') - b.getAttribute('row-index')).map(r => r.innerText)"""
GROUPED = f"(() => {{ const rows = {ROWS}; return rows.some(t => t.includes('Group: ')) && rows; }})()"
HEADERS = "[...document.querySelectorAll('[role=columnheader]')].map(e => e.innerText.trim())"
GROUP_BY_BUTTON = "[...document.querySelectorAll('button')].find(b => b.innerText.trim().startsWith('Group by'))"
ARM_ITEM = "[...document.querySelectorAll('[role=menu] [role^=menuitem]')].find(e => e.innerText.trim() === 'arm')"
EXPECTED_GROUPS = {"attnres": ["attnres/s0", "attnres/s1"], "control": ["control/s0", "control/s1"],
                   "Additional runs": []}  # the submission's parent run, which has no arm, collapsed


def groups(rows: list[str]) -> dict[str, list[str]]:
    """{group: its run names} from the rows' text: a group row reads "Group: <arm>" (or "Additional runs")."""
    out: dict[str, list[str]] = {}
    current = None
    for row in rows:
        lines = [line.strip() for line in row.splitlines()]
        head = next((line for line in lines if line.startswith("Group: ") or line == "Additional runs"), None)
        if head is not None:
            current = head.removeprefix("Group: ")
            out[current] = []
            continue
        name = next(line for line in lines if re.fullmatch(r"\w+(/[^/\s]+)*/s\d+", line))
        assert current is not None, rows
        out[current].append(name)
    return {group: sorted(names) for group, names in out.items()}


def chart_sections(text: str) -> list[tuple[str, int]]:
    """The run page's chart sections as (name, chart count): a section header reads "<name>" then "(<n>)"."""
    lines = [line.strip() for line in text.splitlines()]
    return [(lines[i - 1], int(line[1:-1])) for i, line in enumerate(lines) if i and re.fullmatch(r"\(\d+\)", line)]


async def browse(base: str, exp_id: str, child: dict, tmp_path: Path) -> None:
    runs_page = f"{base}/#/experiments/{exp_id}/runs?workflowType=machine_learning"
    async with open_page(tmp_path / "profile-click") as page:  # a user who opens the runs page and groups
        await page.goto(runs_page)
        await page.wait_for(f"{ROWS}.some(t => t.includes('submission '))")
        await page.click(GROUP_BY_BUTTON)
        await page.click(ARM_ITEM)
        assert groups(await page.wait_for(GROUPED)) == EXPECTED_GROUPS
    async with open_page(tmp_path / "profile-link") as page:  # a fresh browser on the link reslab prints
        await page.goto(study_view_url(base, exp_id))
        assert groups(await page.wait_for(GROUPED)) == EXPECTED_GROUPS
        headers = await page.wait_for(f"(() => {{ const h = {HEADERS}; return h.includes('val_loss_tail') && h; }})()")
        assert {"val_loss", "val_loss_tail", "seed", "grid_key"} <= set(headers), headers
        await page.screenshot(tmp_path / "dashboard.png")

        metrics = sorted(m["key"] for m in child["data"]["metrics"])
        # MLflow sections a run's charts by the key's prefix (`mag/grad_norm/s00` under "mag/grad_norm", titled
        # "s00"); keys without one are in "Model metrics"
        sections = Counter(m.rsplit("/", 1)[0] if "/" in m else "Model metrics" for m in metrics)
        titles = sorted({m.rsplit("/", 1)[-1] for m in metrics})
        await page.goto(f"{base}/#/experiments/{exp_id}/runs/{child['info']['run_id']}/model-metrics"
                        "?workflowType=machine_learning")
        # charts render as they scroll into view: wait until a chart title (a metric name) follows the section's
        # controls ("Add chart", sometimes "Add section" first)
        text = await page.wait_for(
            f"(() => {{ const t = document.body.innerText, names = {json.dumps(titles)}; "
            "const lines = t.split('\\n').map(l => l.trim()), i = lines.indexOf('Add chart'); "
            "return i >= 0 && lines.slice(i + 1).some(l => names.includes(l)) && t; })()")
        assert dict(chart_sections(text)) == dict(sections), text[:2000]
        assert "summary/" not in text
        await page.wait_for("document.body.innerText.includes('Step')")  # a chart drawn (its x axis), for the picture
        await page.screenshot(tmp_path / "run_metrics.png")


@pytest.mark.skipif(CHROMIUM is None, reason="headless Chromium is not installed (Debian: apt-get install chromium)")
@pytest.mark.skipif(importlib.util.find_spec("aiohttp") is None, reason="aiohttp (Ray's) drives Chromium's DevTools")
def test_the_dashboard_shows_the_study_grouped_by_arm_and_the_parents_result(tmp_path, workspace):
    study = load_study(write_study(tmp_path, text=STUDY))
    runs = expand(study)
    parent = submit_and_publish(study, runs, workspace)
    assert parent is not None
    assert submit_and_publish(study, runs, workspace) is None  # a no-op re-run adds no empty parent

    port = free_port()
    log = tmp_path / "dashboard.out"
    proc = serve_dashboard(workspace, port, log)
    base = f"http://127.0.0.1:{port}"
    try:
        exp = api(f"{base}/api/2.0/mlflow/experiments/get-by-name?experiment_name=dash")["experiment"]
        exp_tags = {t["key"]: t["value"] for t in exp["tags"]}
        assert exp_tags[EXPERIMENT_KIND_TAG] == EXPERIMENT_KIND
        view = json.loads(exp_tags[BY_ARM_VIEW_TAG])
        state = json.loads(zlib.decompress(base64.b64decode(view["state"].removeprefix("deflate;"))))
        assert view["name"] == BY_ARM_VIEW_NAME and state["groupBy"]["groupByKeys"] == [{"mode": "tag",
                                                                                           "groupByData": "arm"}]
        assert f"  dash: {study_view_url(base, exp['experiment_id'])}" in log.read_text()

        found = api(f"{base}/api/2.0/mlflow/runs/search", {"experiment_ids": [exp["experiment_id"]],
                                                           "max_results": 100})["runs"]
        parents = [r for r in found if {"key": "reslab_kind", "value": "submission"} in r["data"]["tags"]]
        children = [r for r in found if r not in parents]
        assert [p["info"]["run_id"] for p in parents] == [parent]
        assert sorted(r["info"]["run_name"] for r in children) == ["attnres/s0", "attnres/s1", "control/s0",
                                                                   "control/s1"]
        by_id = {r.run_id: r for r in runs}
        for r in children:
            tags = {t["key"]: t["value"] for t in r["data"]["tags"]}
            params = {p["key"]: p["value"] for p in r["data"]["params"]}
            assert r["info"]["run_name"] == f"{tags['arm']}/s{tags['seed']}"
            assert (params["model.d_model"], params["model.n_layers"]) == ("64", "4")  # the tiny preset's
            summary = workspace.run_dir("dash", by_id[tags["run_id"]].run_id).summary()["summary"]
            assert float(tags["summary/val_loss_tail"]) == summary["val_loss_tail"]
            assert not [m for m in r["data"]["metrics"] if m["key"].startswith("summary/")]

        asyncio.run(browse(base, exp["experiment_id"], children[0], tmp_path))
        assert (tmp_path / "dashboard.png").stat().st_size > 0 and (tmp_path / "run_metrics.png").stat().st_size > 0

        artifacts = f"{base}/#/experiments/{exp['experiment_id']}/runs/{parent}/artifacts"
        dom = chromium(tmp_path, "--virtual-time-budget=30000", "--window-size=1400,900", "--dump-dom", artifacts)
        for name in ("paired_table.json", "paired_table.csv", "forest.png", "report.html"):
            assert name in dom, name
        # the first page a researcher opens shows the result: the experiment's description, rendered above its runs
        runs_page = f"{base}/#/experiments/{exp['experiment_id']}/runs?workflowType=machine_learning"
        dom = chromium(tmp_path, "--virtual-time-budget=30000", "--window-size=1400,900", "--dump-dom", runs_page)
        # the collapsed description's one line is the answer: each row's verdict and mean delta
        assert "Latest result: attnres vs control: " in dom and "delta [95% CI]" in dom and "<table" in dom, dom[-3000:]
        assert f'href="#/experiments/{exp["experiment_id"]}/runs/{parent}/artifacts/report.html"' in dom
    finally:
        os.kill(proc.pid, signal.SIGINT)
        proc.wait(60)


# Issue 52, item 14: a study with two treatments, arms that share a prefix and a grid, as a new user ran it.
PREFIX_STUDY = """
study: dash2
base:
  model: {preset: tiny, seq_len: 32}
  optim: {batch_size: 4, warmup_steps: 2, lr: 3.0e-3}
  train: {steps: 4, eval_every: 2, log_every: 1, eval_windows: 8, tail_k: 2, checkpoint_every: 2}
  cost: {measure: false}
arms:
  prenorm_adamw: prenorm
  prenorm_muon: {residual: prenorm, optim: {name: muon}}
  attnres: {residual: attnres}
grid:
  optim.lr: [0.001, 0.003]
seeds: 2
comparisons:
  - {name: main, control: prenorm_adamw, treatments: [prenorm_muon, attnres], exploratory: true}
"""
# every cell of the pinned run-name column: its text and whether it is cut (scrolls wider than it shows)
NAME_CELLS = """[...document.querySelectorAll('.ag-pinned-left-cols-container .ag-cell')]
  .map(c => [c.innerText.split('\\n').map(l => l.trim())
               .filter(l => l && !/^\\d+$/.test(l) && !l.startsWith('Pin ') && !l.startsWith('#')).join(' '),
             [c, ...c.querySelectorAll('*')].some(e => e.clientWidth > 1 && e.scrollWidth > e.clientWidth + 1)])
  .filter(([t]) => t)"""
# the collapsed description's headline: the lines its text takes on the page (1 when it is not clipped)
HEADLINE = """(() => { const w = document.createTreeWalker(document.body, NodeFilter.SHOW_TEXT);
  for (let n = w.nextNode(); n; n = w.nextNode()) if (n.textContent.startsWith('Latest result: ')) {
    const r = document.createRange(); r.selectNodeContents(n);
    return [n.textContent, new Set([...r.getClientRects()].map(b => Math.round(b.top))).size]; }
  return null; })()"""


def killed_earlier_run(workspace, experiment_name: str) -> str:
    """A run of an earlier, killed submission under other `--set` overrides, in the arm group of a run of this
    one, as a user's Ctrl-C'd `reslab run --set ...` leaves it: a KILLED parent holding a KILLED child with a
    partial curve. Written with MLflow's client (what that submission's writer leaves) rather than by killing
    a driver mid-run, which in-process would take the test's own process down."""
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=workspace.default_tracking_uri())
    exp = client.get_experiment_by_name(experiment_name).experiment_id
    parent = client.create_run(exp, run_name="submission (killed)", tags={"reslab_kind": "submission"})
    child = client.create_run(exp, run_name="prenorm_adamw/optim.lr=0.01/s0", tags={
        "reslab_kind": "run", "arm": "prenorm_adamw", "mlflow.parentRunId": parent.info.run_id})
    client.log_metric(child.info.run_id, "val_loss_tail", 99.0)
    for run in (child, parent):
        client.set_terminated(run.info.run_id, "KILLED")
    return child.info.run_id


async def browse_study(base: str, exp_id: str, tmp_path: Path) -> tuple[list, list]:
    async with open_page(tmp_path / "profile-study") as page:
        await page.goto(study_view_url(base, exp_id))
        rows = await page.wait_for(GROUPED)
        headline = await page.wait_for(HEADLINE)
        cells = await page.eval(NAME_CELLS)
        await page.screenshot(tmp_path / "dashboard_two_treatments.png")
    return [groups(rows), headline], cells


@pytest.mark.skipif(CHROMIUM is None, reason="headless Chromium is not installed (Debian: apt-get install chromium)")
@pytest.mark.skipif(importlib.util.find_spec("aiohttp") is None, reason="aiohttp (Ray's) drives Chromium's DevTools")
def test_two_treatments_read_whole_and_killed_runs_stay_out_of_the_groups(tmp_path, workspace):
    study = load_study(write_study(tmp_path, text=PREFIX_STUDY))
    runs = expand(study)
    assert submit_and_publish(study, runs, workspace) is not None
    killed_earlier_run(workspace, "dash2")

    port = free_port()
    proc = serve_dashboard(workspace, port, tmp_path / "dashboard.out")
    base = f"http://127.0.0.1:{port}"
    try:
        exp_id = api(f"{base}/api/2.0/mlflow/experiments/get-by-name?experiment_name=dash2")["experiment"][
            "experiment_id"]
        (by_group, (headline, lines)), cells = asyncio.run(browse_study(base, exp_id, tmp_path))
    finally:
        os.kill(proc.pid, signal.SIGINT)
        proc.wait(60)
    names = {arm: sorted(f"{arm}/optim.lr={lr}/s{s}" for lr in ("0.001", "0.003") for s in (0, 1))
             for arm in ("prenorm_adamw", "prenorm_muon", "attnres")}
    # the killed run (val_loss_tail 99) is in no group: the view filters killed and failed runs out
    assert by_group == {**names, "Additional runs": []}, by_group
    # the headline fits the collapsed description's one line: the rows counted by verdict
    assert lines == 1 and headline.startswith("Latest result: ") and headline.endswith("of 4 rows vs prenorm_adamw")
    # no run name or group label is cut: "Group: prenorm_adamw" and "prenorm_muon/optim.lr=0.003/s1" read whole
    assert {"Group: prenorm_adamw", "Group: prenorm_muon", *names["prenorm_muon"]} <= {t for t, _ in cells}, cells
    assert [t for t, cut in cells if cut] == [], cells
    assert (tmp_path / "dashboard_two_treatments.png").stat().st_size > 0
