"""What a readout is (`Readout`), and the plain data every readout reads (`StudyData`)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, Literal

import numpy as np
import pandas as pd

from reslab.results.comparison import Comparison
from reslab.results.contrasts import ContrastSpec
from reslab.results.gate_results import GatesDesign
from reslab.results.labels import PointLabels, point_labels
from reslab.results.ladder import LadderScope
from reslab.results.plots import Plot
from reslab.results.records import PROFILE_COLUMNS
from reslab.results.sequential import SequentialDesign

__all__ = ["EVAL_COLUMNS", "PROFILE_COLUMNS", "Cost", "Headline", "Readout", "Series", "StudyData", "Style",
           "TableFormat", "TrainingRecords", "listed"]

# plain: the terminal's text when piped (byte for byte); rich: the same on a terminal; md: Markdown tables
Style = Literal["plain", "rich", "md"]
Series = dict[str, list[tuple[int, float]]]  # MLflow metric key -> (step, value) points
TableFormat = Literal["md", "latex"]  # an export file of tables (`results.export.TEXT_EXPORTS`)


@dataclass(frozen=True)
class Cost:
    """What one run of an (arm, grid point) costs: its training FLOPs, parameters and steps."""

    flops: float
    params: float
    steps: int


@dataclass(frozen=True)
class Headline:
    """A study's headline: the table the parent MLflow run shows first, and for the experiment's description
    that table in Markdown and its answer in one line."""

    table: pd.DataFrame
    markdown: str
    answer: str


@dataclass(frozen=True)
class TrainingRecords:
    """What the runs recorded while training, from their run directories (no MLflow history needed)."""

    evals: pd.DataFrame  # one row per eval: `EVAL_COLUMNS`
    depths: pd.DataFrame  # one row per run with a last-eval D_eff: arm, grid_key, seed, d_eff, f_l
    # grid point -> arm -> seed-mean last-eval routing (NaN: no source), grid points in study order
    routing: dict[str, dict[str, tuple[np.ndarray, list[str]]]] = field(default_factory=dict)
    profiles: dict[str, dict[str, list[float | None]]] = field(default_factory=dict)  # per layer, seed-mean
    # the depth profiles (models.magnitudes): per grid point, the runs' magnitudes across depth at the last
    # evaluation every run there reached, over seeds; one row per (grid point, arm, quantity, site or layer
    # index): `PROFILE_COLUMNS`
    depth_profiles: pd.DataFrame = field(default_factory=lambda: no_depth_profiles())


EVAL_COLUMNS = ("arm", "grid_key", "seed", "step", "tokens", "val_loss")


def no_depth_profiles() -> pd.DataFrame:
    return pd.DataFrame(columns=list(PROFILE_COLUMNS))


def no_mechanisms() -> pd.DataFrame:
    return pd.DataFrame(columns=["arm", "grid_key", "seed", "metric", "value"])


def no_task_items() -> pd.DataFrame:
    return pd.DataFrame(columns=["arm", "grid_key", "seed", "task", "metric", "doc_id", "value"])


def no_interventions() -> pd.DataFrame:
    return pd.DataFrame(columns=["arm", "grid_key", "seed", "kind", "site", "source", "mode", "loss", "base_loss",
                                 "delta", "tokens"])


def no_records() -> TrainingRecords:
    return TrainingRecords(evals=pd.DataFrame(columns=["arm", "grid_key", "seed", "step", "tokens", "val_loss"]),
                           depths=pd.DataFrame(columns=["arm", "grid_key", "seed", "d_eff", "f_l"]))


@dataclass(frozen=True)
class StudyData:
    """A study as its readouts see it: the runs table, what the study declares, what its runs cost, and
    (read on first use: only a report needs them) what they recorded while training and the facts of
    what was run. Filled by the orchestrator's gatherer."""

    name: str
    runs: pd.DataFrame  # results.collect.runs_table: one row per expected run
    comparisons: tuple[Comparison, ...]
    alpha: float = 0.05
    description: str = ""
    reproduce: tuple[str, ...] = ()  # the commands that reproduce the study
    seeds: tuple[int, ...] = ()
    grid_axes: tuple[str, ...] = ()  # the grid axes' paths
    contrasts: tuple[ContrastSpec, ...] = ()
    sequential: SequentialDesign | None = None
    ladder: tuple[LadderScope, ...] = ()  # a ladder study's scopes
    gates: GatesDesign | None = None  # a gates study's plan, arms, rungs and targets
    costs: Mapping[tuple[str, str], Cost] = field(default_factory=dict)  # (arm, grid key) -> one run's cost
    cost_metrics: tuple[str, ...] = ()  # the study's `costs:`, compared as ratios within each comparison
    mechanism_metrics: tuple[str, ...] = ()  # the study's `mechanisms:`, compared as paired deltas
    intervention_plan: str = ""  # the study's `interventions:` in words (empty: none declared)
    code_versions: tuple[str, ...] = ()  # the code versions the study's runs recorded, sorted
    # comparison -> why it is exploratory: its analysis changed after the plan frozen at the study's first submission
    analysis_notes: Mapping[str, str] = field(default_factory=dict)
    read_records: Callable[[], TrainingRecords] = field(default=no_records, repr=False, compare=False)
    # what was run (the arms, seeds, grid, corpus, model, tokens), (label, value) each, for the report's first
    # table, which each readout's `facts`, the comparisons and the code versions follow
    read_facts: Callable[[], list[tuple[str, str]]] = field(default=list, repr=False, compare=False)
    # every evaluated item of the study's runs (results.tasks.ITEM_COLUMNS and metric), read on first use
    read_task_items: Callable[[], pd.DataFrame] = field(default=no_task_items, repr=False, compare=False)
    # every run's mechanism values, long (results.mechanisms.VALUE_COLUMNS: arm, grid_key, seed, metric, value):
    # the summaries, and the interventions' per-run results; read on first use
    read_mechanisms: Callable[[], pd.DataFrame] = field(default=no_mechanisms, repr=False, compare=False)
    # every intervention of the study's runs (results.interventions.COLUMNS: one row per run and knock-out)
    read_interventions: Callable[[], pd.DataFrame] = field(default=no_interventions, repr=False, compare=False)

    @cached_property
    def records(self) -> TrainingRecords:
        return self.read_records()

    @cached_property
    def facts(self) -> list[tuple[str, str]]:
        return self.read_facts()

    @cached_property
    def task_items(self) -> pd.DataFrame:
        return self.read_task_items()

    @cached_property
    def mechanisms(self) -> pd.DataFrame:
        return self.read_mechanisms()

    @cached_property
    def interventions(self) -> pd.DataFrame:
        return self.read_interventions()

    @cached_property
    def labels(self) -> PointLabels:
        """Each grid point's short label (`r0: d32 L2` for a ladder rung), what the report writes for it."""
        keys = self.runs["grid_key"].fillna("") if "grid_key" in self.runs else []
        return point_labels(keys, [(s.scope, s.rungs) for s in self.ladder])


