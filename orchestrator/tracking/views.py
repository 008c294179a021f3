"""How a study looks in the MLflow UI: its experiment's tags and the links `reslab dashboard` prints.

The study's experiment carries `study_tags()`: the "Model training" kind and a saved runs view
grouped by arm, which `study_view_url` opens; `study_links` lists every study of a store with it.
"""

from __future__ import annotations

import base64
import json
import time
import zlib
from typing import Any

from reslab.orchestrator.tracking.store import import_mlflow, store_error, store_uri

# MLflow 3's experiment kind; UIs without 3.17's GenAI / Model training switch open the experiment
# in its model-training view when it is set (3.17 ignores it: see `study_view_url`).
EXPERIMENT_KIND_TAG, EXPERIMENT_KIND = "mlflow.experimentKind", "custom_model_development"
# A saved view of the experiment's runs page (MLflow 3.17 keeps saved views as experiment tags
# `mlflow.sharedViewState.<id>` holding a JSON envelope with the deflated page state): runs grouped by
# their arm tag, every run shown in the charts, the headline metrics and the seed as columns. Killed and
# failed runs (an interrupted submission's, perhaps under other `--set` overrides) are filtered out, so a
# group's mean is over the runs that finished or are running; the filter stands in the search box, where a
# user clears it to see them. The run-name column is wide enough for `arm/grid point/s<seed>` and for the
# group rows' "Group: <arm>", so arms sharing a prefix (`prenorm_adamw`, `prenorm_muon`) read apart: MLflow
# applies `columnWidths` to the columns `columnOrder` lists, by column id.
BY_ARM_VIEW_ID = "reslab-by-arm"
BY_ARM_VIEW_TAG = f"mlflow.sharedViewState.{BY_ARM_VIEW_ID}"
BY_ARM_VIEW_NAME = "runs by arm (reslab)"
RUN_NAME_COLUMN, RUN_NAME_WIDTH = "attributes.`Run Name`", 300  # MLflow's default: 190 px
SHOWN_RUNS = "attributes.status != 'KILLED' AND attributes.status != 'FAILED'"
BY_ARM_VIEW_STATE: dict[str, Any] = {
    "searchFilter": SHOWN_RUNS, "orderByKey": "attributes.start_time", "orderByAsc": False, "startTime": "ALL",
    "lifecycleFilter": "Active", "datasetsFilter": [], "modelVersionFilter": "All Runs",
    "selectedColumns": ["metrics.`val_loss_tail`", "metrics.`val_loss`", "tags.`seed`", "tags.`grid_key`"],
    "columnOrder": [RUN_NAME_COLUMN], "columnWidths": {RUN_NAME_COLUMN: RUN_NAME_WIDTH},
    "runsHiddenMode": "SHOWALL", "viewMaximized": False,
    "runListHidden": False, "isAccordionReordered": False, "useGroupedValuesInCharts": True, "hideEmptyCharts": True,
    "groupBy": {"aggregateFunction": "average", "groupByKeys": [{"mode": "tag", "groupByData": "arm"}]},
    "groupsExpanded": {},
    "globalLineChartConfig": {"xAxisKey": "step", "lineSmoothness": 0, "selectedXAxisMetricKey": ""},
}


def study_tags() -> dict[str, str]:
    """The tags of a study's experiment: its kind and the saved view `BY_ARM_VIEW_NAME`."""
    state = "deflate;" + base64.b64encode(zlib.compress(json.dumps(BY_ARM_VIEW_STATE).encode())).decode()
    view = {"name": BY_ARM_VIEW_NAME, "createdAt": int(time.time() * 1000), "state": state}
    return {"reslab_kind": "study", EXPERIMENT_KIND_TAG: EXPERIMENT_KIND, BY_ARM_VIEW_TAG: json.dumps(view)}


def study_view_url(base_url: str, experiment_id: str, by_arm: bool = True) -> str:
    """The dashboard page of a study's runs, grouped by arm (the saved view) when `by_arm`, in the
    "Model training" view. MLflow 3.17 picks GenAI or Model training from the `workflowType` query
    parameter, else from the browser's last choice, else GenAI; the experiment kind tag does not
    decide it, so the link names it."""
    view = f"viewStateShareKey={BY_ARM_VIEW_ID}&" if by_arm else ""
    return f"{base_url.rstrip('/')}/#/experiments/{experiment_id}/runs?{view}workflowType=machine_learning"


def study_links(tracking_uri: str, base_url: str) -> list[tuple[str, str]]:
    """(study, its `study_view_url`) for every study experiment of the store, by name; grouped by
    arm where the experiment has the saved view (an experiment made before it gets it from its next
    `reslab run`)."""
    uri = store_uri(tracking_uri)
    try:
        client = import_mlflow()(tracking_uri=uri)
        found = client.search_experiments(filter_string="tags.reslab_kind = 'study'", max_results=1000)
    except Exception as exc:  # a store that stopped answering since the dashboard started: one line
        raise store_error(uri, exc) from None
    return sorted((e.name, study_view_url(base_url, e.experiment_id, BY_ARM_VIEW_TAG in e.tags)) for e in found)
