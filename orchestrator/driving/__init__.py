"""Driving: what runs on the driver (the machine a `reslab` command runs on, or a Ray job's driver)
to turn a study or a search into dispatched runs and follow them to the end. It owns the one
dispatch loop (`loop.py`: concurrency, the device check, retries, held runs, signals) and its task
sources: a study, a sequential study and a gates study (`submit.py`, with `sequential.py`'s and `gates.py`'s
looks) and a search
(`tune.py`); the plan of what would run and why (`plan.py`); the live progress and `reslab status`
(`progress.py`); `reslab submit`, which hands a study's driver to a cluster as a Ray job (`jobs.py`);
and `reslab data prepare` (`dataprep.py`), which sits here because it is driver-side work a user runs
before dispatching anything: it reads the user's files or a hub dataset and writes the corpus every
attempt later reads, and it is neither an attempt, nor durable run state, nor a result.
Its work after training (`after.py`: evaluations, `evaluations.py`, and interventions, `interventions.py`)
is a study's further tasks: each finished run's evaluation on downstream tasks and its knock-outs, one task
per run, released by a source wrapped around the study's (`after.AfterSource`) and dispatched by the same loop.
Driving may import `attempt` (only the code version, `envinfo`, the search's storage, `pruning`, which work
after training is pending, `evaluation`, `intervention`, and the work a task carries, `after`), `dispatch`,
`durability`, `tracking` and `tasks`, besides `experiments`, `models`, `results` and `common`; nothing
in `attempt`, `durability`, `dispatch` or `tracking` imports driving, and only `cli` calls into it.
"""
