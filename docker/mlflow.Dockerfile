# MLflow tracking server backed by PostgreSQL, artifacts on a shared volume.
FROM python:3.11-slim
RUN pip install --no-cache-dir 'mlflow>=3,<4' psycopg2-binary
EXPOSE 5000
