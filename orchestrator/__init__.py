"""Planning, dispatch, the worker entry point, MLflow tracking and the `reslab` CLI.

    cli.py          argument parsing; every command is a thin call into the modules below
    plan.py         what `reslab run` would do with each run, and why (reads run directories)
    submit.py       the driver loop: plan, dispatch with bounded concurrency, retries, Ctrl-C
    dispatch/       backends: `ray_backend` (the only module importing ray) and the in-process
                    `local_backend` that tests use to run the same worker function
    worker.py       `execute_run`: one run in whatever process a backend provides
    workspace.py    the workspace layout and run directories (status, lease, records)
    tracking.py     MLflow: the driver's writer, study readers, the dashboard (only mlflow importer)
    progress.py     the live progress display
    envinfo.py      versions, host, GPUs and the git code version recorded with each run

Dependencies point one way: experiments (specs) -> orchestrator -> models (training); results
reads MLflow through `tracking.fetch_study_runs`.
"""
