"""Adding a kind of result is one readout in the list (issue 50): a kind this test alone knows, appended to
`results.readout.READOUTS` and nothing else (no edit of `results/export.py`, `results/report.py` or the gatherer),
shows in `reslab compare` (plain and Markdown), every `reslab export` format (Markdown, CSV, LaTeX, Parquet),
`reslab report`'s page (its fact, its section) and the submission's parent MLflow run (its file, its MLflow table,
its metric series), each through the code path a user's command takes; and every other kind renders as without it.

The study is `readout_fixture`'s synthetic records (no training) without a ladder or sequential seeds, so a
gathering fits nothing slow."""

from __future__ import annotations

import io
from contextlib import redirect_stdout
from pathlib import Path

import pandas as pd
import pytest
import readout_fixture

from reslab.orchestrator.cli import main
from reslab.orchestrator.gathering.gather import gather, publish_study_result
from reslab.orchestrator.tracking.store import import_mlflow
from reslab.orchestrator.tracking.writer import MlflowWriter
from reslab.results import readout as readout_module
from reslab.results.collect import usable
from reslab.results.export import CSV_NA_REP
from reslab.results.readouts.base import Readout, Series, StudyData, Style, TableFormat

pytestmark = pytest.mark.slow  # five gatherings through the CLI and an MLflow store (~60 s)

STUDY = """\
study: toy
base:
  model: {preset: tiny, n_heads: 2, n_kv_heads: 2, seq_len: 32, d_model: 16, n_layers: 2, ffn_hidden: 32}
  optim: {batch_size: 4, warmup_steps: 2, lr: 3.0e-3}
  train: {steps: 4, eval_every: 2, log_every: 1, eval_windows: 8, tail_k: 1}
arms:
  control: prenorm
  attnres: {residual: attnres}
seeds: 3
comparisons:
  - {name: main, control: control, treatments: [attnres], metric: val_loss, mei: 0.02}
costs: [decode_tps]
"""


class ToyReadout(Readout):
    """Each arm's finished runs: a kind of result no module of the package names."""

    name = "toy"

    def compute(self, data: StudyData) -> pd.DataFrame:
        finished = data.runs[usable(data.runs)].groupby("arm", sort=False).size()
        return pd.DataFrame({"role": "toy", "arm": finished.index, "finished": finished.to_numpy()})

    def text(self, result: pd.DataFrame, data: StudyData, style: Style) -> list[str]:
        return ["toy: " + ", ".join(f"{a} {n}" for a, n in zip(result["arm"], result["finished"], strict=True))
                + "\n"]

    def facts(self, data: StudyData) -> list[tuple[str, str]]:
        return [("toy", "finished runs per arm")]

    def section(self, result: pd.DataFrame, data: StudyData) -> list[str]:
        return ["<h2>Toy</h2>", f'<p id="toy">{int(result["finished"].sum())} finished runs</p>']

    def tables(self, result: pd.DataFrame, data: StudyData, fmt: TableFormat) -> list[str]:
        rows = list(zip(result["arm"], result["finished"], strict=True))
        if fmt == "md":
            return ["**toy: finished runs**\n\n| arm | finished |\n|---|---:|\n"
                    + "".join(f"| {a} | {n} |\n" for a, n in rows)]
        return ["\\begin{table*}[t]% toy\n" + "".join(f"{a} & {n} \\\\\n" for a, n in rows) + "\\end{table*}\n"]

    def rows(self, result: pd.DataFrame, data: StudyData) -> pd.DataFrame:
        return result

    def artifacts(self, result: pd.DataFrame, data: StudyData, out: Path) -> dict[str, pd.DataFrame]:
        result.to_csv(out / "toy.csv", index=False)
        return {"toy_table.json": result}

    def series(self, result: pd.DataFrame, data: StudyData) -> Series:
        return {f"toy/{a}": [(0, float(n))] for a, n in zip(result["arm"], result["finished"], strict=True)}


def _outputs(tmp_path: Path, name: str) -> dict[str, str | pd.DataFrame]:
    """What `reslab compare`, `export` (every format) and `report` write for the study."""
    spec, ws = str(tmp_path / "golden.yaml"), str(tmp_path / "ws")
    out = tmp_path / name
    out.mkdir()

    def cli(*args: str) -> str:
        buf = io.StringIO()
        with redirect_stdout(buf):
            assert main([*args, spec, "--workspace", ws, "--cached"]) == 0
        return buf.getvalue()

    got: dict[str, str | pd.DataFrame] = {"compare": cli("compare"), "compare.md": cli("compare", "--format", "md")}
    for fmt, ext in (("md", "md"), ("latex", "tex"), ("csv", "csv"), ("parquet", "parquet")):
        cli("export", "--format", fmt, "-o", str(out / f"export.{ext}"))
    got["md"], got["tex"] = (out / "export.md").read_text(), (out / "export.tex").read_text()
    got["csv"] = pd.read_csv(out / "export.csv", keep_default_na=False, na_values=[CSV_NA_REP])
    got["parquet"] = pd.read_parquet(out / "export.parquet")
    cli("report", "-o", str(out / "report.html"))
    got["report"] = (out / "report.html").read_text()
    return got


