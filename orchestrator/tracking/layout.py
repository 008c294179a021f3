"""The MLflow layout reslab writes and reads: record kinds, run statuses, summary tags.

One experiment per study (named after it), one parent run per submission (`reslab_kind` =
`KIND_SUBMISSION`), one child run per run id (`reslab_kind` = `KIND_RUN`), named `arm/grid
point/s<seed>`. A child is found again by `tags.run_id` (never by params, which compare as
strings), so a resumed or re-submitted run reuses its child and is moved under the submission that
completes it (`tracking.writer`).

Child runs carry params = the flattened resolved config, model sizes resolved from the preset
(values over MLflow's 6000-character limit are truncated with a marker; `config.json` holds them
whole); tags `run_id, study, arm, seed, pair_key, grid_key, residual, code_version, git_sha,
results_version, reslab_kind=run` and, once it succeeds, `summary/<name>` (its final summary; tags,
not metrics, see `Tracker.finish`); metrics = every train log and eval at its step; artifacts =
`config.json` (the RunSpec), `env.json`, `info.json` and `diagnostics/step_NNNNNN.json`. The
study's experiment carries `views.study_tags()`. The parent run carries the study's result after
`reslab run` (`Tracker.log_study_result`): the paired table (MLflow table and CSV), the forest plot,
the sweep curves and the HTML report.

`MLFLOW_STATUS` is the one mapping of a run's state to the status of its MLflow child run.
"""

from __future__ import annotations

from reslab.orchestrator.tasks import RunState

KIND_RUN, KIND_SUBMISSION = "run", "submission"
# The one mapping of a run's state (its run directory) to the status of its MLflow child run.
MLFLOW_STATUS: dict[RunState, str] = {
    RunState.RUNNING: "RUNNING", RunState.SUCCESS: "FINISHED", RunState.FAILED: "FAILED",
    RunState.INTERRUPTED: "KILLED",
}
FINISHED, KILLED = MLFLOW_STATUS[RunState.SUCCESS], MLFLOW_STATUS[RunState.INTERRUPTED]
SUMMARY_TAG = "summary/"  # + a summary metric's name: the tag holding its final value (repr of the float)
