"""The decoder backbone, the residual variants, data, diagnostics and the training loop.

Data lives here rather than under orchestrator/ because it yields torch tensors: only models/
and kernels/ touch torch.
"""
