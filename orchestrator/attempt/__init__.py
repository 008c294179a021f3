"""The attempt: one try at one run, in whatever process a backend gives it (a Ray task, or this
process in tests). It owns `worker.execute_run` (claim the run directory, hold its lease, pull and
push run storage, train, report the outcome; or do a finished run's work after training: `after.py`,
its evaluations, `evaluation.py`, and its interventions, `intervention.py`), training on N ranks through Ray Train
(`distributed_run.py`), what training calls back into (`hooks.py`: the recorder, the lease fence, a
search's pruner, `$RESLAB_STEP_HOOK`), a trial's side of a search (`pruning.py`), torch's thread
count (`threads.py`) and what a run ran on (`envinfo.py`: versions, host, GPUs, the code version and
the fingerprint a worker checks against the driver's). An attempt may import `durability` and
`tasks` (besides `models`, `experiments` and `common`), never `driving`, `dispatch`, `tracking` or
`cli`: it talks to the driver only through the events it reports, so the driver stays the only
MLflow writer. `dispatch` (which runs `execute_run`), `tracking` (the code version) and `driving`
import it.
"""
