"""`seeds: {sequential: {start, batch, max}}` in the study spec: the design, its looks, and one line for
every mistake, naming the field and what is allowed."""

from __future__ import annotations

import re
import textwrap

import pytest

from reslab.common.errors import ConfigError
from reslab.experiments import expand, load_study
from reslab.orchestrator.cli import main

STUDY = """
study: seq
base: {{model: {{preset: tiny}}, train: {{steps: 10}}}}
arms:
  control: prenorm
  attnres: {{residual: attnres}}
seeds: {seeds}
{comparisons}
"""
COMPARISONS = "comparisons:\n  - {name: main, control: control, treatments: [attnres]}"


def _load(tmp_path, seeds: str, comparisons: str = COMPARISONS):
    path = tmp_path / "seq.yaml"
    path.write_text(textwrap.dedent(STUDY.format(seeds=seeds, comparisons=comparisons)))
    return load_study(path)


def test_a_sequential_design_expands_to_its_maximum_and_looks_in_batches(tmp_path):
    study = _load(tmp_path, "{sequential: {start: 4, batch: 3, max: 12, prior_scale: 0.5}}")
    d = study.sequential
    assert (d.start, d.batch, d.max, d.prior_scale, d.test) == (4, 3, 12, 0.5, "flip")
    assert _load(tmp_path, "{sequential: {test: t}}").sequential.test == "t"
    assert d.looks() == [4, 7, 10, 12] and study.seeds == tuple(range(12)) and len(expand(study)) == 24
    assert _load(tmp_path, "{sequential: {}}").sequential.looks() == [4, 6, 8, 10, 12, 14, 16]  # the defaults
    assert _load(tmp_path, "5").sequential is None


@pytest.mark.parametrize(("seeds", "message"), [
    ("{sequential: {start: 1}}", r"seeds\.sequential\.start: expected an integer >= 2, got 1 \(the test needs two"),
    ("{sequential: {start: 6, max: 4}}", r"seeds\.sequential\.max: 4 is below start 6; allowed: max >= start"),
    ("{sequential: {batch: 0}}", r"seeds\.sequential\.batch: expected an integer >= 1, got 0"),
    ("{sequential: {stop: 3}}", r"seeds\.sequential: unknown key\(s\) \['stop'\]; allowed: start, batch, max, "
                                r"prior_scale, test"),
    ("{sequential: {test: z}}", r"seeds\.sequential\.test: 'z' is not a sequential test; allowed: flip \(the "
                                r"default, "),
    ("{sequential: {prior_scale: -1}}", r"seeds\.sequential\.prior_scale: expected a number > 0"),
    ("{sequential: 4}", r"seeds\.sequential: expected a mapping with start, batch, max, prior_scale"),
    ("{adaptive: {start: 4}}", r"seeds: unknown key\(s\) 'adaptive'; allowed: count, replicate, sequential"),
])
def test_a_bad_design_is_one_line_naming_the_field(tmp_path, seeds, message):
    with pytest.raises(ConfigError, match=message):
        _load(tmp_path, seeds)


def test_a_sequential_study_needs_a_comparison_and_validate_names_the_design(tmp_path, capsys):
    with pytest.raises(ConfigError, match=r"seeds\.sequential: a sequential study stops when its comparisons are "
                                          r"decided; add a `comparisons:` list"):
        _load(tmp_path, "{sequential: {start: 4}}", comparisons="")
    _load(tmp_path, "{sequential: {start: 4, batch: 2, max: 8}}")
    assert main(["validate", str(tmp_path / "seq.yaml")]) == 0  # not refused as underpowered: not sized in advance
    out = capsys.readouterr().out
    assert "16 runs" in out and "sequential: seeds 4, then +2 per look" in out and "[4, 6, 8]" in out
    assert main(["power", str(tmp_path / "seq.yaml"), "--sd", "0.01", "--mei", "0.02", "--sequential"]) == 0
    out = capsys.readouterr().out
    assert "sequential design (its own): seeds 4, +2 per look, at most 8" in out
    # issue 35, item 20: sized with the test that decides, the default (issue 51: the flip test), which says what it
    # assumes
    assert ("the test that decides: the flip test, an e-process betting on each paired delta's sign by its size, "
            "valid when the deltas are symmetric about 0 under the null") in out
    assert "main (true delta -0.02, SD 0.01, level 0.05: alpha / 1 row(s) of family 'default'): expected " in out
    assert "a fixed design at the same level and power" in out
    # looks at 4, 6, 8 against the sign flip's floor of 6 seeds: this design costs more, and says so
    assert re.search(r"the sequential design costs \d+% more on average: a fixed design is cheaper here", out), out


FAMILY = """comparisons:
  - {name: one, control: control, treatments: [attnres], family: f}
  - {name: two, control: control, treatments: [attnres], family: f}"""


@pytest.mark.slow  # ~20 s: 4 x 2000 simulated studies of the sign test
def test_power_sequential_compares_both_designs_at_the_familys_level(tmp_path, capsys):
    """Issue 35, item 19: two comparisons of one family: the sequential design is simulated at alpha / 2 per row,
    the level the fixed design is sized at, and the output says so."""
    _load(tmp_path, "8", comparisons=FAMILY)
    assert main(["power", str(tmp_path / "seq.yaml"), "--sd", "0.01", "--mei", "0.02", "--sequential"]) == 0
    out = capsys.readouterr().out
    assert "like for like: both designs at each row's level, alpha / its family's rows (0.025)" in out
    assert "one (true delta -0.02, SD 0.01, level 0.025: alpha / 2 row(s) of family 'f')" in out
    assert "family 'f' of 2, holm, level 0.025" in out  # the fixed design's row, sized at the same level


def test_power_help_names_the_design_the_code_simulates(capsys):
    """Issue 35, item 22: the help said +2 seeds per look where the code adds 1."""
    from reslab.orchestrator.cli import power

    with pytest.raises(SystemExit):
        main(["power", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert f"seeds {power.FIXED_START}, +{power.FIXED_BATCH} per look" in out and power.FIXED_BATCH == 1
