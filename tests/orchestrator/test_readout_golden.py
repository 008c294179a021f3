"""Every readout of a ladder + contrasts + sequential + costs study, rendered through each way out (`reslab
compare` plain and Markdown, `export` in every text format, the HTML report, the end of `reslab run` and the files,
tables and series the parent MLflow run gets), equals the rendering of the code before the readouts were
redesigned (issue 32), file by file. The records are synthetic (`readout_fixture`), so the numbers are the
same on every machine; the run ids and the temporary path are normalized, and a PNG counts by its size.

A change that means to alter a rendering regenerates the files: `RESLAB_REGEN_GOLDEN=1 pytest
tests/orchestrator/test_readout_golden.py`, then review the diff of `golden/readouts/` like code.
"""

from __future__ import annotations

import io
import json
import os
import shutil
from contextlib import redirect_stdout
from pathlib import Path

import pytest
import readout_fixture

from reslab.orchestrator.cli import main
from reslab.orchestrator.gathering.gather import gather, publish_study_result

pytestmark = pytest.mark.slow  # three gatherings of a 45-run study, each fitting its ladder's bootstrap (~40 s)

GOLDEN = Path(__file__).parent / "golden" / "readouts"


class RecordingTracker:
    """Stands in for the MLflow tracker: it keeps what the readouts hand the parent run (the files, the
    tables, the series), which is what this test pins; MLflow's own writing of them is
    `test_dashboard_browser.py`'s and `test_sequential_study.py`'s."""

    uri = "sqlite:///unused"

    def __init__(self, out: Path) -> None:
        self.out = out

    def log_study_result(self, result, local_dir) -> str:
        shutil.copytree(local_dir, self.out / "published")
        logged = {"paired_table.json": result.table, **result.tables}
        (self.out / "published_tables.json").write_text(json.dumps(
            {k: json.loads(v.to_json(orient="split")) for k, v in logged.items()}, indent=1, sort_keys=True))
        (self.out / "published_series.json").write_text(json.dumps(result.series, indent=1, sort_keys=True))
        return "parent"


def _render(tmp_path: Path) -> dict[str, str]:
    study, runs, workspace = readout_fixture.build(tmp_path)
    out = tmp_path / "rendered"
    out.mkdir()

    def cli(*args: str) -> str:
        buf = io.StringIO()
        with redirect_stdout(buf):
            assert main([*args, str(tmp_path / "golden.yaml"), "--workspace", str(workspace.root), "--cached"]) == 0
        return buf.getvalue()

    (out / "compare.txt").write_text(cli("compare"))
    (out / "compare.md").write_text(cli("compare", "--format", "md"))
    for fmt, ext in (("md", "md"), ("csv", "csv"), ("latex", "tex")):
        cli("export", "--format", fmt, "-o", str(out / f"export.{ext}"))
    # `reslab report` writes `StudyReadout.report()` (tests/orchestrator/test_report.py runs the command);
    # here one gathering serves the report, the publication and the end of `reslab run`: each rendering of
    # this study fits its ladder's bootstrap, about 12 s
    readout = gather(study, runs, workspace, RecordingTracker.uri, cached=True)
    (out / "report.html").write_text(readout.report(), encoding="utf-8")
    publish_study_result(readout, RecordingTracker(out))
    text = io.StringIO()
    readout.print(text)  # what `reslab run` prints after its runs, its source aside
    (out / "run_end.txt").write_text(text.getvalue())
    return readout_fixture.snapshot(out, tmp_path, runs)


def test_every_readout_renders_as_before_the_redesign(tmp_path):
    rendered = _render(tmp_path)
    if os.environ.get("RESLAB_REGEN_GOLDEN"):
        shutil.rmtree(GOLDEN, ignore_errors=True)
        for name, text in rendered.items():
            (GOLDEN / name).parent.mkdir(parents=True, exist_ok=True)
            (GOLDEN / name).write_text(text)
    golden = {str(p.relative_to(GOLDEN)): p.read_text() for p in sorted(GOLDEN.rglob("*")) if p.is_file()}
    assert sorted(rendered) == sorted(golden)
    for name, text in golden.items():
        assert rendered[name] == text, f"{name} differs from golden/readouts/{name}"
    # the fixture holds every kind: the comparison is not vacuous
    names = {Path(n).name for n in golden}
    assert {"sequential.csv", "ladder_rungs.csv", "contrasts.csv", "costs.csv", "forest.png"} <= names
