# Two images from one file. `api`: the service (API, migrations, REST clients), which imports no torch. `worker`: the
# trainer on top of it; PyPI's Linux x86_64 torch wheel carries CUDA, so workers use the GPU that docker-compose
# reserves for them. The trainer's dependencies (torch, transformers, peft, ...) are pyproject.toml's `train` extra:
# only the worker image holds them.
FROM python:3.11-slim AS api

ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PROXIMA_HOME=/data
WORKDIR /app

# Graders run in both images (dry-runs in the API's grading processes, training in the workers): bubblewrap and
# Debian's python3 (/usr/bin/python3) for the python grader's sandbox (trainer/grading/sandbox.py), WordNet 3.0 for
# text_similarity's meteor (trainer/grading/similarity.py).
RUN apt-get update && apt-get install -y --no-install-recommends bubblewrap python3 wordnet-base \
    && rm -rf /var/lib/apt/lists/*

# The packages python graders import (trainer/grading/sandbox_packages: OpenAI's grader image's), built for Debian's
# python3, read-only in every sandbox: its own layer, rebuilt only when the requirements change.
COPY trainer/grading/sandbox_packages/ ./trainer/grading/sandbox_packages/
RUN PIP_PYTHON=python3 trainer/grading/sandbox_packages/build trainer/grading/sandbox_packages/requirements.txt \
    /opt/sandbox-packages /usr/bin/python3
ENV PROXIMA_SANDBOX_PACKAGES=/opt/sandbox-packages

COPY pyproject.toml constraints.txt README.md ./
COPY trainer ./trainer
COPY api ./api
COPY worker ./worker
COPY proxima ./proxima
COPY migrations ./migrations
COPY alembic.ini ./
RUN pip install -c constraints.txt -e .  # editable: migrations/ is read from the source tree

EXPOSE 8000
CMD ["proxima", "serve", "--host", "0.0.0.0", "--port", "8000", "--no-worker"]

FROM api AS worker
# g++: torch.compile's CPU code (the compiled decode step, compile_decode) is C++ that inductor builds at run time;
# without a compiler the step runs uncompiled and the job says so.
RUN apt-get update && apt-get install -y --no-install-recommends g++ && rm -rf /var/lib/apt/lists/*
RUN pip install -c constraints.txt -e ".[train]"
CMD ["proxima", "worker", "--concurrency", "1"]
