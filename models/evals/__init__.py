"""Downstream evaluation of trained models with lm-evaluation-harness (the optional `eval` extra).

`adapter.ReslabLM` puts a `Decoder` and its tokenizer behind the harness's model interface; `next_line` builds
the local multiple-choice task from a corpus's validation split (nothing is downloaded); `harness` finds and
checks tasks and runs one evaluation, returning per-task metrics and per-item records; `run_model` reads a
finished run's model back from its run directory and evaluates it. They live in models/ because they run the
model (torch); the statistics over their records are `results.tasks`, pure numpy.
"""
