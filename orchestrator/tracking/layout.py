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
not metrics, see `MlflowWriter.finish`) and `cost/machine` (the CPU, with its threads, or the GPU its
serving cost was measured on, when it measured one: `models.serving`); metrics = every train log and
eval at its step; artifacts =
`config.json` (the RunSpec), `env.json`, `info.json` and `diagnostics/step_NNNNNN.json`. The
study's experiment carries `views.study_tags()`. The parent run carries the study's result after
`reslab run` (`MlflowWriter.log_study_result`): the paired table (MLflow table and CSV), the forest plot,
the sweep curves and the HTML report; and the experiment's description (`NOTE_TAG`, the Markdown
MLflow renders on the experiment's page) carries the latest paired table with links to that parent
run and its report, between `RESULT_BEGIN` and `RESULT_END`, so any text a user wrote there stays
(`result_note`). A publication is whole once `PUBLISHED_TAG` is on the parent run and the experiment,
set last (`MlflowWriter.mark_published`): its value is the key of the finished runs the result was
computed from, so a later submission republishes when the experiment's key differs from its own (a
driver killed before its publication was whole, or new runs finished), and only then. The parent of a
submission that publishes stays RUNNING until the publication is whole: it is FINISHED only with its
result on it.

`MLFLOW_STATUS` maps a run's state to the status of its MLflow child run: the MLflow column of the
vocabulary table (`orchestrator.tasks.WORDS`). A child's `state` tag holds the state as its run
directory records it (SUCCESS, FAILED, INTERRUPTED, or RETRYING while a failed attempt is retried).
"""

from __future__ import annotations

from reslab.orchestrator.tasks import WORDS, RunState

KIND_RUN, KIND_SUBMISSION = "run", "submission"
MLFLOW_STATUS: dict[RunState, str] = {s: status for s in RunState if (status := WORDS[s].mlflow) is not None}
FINISHED, KILLED = MLFLOW_STATUS[RunState.SUCCESS], MLFLOW_STATUS[RunState.INTERRUPTED]
EVAL_PREFIX = "eval/"  # + task + "/" + metric: a downstream metric of a run's evaluation (`MlflowWriter.log_after`)
SUMMARY_TAG = "summary/"  # + a summary metric's name: the tag holding its final value (repr of the float)
COST_MACHINE_TAG = "cost/machine"  # what the serving cost was measured on (`models.serving.machine`: its "name")
SIMULATED_TAG = "reslab.simulated"  # a bench's simulated run (`orchestrator.attempt.simulate`): its spec
NOTE_TAG = "mlflow.note.content"  # an experiment's (or run's) description, rendered as Markdown by the MLflow UI
RESULT_BEGIN, RESULT_END = "<!-- reslab: the latest result -->", "<!-- reslab: end of the latest result -->"
PUBLISHED_TAG = "reslab.published"  # the key of the finished runs a whole publication was computed from
ANALYSIS_HASH_TAG = "reslab.analysis_hash"  # a submission's analysis plan, hashed (`results.verdict.plan_hash`)


def result_note(previous: str, table_md: str, experiment_id: str, parent_id: str, submission: str,
                limit: int = 5000, verdicts: str = "") -> str:
    """The experiment's description with its result section replaced by the latest one (the paired table
    as Markdown, links to the submission's parent run and its `report.html`); text outside the section
    is kept as it was. A table too long for an MLflow tag (`limit` characters in all) keeps its first
    lines and says where the rest is."""
    run = f"#/experiments/{experiment_id}/runs/{parent_id}"
    kept_out = previous.partition(RESULT_BEGIN)[0] + previous.partition(RESULT_END)[2]
    room = limit - len(kept_out) - 600  # the section's own lines and links
    lines = table_md.strip().splitlines()
    while lines and len("\n".join(lines)) > room:
        lines.pop()
    if len(lines) < len(table_md.strip().splitlines()):
        lines += ["", "(the rest of the table is in the report and `paired_table.csv`)"]
    table_md = "\n".join(lines)
    section = "\n".join([
        RESULT_BEGIN,
        f"### Latest result: {verdicts}" if verdicts else f"### Latest result: {submission}",
        *([f"({submission})"] if verdicts else []),
        "",
        f"[The full report]({run}/artifacts/report.html) (self-contained HTML, also `reslab report`) and the "
        f"paired table, plots and per-seed CSV are on [this submission's run]({run}). The table:",
        "",
        table_md.strip(),
        RESULT_END,
    ])
    if RESULT_BEGIN in previous and RESULT_END in previous:
        head, _, rest = previous.partition(RESULT_BEGIN)
        return head + section + rest.partition(RESULT_END)[2]
    return (previous.rstrip() + "\n\n" + section) if previous.strip() else section
