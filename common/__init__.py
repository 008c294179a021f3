"""The bottom of reslab: what every layer may import, the kernels included.

`errors` (the one `ReslabError` family and its exit codes), `io` (atomic writes and file locks) and
`metrics` (the summary-metric registry). Standard library only: nothing here imports another reslab
folder, so importing it never pulls in torch, Ray or MLflow.
"""
