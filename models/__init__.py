"""The decoder backbone, the residual variants, data, diagnostics and the training loop.

The training loop (`training`) always runs in a `distributed.Parallel` (one process is a world of
one, `ONE_PROCESS`), and its checkpoints are one component, `checkpoint.Checkpointer`, which picks
the layout (`checkpoint.pt` or DCP step directories) once.

Data lives here rather than under orchestrator/ because it yields torch tensors: only models/
and kernels/ touch torch.
"""
