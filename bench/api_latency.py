"""API latency under load, with PostgreSQL and Redis (results in BENCHMARKS.md).

Starts `proxima serve --no-worker` on PostgreSQL + Redis in a subprocess, seeds a job with 10,000 metric rows, then
drives `GET /v1/fine_tuning/jobs/{id}` and `GET /v1/fine_tuning/jobs/{id}/metrics` from a separate load process at a
fixed request rate and prints achieved requests/s and p50/p90/p99 latency per run, with the machine's load average
before and after each run. Then it starts one idle worker and measures the time from `POST /v1/fine_tuning/jobs` to
status `running`.

    .venv/bin/python bench/api_latency.py --rate 200 --seconds 10 --windows 5

The load generator is open loop: request i is due at start + i/rate whatever happened before, and its latency is
measured from that due time, so a slow server shows as queueing instead of as fewer requests. It speaks HTTP/1.1
over keep-alive connections with raw asyncio streams (about 0.3 ms of CPU a request, where an httpx client costs
about 1.3 ms): on a 2-core machine the generator shares the cores with the server, and a generator that is itself
late reports its own lateness as the server's latency. It reports its lateness (`late_p99_ms`: how long after its
due time a request was actually sent) so that this stays visible.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import itertools
import json
import multiprocessing as mp
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import psycopg2

PG = "postgresql+psycopg2://postgres@127.0.0.1:5432/{db}"

Conn = tuple[asyncio.StreamReader, asyncio.StreamWriter]


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


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of one process (``/proc/PID/stat``), 0 if it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _tree(pid: int) -> list[int]:
    """The process and its descendants (uvicorn's worker processes)."""
    out = [pid]
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError):
            out += [q for c in (task / "children").read_text().split() for q in _tree(int(c))]
    return out


def _named(name: str) -> list[int]:
    pids = []
    for comm in Path("/proc").glob("[0-9]*/comm"):
        with contextlib.suppress(OSError):
            if comm.read_text().strip() == name:
                pids.append(int(comm.parent.name))
    return pids


def cpu_sample(server_pid: int | None, generator_pid: int | None) -> dict[str, float]:
    """CPU seconds so far of the API server (with its worker processes), of PostgreSQL (every ``postgres``
    process: the backends serving the API and the rest) and of the load generator."""
    return {
        "server": sum(_cpu_seconds(p) for p in _tree(server_pid)) if server_pid else 0.0,
        "postgres": sum(_cpu_seconds(p) for p in _named("postgres")),
        "generator": _cpu_seconds(generator_pid) if generator_pid else 0.0,
    }


def steal_seconds() -> float:
    """CPU time the hypervisor gave to others while this VM's CPUs wanted to run (``/proc/stat``'s steal, all CPUs)."""
    fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()
    return int(fields[8]) / os.sysconf("SC_CLK_TCK")


