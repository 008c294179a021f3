# The MLflow tracking server (PostgreSQL store through psycopg 3, artifacts proxied to a volume). It installs only
# mlflow and psycopg, at the versions of the same lock as the reslab image (`-c`: the lock as constraints), so the
# server and the drivers run one MLflow. Build from the repository root:
#   docker build -f docker/mlflow.Dockerfile -t reslab-mlflow:latest .
ARG BASE=python:3.11.14-slim-bookworm
FROM ${BASE}

ENV PYTHONDONTWRITEBYTECODE=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
COPY docker/requirements.lock /tmp/requirements.lock
RUN pip install -c /tmp/requirements.lock mlflow 'psycopg[binary]' && pip check
EXPOSE 5000
