"""The interventions readout (`results.readouts.interventions`, issue 36) on synthetic records: each cell's mean
over seeds and its interval, marked exactly when scipy's one-sample t interval of the seeds' deltas excludes 0;
the per-run mechanism values (`imbalance`, `stream<k>_knockout`) by hand; the heatmap draws the cells; the
terminal, the report, the artifacts and the MLflow series carry them; only finished runs count."""

import numpy as np
import pandas as pd
import pytest
from scipy import stats

from reslab.results.comparison import Comparison
from reslab.results.interventions import cell_table, intervention_values
from reslab.results.readouts.base import StudyData
from reslab.results.readouts.interventions import InterventionsReadout, interventions_text

COMP = Comparison(name="main", control="dar", treatments=("shared",))
SEEDS = (0, 1, 2, 3)
# (kind, site, source) -> (mean effect, spread over seeds): some clearly away from 0, some not
EFFECTS = {("source", 1, "emb"): (0.30, 0.02), ("source", 1, "s0"): (0.01, 0.05), ("source", 2, "s1"): (-0.2, 0.01),
           ("stream", None, "stream0"): (0.5, 0.05), ("stream", None, "stream1"): (0.1, 0.05)}


def records(arms=("dar", "shared"), seeds=SEEDS, mode="zero"):
    rng = np.random.default_rng(7)  # numpy's PCG64, fixed seed: the same records everywhere
    rows = []
    for arm in arms:
        for s in seeds:
            for (kind, site, source), (mu, sd) in EFFECTS.items():
                delta = mu * (1.5 if arm == "shared" else 1.0) + sd * rng.standard_normal()
                rows.append({"arm": arm, "grid_key": "", "seed": s, "kind": kind, "site": site, "source": source,
                             "mode": mode, "loss": 3.0 + delta, "base_loss": 3.0, "delta": delta, "tokens": 512})
    return pd.DataFrame(rows)


def runs_table(arms=("dar", "shared"), seeds=SEEDS, failed=()):
    return pd.DataFrame([{"arm": a, "grid_key": "", "seed": s, "run_id": f"{a}{s}",
                          "status": "FAILED" if (a, s) in failed else "FINISHED"} for a in arms for s in seeds])


def study(frame, runs):
    return StudyData(name="s", runs=runs, comparisons=(COMP,), read_interventions=lambda: frame)


def test_marked_cells_are_those_whose_scipy_t_interval_excludes_zero():
    frame = records()
    cells = cell_table(frame, alpha=0.05)
    assert len(cells) == 2 * len(EFFECTS)
    for r in cells.to_dict("records"):
        site = None if r["site"] == "all" else int(r["site"])
        part = frame[(frame["arm"] == r["arm"]) & (frame["source"] == r["source"])
                     & frame["site"].apply(lambda x, s=site: (x is None or x != x) if s is None else x == s)]
        deltas = part["delta"].to_numpy()
        low, high = stats.t.interval(0.95, len(deltas) - 1, loc=deltas.mean(), scale=stats.sem(deltas))
        assert r["n"] == len(SEEDS) and r["mean"] == pytest.approx(deltas.mean())
        assert (r["ci_low"], r["ci_high"]) == (pytest.approx(low), pytest.approx(high))
        assert r["marked"] == (low > 0 or high < 0)
    assert cells["marked"].any() and not cells["marked"].all()  # the synthetic effects give both


def test_one_seed_has_no_interval_and_marks_nothing():
    cells = cell_table(records(seeds=(0,)))
    assert not cells["marked"].any() and cells["ci_low"].isna().all()


def test_imbalance_and_stream_knockouts_per_run_by_hand():
    frame = records()
    values = intervention_values(frame)
    for (arm, seed), run in frame.groupby(["arm", "seed"]):
        mine = values[(values["arm"] == arm) & (values["seed"] == seed)].set_index("metric")["value"]
        s0 = float(run[run["source"] == "stream0"]["delta"].iloc[0])
        s1 = float(run[run["source"] == "stream1"]["delta"].iloc[0])
        assert mine.to_dict() == {"stream0_knockout": s0, "stream1_knockout": s1, "imbalance": s0 - s1}
    three = frame[frame["source"] == "stream1"].assign(source="stream2", delta=0.9)
    wider = intervention_values(pd.concat([frame, three]))  # n streams: stream 0 minus the others' mean
    row = wider[(wider["arm"] == "dar") & (wider["seed"] == 0) & (wider["metric"] == "imbalance")]["value"]
    run = frame[(frame["arm"] == "dar") & (frame["seed"] == 0)].set_index("source")["delta"]
    assert float(row.iloc[0]) == pytest.approx(run["stream0"] - (run["stream1"] + 0.9) / 2)
    assert intervention_values(frame.assign(mode="mean"))["metric"].str.endswith("_mean").all()
    dar = intervention_values(frame.replace({"source": {"stream0": "a", "stream1": "b"}}))  # DAR names them a, b
    assert dar.equals(values)


def test_the_readout_everywhere_and_only_finished_runs(tmp_path):
    frame = records()
    data = study(frame, runs_table(failed={("shared", 3)}))
    readout = InterventionsReadout()
    result = readout.compute(data)
    shared = result.cells[result.cells["arm"] == "shared"]
    assert set(shared["n"]) == {3} and set(result.cells[result.cells["arm"] == "dar"]["n"]) == {4}
    text = "".join(readout.text(result, data, "plain"))
    assert text.startswith("interventions: loss with the source removed - without")
    dar = result.cells[result.cells["arm"] == "dar"]
    assert f"dar (zero, 4 seed(s)): {int(dar['marked'].sum())} of {len(dar)} cells marked" in text
    shown = [line for line in text.splitlines() if line.startswith("    ")]
    assert len(shown) == int((result.cells["marked"] | (result.cells["kind"] != "source")).sum())
    assert "imbalance" in text
    short = interventions_text(result, data, shown=1)  # the largest marked source per arm, and the rest counted
    assert "more marked source(s)" in short
    section = "\n".join(readout.section(result, data))
    assert '<table id="interventions">' in section
    assert section.count('<tr class="marked">') == int(result.cells["marked"].sum())
    plots = readout.plots(result, data)
    assert [p.name for p, _ in plots] == ["knockout_dar", "knockout_shared"]
    drawn = plots[0][0].data
    assert drawn["sites"] == ["1", "2", "all"] and drawn["sources"] == ["emb", "s0", "s1", "stream0", "stream1"]
    emb = dar[(dar["site"] == "1") & (dar["source"] == "emb")].iloc[0]
    assert drawn["zero"]["mean"][0, 0] == pytest.approx(emb["mean"]) and drawn["zero"]["marked"][0, 0] == emb["marked"]
    assert np.isnan(drawn["zero"]["mean"][0, 2])  # site 1 does not read s1: blank
    tables = readout.artifacts(result, data, tmp_path)
    assert "interventions_table.json" in tables
    assert {p.name for p in tmp_path.iterdir()} == {"interventions.csv", "intervention_values.csv",
                                                    "knockout_dar.png", "knockout_shared.png"}
    series = readout.series(result, data)
    assert series["knockout/dar/zero/1/emb"] == [(4, pytest.approx(emb["mean"]))]
    assert "mechanism/shared/imbalance" in series


def test_no_records_no_result():
    assert InterventionsReadout().compute(study(records().iloc[:0], runs_table())) is None