class StealSampler(threading.Thread):
    """Samples ``steal_seconds`` every 50 ms, to see whether a stall was the machine's host taking the CPUs."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.samples: list[tuple[float, float]] = []
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            self.samples.append((time.time(), steal_seconds()))
            self.stop.wait(0.05)

    def between_ms(self, t0: float, t1: float) -> float | None:
        """Steal milliseconds from the last sample at or before t0 to the first at or after t1 (None: not sampled)."""
        before = [v for t, v in self.samples if t <= t0]
        after = [v for t, v in self.samples if t >= t1]
        if not before or not after:
            return None
        return round((after[0] - before[-1]) * 1000, 1)


def loadavg() -> list[float]:
    """The 1, 5 and 15 minute load averages: how busy the shared machine was (2 cores: 2.0 is full)."""
    return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]


async def open_loop(
    host: str, port: int, path: str, key: str, *, rate: float, seconds: float, max_connections: int
) -> dict[str, Any]:
    """GET `path` at `rate` requests/s for `seconds`; per request: (due time from the start, latency from the due
    time, lateness of the send, status)."""
    request = (
        f"GET {path} HTTP/1.1\r\nHost: {host}:{port}\r\nAuthorization: Bearer {key}\r\nAccept: application/json\r\n\r\n"
    ).encode()
    idle: list[Conn] = []
    waiting: list[asyncio.Future[Conn]] = []
    opened = 0
    done: list[tuple[float, float, float, int]] = []

    async def acquire() -> Conn:
        nonlocal opened
        while idle:
            reader, writer = idle.pop()
            if not reader.at_eof() and not writer.is_closing():
                return reader, writer
            writer.close()  # the server closed it while idle (keep-alive timeout)
            opened -= 1
        if opened < max_connections:
            opened += 1
            return await asyncio.open_connection(host, port)
        fut: asyncio.Future[Conn] = asyncio.get_running_loop().create_future()
        waiting.append(fut)
        return await fut

    def release(conn: Conn) -> None:
        if waiting:
            waiting.pop(0).set_result(conn)
        else:
            idle.append(conn)

    async def exchange(conn: Conn) -> int:
        reader, writer = conn
        writer.write(request)
        head = await reader.readuntil(b"\r\n\r\n")
        headers = head.lower()
        at = headers.find(b"\r\ncontent-length:")
        if at < 0:
            raise RuntimeError(f"response without content-length: {head[:200]!r}")
        length = int(headers[at + 17 : headers.index(b"\r\n", at + 2)])
        await reader.readexactly(length)
        return int(head[9:12])

    async def one(due: float) -> None:
        late = time.perf_counter() - due
        conn = await acquire()
        try:
            status = await exchange(conn)
        except (asyncio.IncompleteReadError, ConnectionError):
            # Closed by the server between our check and our write: resend once on a new connection, as HTTP
            # clients do for an idempotent request.
            conn[1].close()
            conn = await asyncio.open_connection(host, port)
            status = await exchange(conn)
        done.append((due - start, time.perf_counter() - due, late, status))
        release(conn)

    in_flight: set[asyncio.Task[None]] = set()  # only the unfinished: a finished task is dropped at once
    start = time.perf_counter() + 0.01
    start_wall = time.time() + (start - time.perf_counter())
    for i in range(int(rate * seconds)):
        due = start + i / rate
        delay = due - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        task = asyncio.create_task(one(due))
        in_flight.add(task)
        task.add_done_callback(in_flight.discard)
    await asyncio.gather(*in_flight)
    elapsed = time.perf_counter() - start
    for _, writer in idle:
        writer.close()
    return {"requests": done, "elapsed": elapsed, "connections": opened, "start_wall": start_wall}


def _load_process(base: str, key: str, path: str, rate: float, seconds: float, max_connections: int, out: Any) -> None:
    # No garbage collection in the generator: its per-request records (tens of thousands of tuples) made gen-2
    # collections that held it up to 90 ms, and it sent late (``late_max_ms``), which reads as the server's latency.
    # It makes no reference cycles worth collecting in a run of minutes.
    gc.disable()
    host, port = base.removeprefix("http://").split(":")
    out.put(
        asyncio.run(open_loop(host, int(port), path, key, rate=rate, seconds=seconds, max_connections=max_connections))
    )


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(p / 100 * (len(xs) - 1)))]


def window_stats(requests: list[tuple[float, float, float, int]], seconds: float) -> dict[str, Any]:
    lat = [r[1] * 1000 for r in requests]
    return {
        "offered_rps": round(len(requests) / seconds, 1),
        "non_200": sum(1 for r in requests if r[3] != 200),
        "p50_ms": round(statistics.median(lat), 2),
        "p90_ms": round(pct(lat, 90), 2),
        "p99_ms": round(pct(lat, 99), 2),
        "max_ms": round(max(lat), 2),
        "late_p99_ms": round(pct([r[2] * 1000 for r in requests], 99), 2),
        "late_max_ms": round(max(r[2] for r in requests) * 1000, 2),
        "n": len(requests),
    }


def measure(
    base: str,
    key: str,
    path: str,
    *,
    rate: float,
    seconds: float,
    windows: int,
    warmup: float,
    max_connections: int,
    server_pid: int | None = None,
) -> list[dict[str, Any]]:
    """One continuous load of `warmup + windows * seconds` from a fresh process (spawned: it imports neither the
    API nor torch), reported per window of `seconds` by due time; the warm-up window comes first, labelled."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_load_process, args=(base, key, path, rate, warmup + windows * seconds, max_connections, q))
    steal = StealSampler()
    steal.start()
    p.start()
    time.sleep(warmup)
    loads = [loadavg()]
    cpus = [cpu_sample(server_pid, p.pid)]
    for _ in range(windows):  # the load average as the windows go by (it is a 1-minute average: a rough guide)
        time.sleep(seconds)
        loads.append(loadavg())
        cpus.append(cpu_sample(server_pid, p.pid))
    res = q.get()
    p.join()
    steal.stop.set()
    steal.join()
    steal.samples.append((time.time(), steal_seconds()))  # the last window ends after the sampler's last tick
    reqs = res["requests"]
    t0_wall = res["start_wall"]  # the generator's t = 0, as wall-clock time
    out = []
    bounds = [(0.0, warmup)] if warmup > 0 else []
    bounds += [(warmup + i * seconds, warmup + (i + 1) * seconds) for i in range(windows)]
    for i, (lo, hi) in enumerate(bounds):
        inside = [r for r in reqs if lo <= r[0] < hi]
        stats = window_stats(inside, hi - lo)
        stats["wall_start"] = t0_wall + lo
        stats["wall_end"] = t0_wall + hi
        stats["steal_ms"] = steal.between_ms(t0_wall + lo, t0_wall + hi)
        if inside:
            slowest = max(inside, key=lambda r: r[1])
            stats["slowest_at_s"] = round(slowest[0] - lo, 2)
            # Steal while the slowest request was in flight (50 ms sampling: the sample just before to just after).
            at = t0_wall + slowest[0]
            stats["steal_during_slowest_ms"] = steal.between_ms(at, at + slowest[1])
        # Answers completed in the window: below the offered rate when the server falls behind.
        stats["achieved_rps"] = round(sum(1 for r in reqs if lo <= r[0] + r[1] < hi) / (hi - lo), 1)
        stats["window"] = "warm-up" if warmup > 0 and i == 0 else f"{lo:g}-{hi:g} s"
        out.append(stats)
    for stats, (before, after), (c0, c1) in zip(
        out[-windows:], itertools.pairwise(loads), itertools.pairwise(cpus), strict=True
    ):
        stats["loadavg_before"], stats["loadavg_after"] = before, after
        # CPU per answered request over the window (sampled by wall clock, so a bound within a few requests).
        answered = max(1.0, stats["achieved_rps"] * seconds)
        for who in ("server", "postgres", "generator"):
            stats[f"{who}_cpu_ms_per_req"] = round((c1[who] - c0[who]) * 1000 / answered, 3)
    out[-windows]["connections"] = res["connections"]
    return out


