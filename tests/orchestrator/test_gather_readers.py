"""The gatherer is a list of readers, one per field of the study data (issue 50): a new input a readout needs is a
field of `results.readouts.base.StudyData` and one line in `gather.READERS`, which fills each field."""

from __future__ import annotations

from dataclasses import fields

import pandas as pd
from orch_helpers import write_study

from reslab.experiments import expand, load_study
from reslab.orchestrator.durability.workspace import Workspace
from reslab.orchestrator.gathering.gather import READERS, Sources
from reslab.results.readout import StudyReadout
from reslab.results.readouts.base import StudyData


def test_every_field_of_the_study_data_has_one_reader_in_order():
    assert list(READERS) == [f.name for f in fields(StudyData)]


def test_the_readers_fill_the_study_data_and_its_facts(tmp_path):
    study = load_study(write_study(tmp_path))
    runs = expand(study)
    # a runs table as `collect` gives it: one code version unrecorded (a failed run), one run of an older version
    table = pd.DataFrame({"run_id": [r.run_id for r in runs], "arm": [r.arm for r in runs],
                          "grid_key": [r.grid_key for r in runs], "seed": [r.seed for r in runs],
                          "status": "FINISHED", "code_version": ["abc123", None, "0ld", "abc123"][:len(runs)]})
    sources = Sources(study, runs, Workspace(tmp_path / "ws"), table, 0.1)
    data = StudyData(**{name: read(sources) for name, read in READERS.items()})
    assert data.name == study.name and data.alpha == 0.1 and data.runs is table
    assert data.code_versions == ("0ld", "abc123")
    assert Sources(study, runs, Workspace(tmp_path), table.drop(columns="code_version"), 0.05).code_versions() == ()
    facts = dict(StudyReadout(data).facts())
    assert facts["code version"] == "0ld, abc123"
    assert facts["comparisons"] == "; ".join(c.describe() for c in study.comparisons)
    assert list(facts)[:6] == ["arms", "seeds", "grid", "corpus", "model", "tokens per run"]
