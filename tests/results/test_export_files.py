"""Export files: one mode (0644) for every format, atomic writes, the per-seed pairs section."""

from __future__ import annotations

import os
import stat

import pandas as pd
import pytest

from reslab.common.io import write_atomic
from reslab.results.collect import pairs_table
from reslab.results.export import EXPORT_FORMATS, export_table
from reslab.results.stats import Comparison, compare


@pytest.fixture
def tables():
    runs = pd.DataFrame([
        {"run_id": f"{arm}-{seed}", "arm": arm, "grid_key": "", "seed": seed, "status": "FINISHED",
         "val_loss_tail": 3.0 + 0.01 * seed - (0.05 if arm == "attnres" else 0.0)}
        for arm in ("control", "attnres") for seed in range(4)
    ])
    comparisons = [Comparison(name="main", control="control", treatments=("attnres",))]
    return compare(runs, comparisons), pairs_table(runs, comparisons)


@pytest.fixture
def strict_umask():
    old = os.umask(0o077)
    yield
    os.umask(old)


@pytest.mark.parametrize("fmt", EXPORT_FORMATS)
def test_every_export_format_is_written_0644(tmp_path, tables, strict_umask, fmt):
    table, pairs = tables
    path = export_table(table, tmp_path / "out" / f"t.{fmt}", fmt, pairs=pairs)
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary file left behind


@pytest.mark.parametrize("fmt", ["md", "latex"])
def test_text_exports_list_every_seed_with_both_run_ids(tmp_path, tables, fmt):
    table, pairs = tables
    text = export_table(table, tmp_path / "t", fmt, pairs=pairs).read_text()
    without = export_table(table, tmp_path / "u", fmt).read_text()
    for seed in range(4):
        assert f"control-{seed}" in text and f"attnres-{seed}" in text
        assert f"control-{seed}" not in without


def test_write_atomic_replaces_whole_files_and_cleans_up_on_failure(tmp_path):
    path = write_atomic(tmp_path / "f.json", "old")
    write_atomic(path, b"new")
    assert path.read_bytes() == b"new" and stat.S_IMODE(path.stat().st_mode) == 0o644
    with pytest.raises(TypeError):
        write_atomic(path, 3)  # type: ignore[arg-type]
    assert path.read_bytes() == b"new" and sorted(p.name for p in tmp_path.iterdir()) == ["f.json"]