def maintenance(db: str) -> list[dict[str, Any]]:
    """PostgreSQL's last autovacuum and autoanalyze of each table of the bench database (``pg_stat_user_tables``:
    when each last finished, and how many ran), to match against the windows' stalls."""
    conn = psycopg2.connect(host="127.0.0.1", user="postgres", dbname=db)
    cur = conn.cursor()
    cur.execute(
        "SELECT relname, extract(epoch FROM last_autovacuum), extract(epoch FROM last_autoanalyze), "
        "autovacuum_count, autoanalyze_count FROM pg_stat_user_tables "
        "WHERE autovacuum_count > 0 OR autoanalyze_count > 0 ORDER BY relname"
    )
    rows = [
        {
            "table": r[0],
            "last_autovacuum": float(r[1]) if r[1] is not None else None,
            "last_autoanalyze": float(r[2]) if r[2] is not None else None,
            "autovacuums": r[3],
            "autoanalyzes": r[4],
        }
        for r in cur.fetchall()
    ]
    conn.close()
    return rows


def maintenance_in(window: dict[str, Any], tables: list[dict[str, Any]]) -> list[str]:
    """The autovacuum/autoanalyze runs that finished inside a window (by their last finish time only)."""
    hits = []
    for t in tables:
        for kind in ("last_autovacuum", "last_autoanalyze"):
            at = t[kind]
            if at is not None and window["wall_start"] <= at < window["wall_end"]:
                hits.append(f"{kind.removeprefix('last_')} of {t['table']} at +{at - window['wall_start']:.1f} s")
    return hits


