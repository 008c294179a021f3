"""Every readout of a ladder + contrasts + sequential + costs study, rendered through each way out (`reslab
compare` plain and Markdown, `export` in every text format, the HTML report, the end of `reslab run` and the files,
tables and series the parent MLflow run gets), equals the rendering of the code before the readouts were
redesigned (issue 32), file by file. The records are synthetic (`readout_fixture`), so the numbers are the
same on every machine but for the last digit of a fitted one (the ladder's fit runs numpy's and scipy's
vectorized float sums, whose order differs between CPUs: CI once printed k 1.05 where this machine prints
1.04), so a number may differ by one unit of its last printed digit (a float written in full, as the CSV and
JSON files hold it, by 1e-3 relative: a fit found to its optimizer's tolerance) and nothing else may differ; the run ids
and the temporary path are normalized, and a PNG counts by its size.

A change that means to alter a rendering regenerates the files: `RESLAB_REGEN_GOLDEN=1 pytest
tests/orchestrator/test_readout_golden.py`, then review the diff of `golden/readouts/` like code.
"""

from __future__ import annotations

import io
import json
import os
import re
import shutil
from contextlib import redirect_stdout
from decimal import Decimal, InvalidOperation
from pathlib import Path

import pytest
import readout_fixture

from reslab.orchestrator.cli import main
from reslab.orchestrator.gathering.gather import gather, publish_study_result

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


_NUMBER = re.compile(r"[-+]?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?")


def _last_digit(token: str) -> Decimal:
    """One unit of `token`'s last printed digit (0.01 for "1.04", 100 for "1.05e+04")."""
    return Decimal(1).scaleb(Decimal(token).as_tuple().exponent)  # type: ignore[arg-type]


def assert_renders_alike(got: str, golden: str, name: str) -> None:
    """`got` equals `golden` but for numbers one unit of their last printed digit apart (the docstring)."""
    if got == golden:
        return
    got_parts, golden_parts = _NUMBER.split(got), _NUMBER.split(golden)
    assert got_parts == golden_parts, f"{name} differs from golden/readouts/{name} beyond its numbers"
    for a, b in zip(_NUMBER.findall(got), _NUMBER.findall(golden), strict=True):
        if a == b:
            continue
        try:
            gap, exact = abs(Decimal(a) - Decimal(b)), Decimal(b)
            # a float written in full (CSV, JSON) is a fit's optimum, found to the optimizer's tolerance
            full = len(exact.as_tuple().digits) > 8
            close = gap <= (Decimal("1e-3") * abs(exact) if full else max(_last_digit(a), _last_digit(b)))
        except InvalidOperation:
            close = False
        assert close, f"{name} differs from golden/readouts/{name}: {a} where it had {b}"


def test_the_comparison_allows_one_unit_of_the_last_digit_and_nothing_else():
    assert_renders_alike("k 1.05 [0.97, 1.12] at 3.7e+08", "k 1.04 [0.97, 1.12] at 3.7e+08", "t")
    assert_renders_alike("3.8e+08", "3.7e+08", "t")
    assert_renders_alike("1.0104914565785046", "1.0104856137312008", "t")  # written in full: 1e-3 relative
    with pytest.raises(AssertionError):
        assert_renders_alike("1.0124914565785046", "1.0104856137312008", "t")
    for got in ("k 1.06 [0.97, 1.12]", "k 1.05 [0.97, 1.13] x", "k 1.05 [0.97,  1.12]", "k 10.4 [0.97, 1.12]"):
        with pytest.raises(AssertionError):
            assert_renders_alike(got, "k 1.04 [0.97, 1.12]", "t")


@pytest.mark.slow  # three gatherings of a 45-run study, each fitting its ladder's bootstrap (~40 s)
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
        assert_renders_alike(rendered[name], text, name)
    # the fixture holds every kind: the comparison is not vacuous
    names = {Path(n).name for n in golden}
    assert {"sequential.csv", "ladder_rungs.csv", "contrasts.csv", "costs.csv", "forest.png"} <= names