@pytest.fixture(scope="module")
def renderings(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("toy")
    study, runs, workspace = readout_fixture.build(tmp_path, STUDY)
    before = _outputs(tmp_path, "before")
    patch = pytest.MonkeyPatch()
    patch.setattr(readout_module, "READOUTS", (*readout_module.READOUTS, ToyReadout()))
    try:
        after = _outputs(tmp_path, "after")
        readout = gather(study, runs, workspace, "sqlite:///unused", cached=True)
    finally:
        patch.undo()
    return before, after, readout, workspace


def test_the_toy_shows_in_compare_after_every_other_kind(renderings):
    before, after, _, _ = renderings
    assert after["compare"] == before["compare"] + "toy: control 3, attnres 3\n"
    assert after["compare.md"] == before["compare.md"] + "toy: control 3, attnres 3\n"


def test_the_toy_shows_in_every_export_format(renderings):
    before, after, _, _ = renderings
    toy_md = "**toy: finished runs**\n\n| arm | finished |\n|---|---:|\n| control | 3 |\n| attnres | 3 |\n"
    pairs = before["md"].index("**Per-seed pairs")  # the appendix follows every readout's tables
    assert after["md"] == before["md"][:pairs] + toy_md + "\n" + before["md"][pairs:]
    assert before["md"].index("**cost decode_tps") < pairs  # the declared cost's table is there, before the toy's
    toy_tex = "\\begin{table*}[t]% toy\ncontrol & 3 \\\\\nattnres & 3 \\\\\n\\end{table*}\n"
    pairs = before["tex"].rindex("\\begin{table*}", 0, before["tex"].index("Per-seed pairs"))
    assert after["tex"] == before["tex"][:pairs] + toy_tex + "\n" + before["tex"][pairs:]
    for fmt in ("csv", "parquet"):
        old, new = before[fmt], after[fmt]
        assert list(new.columns) == [*old.columns, "arm", "finished"]  # the toy's own columns after
        pd.testing.assert_frame_equal(new.iloc[:len(old)][list(old.columns)], old, check_dtype=False)
        toy = new.iloc[len(old):]
        assert list(toy["role"]) == ["toy", "toy"] and list(toy["arm"]) == ["control", "attnres"]
        assert list(toy["finished"]) == [3, 3] and new.iloc[:len(old)]["finished"].isna().all()


def test_the_toy_shows_in_the_report_with_its_fact(renderings):
    before, after, _, _ = renderings
    page = after["report"]
    assert '<h2>Toy</h2>\n<p id="toy">6 finished runs</p>' in page and "<h2>Toy</h2>" not in before["report"]
    assert page.index("<h2>Costs</h2>") < page.index("<h2>Toy</h2>") < page.index("<h2>Plots</h2>")
    facts = page[page.index('<table id="facts">'):page.index("</table>", page.index('<table id="facts">'))]
    labels = [cell.split("</th>")[0] for cell in facts.split("<th>")[1:]]
    # the study's facts, each kind's (the declared costs, then the toy's), the comparisons, the code versions
    assert labels == ["arms", "seeds", "grid", "corpus", "model", "tokens per run", "costs", "toy", "comparisons",
                      "code version", "runs finished"]
    assert "<th>code version</th><td>0123abc</td>" in facts


def test_the_toy_is_on_the_parent_mlflow_run(renderings, tmp_path):
    _, _, readout, workspace = renderings
    writer = MlflowWriter(f"sqlite:///{tmp_path / 'mlflow.db'}", workspace)
    writer.begin("toy", submission="toy-test", code={}, plan={})
    parent = publish_study_result(readout, writer)
    client = import_mlflow()(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    files = {a.path for a in client.list_artifacts(parent)}
    assert {"toy.csv", "toy_table.json", "costs.csv", "paired_table.json", "report.html"} <= files
    assert "<h2>Toy</h2>" in Path(client.download_artifacts(parent, "report.html", str(tmp_path))).read_text()
    for arm in ("control", "attnres"):
        assert [(m.step, m.value) for m in client.get_metric_history(parent, f"toy/{arm}")] == [(0, 3.0)]
