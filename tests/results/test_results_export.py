import math
import re

import numpy as np
import pandas as pd
import pytest

from reslab.results.export import CSV_NA_REP, EXPORT_FORMATS, export_table, format_table, latex_escape
from reslab.results.stats import COMPARE_COLUMNS, Comparison, compare

pytestmark = pytest.mark.filterwarnings("error")

SEEDS = range(1, 9)


@pytest.fixture(scope="module")
def table():
    rng = np.random.default_rng(5)
    rows = []
    for gk in ("", "residual.options.heads=8"):
        for seed in SEEDS:
            base = 3.3 + 0.02 * rng.standard_normal()
            rows.append(("base_line", gk, seed, base, "FINISHED"))
            rows.append(("attn_res", gk, seed, base - 0.03 + 0.003 * rng.standard_normal(), "FINISHED"))
            # attn%res#2 fails on seed 8 and is absent everywhere on the grid point.
            if gk == "":
                rows.append(("attn%res#2", gk, seed, base + 0.001, "FINISHED" if seed < 8 else "FAILED"))
    runs = pd.DataFrame(
        [{"run_id": f"r{i}_x", "arm": a, "grid_key": g, "seed": s, "val_loss_tail": v, "status": st}
         for i, (a, g, s, v, st) in enumerate(rows)]
    )
    comps = [
        Comparison("main & more", "base_line", ("attn_res", "attn%res#2")),
        Comparison("tiny", "base_line", ("attn_res",), family="other"),
    ]
    return compare(runs, comps)


def read_csv(path):
    text_cols = {c: str for c in ("comparison", "family", "metric", "direction", "grid_key", "control", "treatment",
                                  "perm_method", "seeds", "control_run_ids", "treatment_run_ids", "missing", "flags")}
    return pd.read_csv(path, keep_default_na=False, na_values=[CSV_NA_REP], dtype=text_cols)


def test_fixture_has_the_awkward_cases(table):
    assert list(table.columns) == list(COMPARE_COLUMNS)
    assert "" in set(table["grid_key"])
    assert table["p_holm"].isna().any()  # a zero-pair row
    assert table["missing"].str.len().gt(0).any()


def test_csv_round_trip(table, tmp_path):
    path = export_table(table, tmp_path / "cmp.csv", "csv")
    back = read_csv(path)
    pd.testing.assert_frame_equal(back, table, check_dtype=False, check_exact=True)
    assert back["treatment_run_ids"].iloc[0] == table["treatment_run_ids"].iloc[0]


def test_parquet_round_trip(table, tmp_path):
    path = export_table(table, tmp_path / "sub" / "cmp.parquet", "parquet")
    back = pd.read_parquet(path)
    pd.testing.assert_frame_equal(back, table)


def test_markdown(table, tmp_path):
    path = export_table(table, tmp_path / "cmp.md", "md")
    text = path.read_text()
    assert text == format_table(table, "md")
    lines = text.splitlines()
    assert lines[0].startswith("| comparison | grid point | control | treatment | n | mean delta (95% CI) |")
    assert re.fullmatch(r"\|(-{3}:?\|)+", lines[1])
    assert len(lines) == len(table) + 2
    cells_per_line = {len(re.split(r"(?<!\\)\|", line)) for line in lines}
    assert len(cells_per_line) == 1  # pipes inside cells are escaped
    assert "run_ids" not in text and "r0_x" not in text


