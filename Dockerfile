# One image for the API and the workers: PyPI's Linux x86_64 torch wheel carries CUDA, so workers use the GPU that
# docker-compose reserves for them.
FROM python:3.11-slim

ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PROXIMA_HOME=/data
WORKDIR /app

COPY pyproject.toml constraints.txt README.md ./
COPY trainer ./trainer
COPY api ./api
COPY worker ./worker
COPY migrations ./migrations
COPY alembic.ini ./
RUN pip install -c constraints.txt -e .  # editable: migrations/ is read from the source tree

EXPOSE 8000
CMD ["proxima", "serve", "--host", "0.0.0.0", "--port", "8000", "--no-worker"]
