"""Gathering results: the one place where a study's records become the plain data its readouts take.

`gather.py` reads MLflow (through `tracking.readers`), the run directories (eval curves, diagnostics),
the runs' costs (`experiments.budget`) and the study into `results.readouts.base.StudyData`, builds the
`results.readout.StudyReadout`, and prints, writes or publishes what it renders: `reslab compare`,
`export` and `report`, the end of `reslab run` and the parent MLflow run all go through it. Nothing
here knows the kinds of result; that is `results.readout`'s list. It may import experiments/, models/
(the presets, the diagnostics' routing matrix), results/, `orchestrator.tracking`, the durability
layer (the workspace) and `orchestrator.attempt.evaluation`'s reader of the evaluations' per-item
records; nothing in the orchestrator imports it but the CLI.
"""