def listed(records: list[dict[str, Any]], columns: Mapping[str, str]) -> list[dict[str, Any]]:
    """`records` with each joined text column of `columns` (column -> its separator) as a list: the seeds (`,`) as
    integers, run ids and flags (`;`) as strings; an empty or missing text an empty list."""
    out = []
    for r in records:
        r = dict(r)
        for col, sep in columns.items():
            text = r.get(col)
            parts = [p for p in text.split(sep) if p] if isinstance(text, str) else []
            r[col] = [int(p) for p in parts] if col == "seeds" else parts
        out.append(r)
    return out


class Readout:
    """One kind of result, in every medium: the terminal (`text`), the HTML report (`facts`, `section`, `plots`),
    an export file (`tables`, `appendix`, `rows`), the parent MLflow run (`artifacts`, `series`). `compute`
    returns None when the study has nothing of this kind; every other method but `facts` takes what `compute`
    returned and, where a kind does not override it, shows nothing. `narrow` restricts the study data every
    readout sees (a sequential study: to the runs its looks released). A readout that overrides none of
    `tables`, `appendix` and `rows` is not computed for an export."""

    name = ""
    # where an export puts this readout's tables and rows among the others' (a stable sort: the list's order
    # within a rank)
    export_rank = 0

    def narrow(self, data: StudyData) -> StudyData:
        return data

    def compute(self, data: StudyData) -> Any | None:
        raise NotImplementedError(f"{type(self).__name__} computes no result")

    def text(self, result: Any, data: StudyData, style: Style) -> list[Any]:
        """What the terminal prints: strings (written as they are) or, in the rich style, rich renderables."""
        return []

    def headline(self, result: Any, data: StudyData) -> Headline | None:
        """The study's headline, when this kind gives it (the first readout in the list that does)."""
        return None

    def facts(self, data: StudyData) -> list[tuple[str, str]]:
        """What the study declares of this kind, (label, value) each, for the report's "What was run" (shown
        whether or not the kind has a result)."""
        return []

    def tables(self, result: Any, data: StudyData, fmt: TableFormat) -> list[str]:
        """The kind's tables in an export file, Markdown or LaTeX, each ending with a newline."""
        return []

    def appendix(self, result: Any, data: StudyData, fmt: TableFormat) -> list[str]:
        """Tables an export file puts after every readout's `tables` (the per-seed detail)."""
        return []

    def rows(self, result: Any, data: StudyData) -> pd.DataFrame | None:
        """The kind's tidy rows, appended to the CSV and Parquet export after the earlier readouts' rows (their
        columns first, then this kind's own)."""
        return None

    def json(self, result: Any, data: StudyData) -> Any | None:
        """What `--json` shows of the kind (`reslab compare --json`'s `readouts.<name>`, schema
        `orchestrator/cli/schemas/compare.v1.json`): plain data, a list of row objects or an object of such lists;
        None: nothing. By default the kind's tidy rows (`rows`), if it has any."""
        rows = self.rows(result, data)
        return None if rows is None else rows.to_dict("records")

    def section(self, result: Any, data: StudyData) -> list[str]:
        """The HTML report's section, in parts the page joins with newlines."""
        return []

    def plots(self, result: Any, data: StudyData) -> list[tuple[Plot, str]]:
        """The report's plots with their captions."""
        return []

    def artifacts(self, result: Any, data: StudyData, out: Path) -> dict[str, pd.DataFrame]:
        """Write the result's files into `out` (CSV, PNG); returns MLflow tables (artifact file -> table)."""
        return {}

    def series(self, result: Any, data: StudyData) -> Series:
        """MLflow metric series for the submission's parent run."""
        return {}