def summary(label: str, windows: list[dict[str, Any]]) -> str:
    """Ranges over the measured windows (never the best one alone)."""

    def span(k: str) -> str:
        values = [r[k] for r in windows if r[k] is not None]
        if not values:
            return "?"
        lo, hi = min(values), max(values)
        return f"{lo:g}" if lo == hi else f"{lo:g}–{hi:g}"

    loads = [x for r in windows for x in (r["loadavg_before"][0], r["loadavg_after"][0])]
    return (
        f"{label}: {len(windows)} windows, achieved {span('achieved_rps')} req/s, p50 {span('p50_ms')} ms, "
        f"p90 {span('p90_ms')} ms, p99 {span('p99_ms')} ms, max {span('max_ms')} ms, non-200 {span('non_200')}, "
        f"generator late p99 {span('late_p99_ms')} ms, load average {min(loads):g}–{max(loads):g}, "
        f"steal {span('steal_ms')} ms a window; CPU per request: "
        f"server {span('server_cpu_ms_per_req')} ms, PostgreSQL {span('postgres_cpu_ms_per_req')} ms, "
        f"generator {span('generator_cpu_ms_per_req')} ms"
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rate", type=float, default=200.0)
    ap.add_argument("--seconds", type=float, default=10.0, help="length of each reported window")
    ap.add_argument("--windows", type=int, default=5, help="reported windows of the job read, back to back")
    ap.add_argument("--warmup", type=float, default=5.0, help="seconds of load before the first window")
    ap.add_argument("--connections", type=int, default=64, help="most keep-alive connections the generator opens")
    ap.add_argument("--metrics-rows", type=int, default=10_000)
    ap.add_argument("--metrics-rate", type=float, default=2.0, help="request rate for the 10k-row metrics read")
    ap.add_argument("--api-workers", type=int, default=1, help="uvicorn worker processes")
    ap.add_argument("--skip-post", action="store_true", help="skip POST → running (needs the tiny-arith build)")
    ap.add_argument("--json", type=Path, help="write every window here")
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
    server = None
    results: dict[str, Any] = {"command": sys.argv, "loadavg_start": loadavg()}
    try:
        key, job_id = seed(env, args.metrics_rows)
        server = subprocess.Popen(
            [sys.executable, "-m", "proxima.cli", "serve", "--no-worker", "--workers", str(args.api_workers)], env=env
        )
        base = f"http://127.0.0.1:{port}"
        for _ in range(300):
            try:
                if httpx.get(base + "/readyz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        load = {"max_connections": args.connections}
        print(f"load average at start: {results['loadavg_start']}", flush=True)

        job_path = f"/v1/fine_tuning/jobs/{job_id}"
        job_load = dict(rate=args.rate, seconds=args.seconds, windows=args.windows, warmup=args.warmup, **load)
        job_load["server_pid"] = server.pid
        windows = measure(base, key, job_path, **job_load)
        tables = maintenance(db)
        results["autovacuum"] = tables
        for w in windows:
            w["maintenance"] = maintenance_in(w, tables)
            print(f"GET job {w['window']}: {json.dumps(w)}", flush=True)
        print(f"autovacuum/autoanalyze of the seeded tables: {json.dumps(tables)}", flush=True)
        results["GET job"] = windows
        label = f"GET metrics ({args.metrics_rows} rows)"
        metrics_path = f"/v1/fine_tuning/jobs/{job_id}/metrics"
        results[label] = measure(
            base,
            key,
            metrics_path,
            rate=args.metrics_rate,
            seconds=args.seconds,
            windows=1,
            warmup=0,
            server_pid=server.pid,
            **load,
        )
        print(f"{label}: {json.dumps(results[label][0])}", flush=True)

        if not args.skip_post:
            seconds, status = post_to_running(env, home, base, key)
            results["POST → running"] = {"seconds": seconds, "status": status}
            print(f"POST → {status}: {seconds:.3f} s", flush=True)
        measured = [w for w in windows if w["window"] != "warm-up"]
        print(summary(f"GET job at {args.rate:g} req/s", measured), flush=True)
        results["loadavg_end"] = loadavg()
        print(f"load average at end: {results['loadavg_end']}", flush=True)
        if args.json:
            args.json.write_text(json.dumps(results, indent=1))
    finally:
        if server is not None:
            server.terminate()
            server.wait(timeout=30)
        drop_database(db)


def post_to_running(env: dict[str, str], home: Path, base: str, key: str) -> tuple[float, str]:
    """Seconds from `POST /v1/fine_tuning/jobs` to the job's first status after `queued` (`running`), with one
    idle worker; and that status."""
    from trainer.builtin_models.tiny_arith import build_tiny_arith, write_arithmetic_datasets

    built = Path.home() / ".proxima" / "models" / "tiny-arith"  # reuse a build when there is one
    if built.is_dir():
        shutil.copytree(built, home / "models" / "tiny-arith")
    else:
        build_tiny_arith(home / "models" / "tiny-arith")
    worker = subprocess.Popen([sys.executable, "-m", "proxima.cli", "worker"], env=env)
    try:
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
                "grpo": {
                    "grader": grader,
                    "hyperparameters": {"max_steps": 2, "batch_size": 2, "group_size": 2, "max_completion_tokens": 8},
                },
            },
        }
        t0 = time.perf_counter()
        job = httpx.post(base + "/v1/fine_tuning/jobs", headers=h, json=body).json()
        while True:
            st = httpx.get(base + f"/v1/fine_tuning/jobs/{job['id']}", headers=h).json()["status"]
            if st != "queued" and st != "validating_files":
                break
            time.sleep(0.01)
        return time.perf_counter() - t0, st
    finally:
        worker.terminate()
        worker.wait(timeout=30)


if __name__ == "__main__":
    main()
