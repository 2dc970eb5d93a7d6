"""API latency under load, with PostgreSQL and Redis (issue 3's benchmark; results in BENCHMARKS.md).

Starts `proxima serve --no-worker` on PostgreSQL + Redis in a subprocess, seeds a job with 10,000 metric rows, then
drives `GET /v1/fine_tuning/jobs/{id}` and `GET /v1/fine_tuning/jobs/{id}/metrics` from a separate load process at a
fixed request rate (open loop: requests are sent on schedule whatever the latency, so queueing shows up), and prints
achieved requests/s and p50/p90/p99 latency. Then it starts one idle worker and measures the time from
`POST /v1/fine_tuning/jobs` to status `running`.

    .venv/bin/python bench/api_latency.py --rate 200 --seconds 10
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import httpx
import psycopg2

PG = "postgresql+psycopg2://postgres@127.0.0.1:5432/{db}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def create_database() -> str:
    name = f"proxima_bench_{uuid.uuid4().hex[:8]}"
    conn = psycopg2.connect(host="127.0.0.1", user="postgres", dbname="test")
    conn.autocommit = True
    conn.cursor().execute(f'CREATE DATABASE "{name}"')
    conn.close()
    return name


def drop_database(name: str) -> None:
    conn = psycopg2.connect(host="127.0.0.1", user="postgres", dbname="test")
    conn.autocommit = True
    conn.cursor().execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    conn.close()


def seed(env: dict[str, str], n_metrics: int) -> tuple[str, str]:
    """A tenant, its key and a job with n_metrics metric rows; returns (key, job id)."""
    os.environ.update(env)
    from api import ids
    from api.auth import create_key
    from api.db import session_scope
    from api.migrate import upgrade
    from api.orm import Job, JobMetric

    url = env["PROXIMA_DATABASE_URL"]
    upgrade(url)
    with session_scope(url) as s:
        tenant, key = create_key(s, tenant_name="bench")
        job = Job(
            id=ids.job_id(),
            tenant_id=tenant.id,
            model="tiny-arith",
            training_file="file-x",
            status="running",
            spec={"method": {"type": "grpo"}},
            seed=0,
            result_files=[],
        )
        s.add(job)
        s.flush()
        values = {f"metric/{i}": float(i) for i in range(24)}  # about the width of a real GRPO step
        s.add_all(JobMetric(job_id=job.id, step=i, values=values) for i in range(1, n_metrics + 1))
        return key, job.id


def load(base: str, key: str, path: str, rate: float, seconds: float, out: mp.Queue) -> None:  # type: ignore[type-arg]
    """Open-loop load from its own process: one request every 1/rate s, latency from the scheduled send time."""

    async def run() -> list[float]:
        lat: list[float] = []
        errors = 0
        limits = httpx.Limits(max_connections=256, max_keepalive_connections=256)
        async with httpx.AsyncClient(
            base_url=base, headers={"Authorization": f"Bearer {key}"}, limits=limits, timeout=30
        ) as client:

            async def one(t_sched: float) -> None:
                nonlocal errors
                r = await client.get(path)
                if r.status_code != 200:
                    errors += 1
                lat.append(time.perf_counter() - t_sched)

            tasks = []
            start = time.perf_counter()
            n = int(rate * seconds)
            for i in range(n):
                t_sched = start + i / rate
                delay = t_sched - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(one(t_sched)))
            await asyncio.gather(*tasks)
            elapsed = time.perf_counter() - start
        out.put({"latencies": lat, "errors": errors, "elapsed": elapsed})
        return lat

    asyncio.run(run())


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(p / 100 * (len(xs) - 1)))]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rate", type=float, default=200.0)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--metrics-rows", type=int, default=10_000)
    ap.add_argument("--metrics-rate", type=float, default=2.0, help="request rate for the 10k-row metrics read")
    ap.add_argument("--api-workers", type=int, default=1, help="uvicorn worker processes")
    args = ap.parse_args()

    db = create_database()
    home = Path(tempfile.mkdtemp(prefix="proxima-bench-"))
    port = free_port()
    env = {
        **os.environ,
        "PROXIMA_DATABASE_URL": PG.format(db=db),
        "PROXIMA_BROKER_URL": "redis://127.0.0.1:6379/13",
        "PROXIMA_ARTIFACTS": str(home / "artifacts"),
        "PROXIMA_HOME": str(home),
        "PROXIMA_PORT": str(port),
    }
    server = worker = None
    try:
        key, job_id = seed(env, args.metrics_rows)
        from trainer.tiny_arith import build_tiny_arith

        built = Path.home() / ".proxima" / "models" / "tiny-arith"  # reuse a build when there is one
        if built.is_dir():
            shutil.copytree(built, home / "models" / "tiny-arith")
        else:
            build_tiny_arith(home / "models" / "tiny-arith")
        server = subprocess.Popen(
            [sys.executable, "-m", "api.cli", "serve", "--no-worker", "--workers", str(args.api_workers)], env=env
        )
        base = f"http://127.0.0.1:{port}"
        for _ in range(200):
            try:
                if httpx.get(base + "/readyz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        results = {}
        for label, path, rate in (
            ("GET job", f"/v1/fine_tuning/jobs/{job_id}", args.rate),
            (f"GET metrics ({args.metrics_rows} rows)", f"/v1/fine_tuning/jobs/{job_id}/metrics", args.metrics_rate),
        ):
            q: mp.Queue = mp.Queue()  # type: ignore[type-arg]
            p = mp.Process(target=load, args=(base, key, path, rate, args.seconds, q))
            p.start()
            res = q.get()
            p.join()
            lat = [x * 1000 for x in res["latencies"]]
            results[label] = {
                "target_rps": rate,
                "achieved_rps": round(len(lat) / res["elapsed"], 1),
                "errors": res["errors"],
                "p50_ms": round(statistics.median(lat), 2),
                "p90_ms": round(pct(lat, 90), 2),
                "p99_ms": round(pct(lat, 99), 2),
                "n": len(lat),
            }
            print(f"{label:<28} {json.dumps(results[label])}", flush=True)

        # POST → running with an idle worker.
        worker = subprocess.Popen([sys.executable, "-m", "api.cli", "worker"], env=env)
        from trainer.tiny_arith import write_arithmetic_datasets

        data = write_arithmetic_datasets(home / "data")
        h = {"Authorization": f"Bearer {key}"}
        with data["train"].open("rb") as f:
            fid = httpx.post(
                base + "/v1/files", headers=h, files={"file": ("train.jsonl", f)}, data={"purpose": "fine-tune"}
            ).json()["id"]
        time.sleep(5)  # the worker is up and idle
        grader = {
            "type": "string_check",
            "name": "acc",
            "input": "{{sample.output_text}}",
            "reference": "{{item.answer}}",
            "operation": "eq",
        }
        body = {
            "model": "tiny-arith",
            "training_file": fid,
            "method": {
                "type": "grpo",
                "grpo": {"grader": grader, "hyperparameters": {"max_steps": 2, "batch_size": 2, "group_size": 2}},
            },
        }
        t0 = time.perf_counter()
        job = httpx.post(base + "/v1/fine_tuning/jobs", headers=h, json=body).json()
        while True:
            st = httpx.get(base + f"/v1/fine_tuning/jobs/{job['id']}", headers=h).json()["status"]
            if st != "queued" and st != "validating_files":
                break
            time.sleep(0.01)
        print(f"POST → {st}: {time.perf_counter() - t0:.3f} s", flush=True)
    finally:
        for p in (worker, server):
            if p is not None:
                p.terminate()
                p.wait(timeout=30)
        drop_database(db)


if __name__ == "__main__":
    main()
