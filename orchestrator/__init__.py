"""Planning, dispatch, the worker entry point, MLflow tracking and the `reslab` CLI, one folder per role.

    tasks.py        the vocabulary every role imports: task, outcome, completion, resources, and a
                    run's life cycle (`RunState`, `Action`) with `WORDS`, the one table of its words in
                    every layer: the CLI, the status file, MLflow's statuses and tags (a leaf: it
                    imports only the run spec)
    driving/        what the driver runs to turn a study or a search into dispatched runs
        loop.py         the one dispatch loop: concurrency (GPU-aware), device check, retries, held
                        runs, signals; a study, a sequential study and a search are its task sources
        plan.py         what `reslab run` would do with each run, and why (reads run directories)
        submit.py       a study as the loop's source (a sequential one look by look): plan, tracking
                        of the submission, the result; the power check each study command makes once
        sequential.py   a sequential study's looks: which runs each releases, the test read on the
                        finished runs' run directories
        gates.py        a gates study's looks: gate by gate, which runs each releases, each treatment's
                        decision read on the finished runs' run directories (`results.gates`)
        tune.py         `reslab tune`: an Optuna study per arm as the loop's source, asked and told
                        here; `--from-tune` reads the best trials
        progress.py     the live progress display and `reslab status`'s snapshot (counts, ETA)
        jobs.py         `reslab submit`'s Ray Jobs client: the job, token auth, submitting and
                        following it
        dataprep.py     what `reslab data prepare` runs: the flags turned into one corpus preparation
        evaluations.py  a study's evaluations as the loop's tasks: one per finished run with (run, task)
                        units pending, what came of each (lines, MLflow metrics); the tasks' check
    attempt/        one try at one run, in whatever process a backend provides
        worker.py       `execute_run`: claim, lease, training, outcome
        evaluation.py   an evaluation task: a finished run's (run, task) units evaluated once each
                        (lock, marker), their records in `evals/` and on run storage
        distributed_run.py  a run's training on N ranks through Ray Train (`--gpus-per-run N`): the
                        launch, and what every rank runs (`rank_main`; rank 0 records)
        hooks.py        what training calls back into, built in one place (`step_hooks`): the
                        recorder (records, events, lease fence, checkpoint push), a search's pruner,
                        and the `$RESLAB_STEP_HOOK` extension point
        pruning.py      a trial's side in the worker (report evals, prune) and the search's storage
        threads.py      torch's thread count in a process that trains
        envinfo.py      versions, host, GPUs and the git code version recorded with each run; the
                        code fingerprint a worker checks against the driver's
    durability/     the state that outlives a process, and what keeps it consistent when one dies
        workspace.py    the workspace layout, run directories (status, lease, records)
        lease.py        leases: who holds a run directory or a study, and whether that holder is alive
        storage.py      run storage (a path, s3://, gs://) that run directories are pushed to and
                        pulled from
        storage_sync.py an attempt's side of run storage: the pull before the claim, the uploader
                        that pushes after every checkpoint, the push at the attempt's end
        outage.py       waiting out an outage of a service: backoff, status lines, the timeout
        reaper.py       ends the processes a command started (local Ray, the MLflow UI) when it dies
    dispatch/       backends: `ray_backend` (Ray tasks; ray is imported besides only by
                    `attempt.distributed_run` and `driving.jobs`) and the in-process `local_backend`
                    that tests use to run the same worker function
    tracking/       MLflow by role: the plain writer (`writer.MlflowWriter`) and the outage-guarded
                    tracker around it (`guarded.GuardedTracker`), store and URIs, readers, artifact
                    relocation, the study view, the dashboard; `protocol.DriverTracker`, `NullTracker`
    gathering/      a study's records (MLflow, run directories, costs, the study) gathered into the
                    plain data of its readouts (`results.readout.StudyReadout`), printed, written and
                    published from there; it knows no kind of result
    cli/            the `reslab` command, one module per command group; each command parses,
                    calls one function of the folders above and formats what it returns

Between the folders, imports point one way, with no cycle: `cli` -> `driving` (and `gathering`) -> `dispatch` and
`tracking` -> `attempt` -> `durability` -> `tasks` (each may also skip a step, as `driving` ->
`durability` does); each folder's `__init__` states what it may import.

Dependencies point one way (tests/test_import_direction.py): orchestrator -> experiments ->
models -> kernels -> common, and no module imports another that imports it back. results never
imports the orchestrator: `gathering.gather` fetches the MLflow records through
`tracking.readers.fetch_study_runs` and hands them to `results` as plain data.
"""
