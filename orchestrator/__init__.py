"""Planning, Ray dispatch, the worker entry point, MLflow tracking and the `reslab` CLI."""