def test_paper_columns_and_number_formats():
    row = {c: "" for c in COMPARE_COLUMNS}
    row.update(comparison="c", family="f", metric="val_loss_tail", direction="minimize", grid_key="", control="a",
               treatment="b", n=8, mean_delta=-0.0123456, ci_low=-0.02, ci_high=-0.0046, perm_p=3e-6,
               p_holm=0.0123456, p_bh=0.5, d_z=-1.234, wins=7, losses=1, ties=0,
               flags="underpowered: x;below noise: y")
    table = pd.DataFrame([row])
    md = format_table(table, "md").splitlines()[2]
    cells = [c.strip() for c in md.strip("|").split("|")]
    assert cells == ["-", "a", "b", "8", "-0.0123 [-0.0200, -0.0046]", "<1e-4", "0.0123", "0.5", "-1.23", "7/1",
                     "underpowered: x; below noise: y"]
    row.update(mean_delta=math.nan, ci_low=math.nan, ci_high=math.nan, perm_p=math.nan, p_holm=math.nan,
               p_bh=math.nan, d_z=math.nan, n=0, wins=0, losses=0)
    cells = [c.strip() for c in format_table(pd.DataFrame([row]), "md").splitlines()[2].strip("|").split("|")]
    assert cells[3:9] == ["0", "n/a", "n/a", "n/a", "n/a", "n/a"]


def test_ci_level_comes_from_alpha(table):
    t = table.copy()
    t.attrs["alpha"] = 0.1
    assert "mean delta (90% CI)" in format_table(t, "md")


def test_text(table):
    text = format_table(table, "text")
    lines = text.splitlines()
    assert lines[0].split()[:3] == ["comparison", "grid", "point"]
    assert set(lines[1]) <= {"-", " "}
    assert len(lines) == len(table) + 2


def test_latex(table, tmp_path):
    text = export_table(table, tmp_path / "cmp.tex", "latex").read_text()
    lines = text.strip().splitlines()
    assert lines[0].startswith(r"\begin{tabular}{")
    assert lines[-1] == r"\end{tabular}"
    assert [ln for ln in lines if ln in (r"\toprule", r"\midrule", r"\bottomrule")] == [
        r"\toprule", r"\midrule", r"\bottomrule"]
    num_cols = len(re.search(r"\\begin\{tabular\}\{([lr]+)\}", lines[0]).group(1))
    body = lines[2:-1]
    rows = [ln for ln in body if ln.endswith(r"\\")]
    assert len(rows) == len(table) + 1
    for ln in rows:
        assert len(re.findall(r"(?<!\\)&", ln)) == num_cols - 1
    data = "\n".join(rows[1:])
    # Outside math mode every special character is escaped.
    outside_math = re.sub(r"\$[^$]*\$", "", data)
    assert not re.findall(r"(?<!\\)[_%&#]", outside_math.replace(" & ", " "))
    assert r"attn\_res" in data and r"attn\%res\#2" in data and r"main \& more" in data
    assert r"$\Delta$ (95\% CI)" in rows[0] and "$d_z$" in rows[0]


def test_latex_escape():
    assert latex_escape(r"a_b%c&d#e$f{g}~^\ <>|") == (
        r"a\_b\%c\&d\#e\$f\{g\}\textasciitilde{}\textasciicircum{}\textbackslash{} "
        r"\textless{}\textgreater{}\textbar{}"
    )


def test_unknown_formats(table, tmp_path):
    with pytest.raises(ValueError, match=r"unknown export format 'xlsx'; allowed: \['md', 'csv', 'parquet', 'latex'\]"):
        export_table(table, tmp_path / "x.xlsx", "xlsx")
    with pytest.raises(ValueError, match=r"allowed: \['md', 'text'\]"):
        format_table(table, "html")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("fmt", EXPORT_FORMATS)
def test_failed_write_leaves_old_file_and_no_temp(table, tmp_path, monkeypatch, fmt):
    target = tmp_path / f"cmp.{fmt}"
    target.write_text("previous")

    def broken(self, path, *args, **kwargs):
        with open(path, "w") as f:
            f.write("half a tab")
        raise OSError("disk full")

    def broken_text(self, data, *args, **kwargs):
        broken(None, self)

    monkeypatch.setattr(pd.DataFrame, "to_csv", broken)
    monkeypatch.setattr(pd.DataFrame, "to_parquet", broken)
    monkeypatch.setattr("pathlib.Path.write_text", broken_text)
    with pytest.raises(OSError, match="disk full"):
        export_table(table, target, fmt)
    monkeypatch.undo()
    assert target.read_text() == "previous"
    assert [p.name for p in tmp_path.iterdir()] == [target.name]
