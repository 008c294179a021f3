"""Planning, dispatch, the worker entry point, MLflow tracking and the `reslab` CLI.

    cli/            the `reslab` command, one module per command group; each command parses,
                    calls one function of the modules below and formats what it returns
    plan.py         what `reslab run` would do with each run, and why (reads run directories)
    submit.py       the driver loop: plan, dispatch with bounded concurrency, retries, Ctrl-C
    tune.py         `reslab tune`: an Optuna study per arm, asked and told here, trials dispatched
                    as runs through the same backends; `--from-tune` reads the best trials
    dispatch/       backends: `ray_backend` (the only module importing ray) and the in-process
                    `local_backend` that tests use to run the same worker function
    worker.py       `execute_run`: one run in whatever process a backend provides
    workspace.py    the workspace layout, run directories (status, lease, records), `RunState`
    tracking.py     MLflow: the driver's writer, study readers, the dashboard (only mlflow importer)
    progress.py     the live progress display and `reslab status`'s snapshot (counts, ETA)
    readout.py      a study's paired comparison: MLflow records from tracking, handed to results
    envinfo.py      versions, host, GPUs and the git code version recorded with each run
    reaper.py       ends the processes a command started (local Ray, the MLflow UI) when it dies

Dependencies point one way (tests/test_import_direction.py): orchestrator -> experiments ->
models -> kernels. results never imports the orchestrator: `readout` fetches the MLflow records
through `tracking.fetch_study_runs` and hands them to `results.collect` as plain dicts.
"""
