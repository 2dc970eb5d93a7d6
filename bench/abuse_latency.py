"""Abuse latency: tenant A's job polls while tenant B, or a client without a key, sends abusive requests.

Starts `proxima serve --no-worker` on PostgreSQL + Redis (as `api_latency.py` does, whose helpers this reuses),
seeds tenant A with a job and tenant B with a small dataset, then runs windows of A polling
`GET /v1/fine_tuning/jobs/{id}` at `--rate` (50) requests/s, open loop, from a process of its own. During each
window one attacker thread sends one kind of request, again and again, for the whole window:

- `upload-nokey`: a `--upload-gib` (2) GiB multipart upload with chunked transfer encoding (no Content-Length),
  without a key, streamed from a raw socket until the server answers or the body is all sent;
- `upload-key`: the same with B's key (JSONL lines, so that a server which reads the body validates it all);
- `template`: a job create whose grader's input is `"{{" * 40000` (80 KB);
- `regex`: `graders/run` with the pattern `^(a|aa)*c` on `--regex-chars` (10,000) characters of "a";
- `similarity`: `graders/run` with a `text_similarity` grader (`fuzzy_match`) on two `--similarity-chars`
  (100,000) character texts;
- `none`: no attacker (the baseline of the round).

One attack at a time: the attacker starts its next request when the last one ended, but at most every
`--attack-interval` seconds. Rounds alternate the order of the windows (rotated by one each round). Each window
reports A's p50/p99/max and non-200 answers, the generator's own lateness, the load average at its ends, the API
server's peak RSS (its process tree, sampled every 0.1 s), the peak growth of the temporary folder's disk use
(Starlette spools uploads there, and this bench's artifact store is under it too; other processes' files count as
well on a shared machine), and what the attacker's requests got (statuses, durations, bytes sent; an upload still
streaming when the window ends is cut). The summary gives, per attack, the median over the
rounds of A's p50 and p99 with their range, and in how many rounds p99 stayed under the target (50 ms).

    .venv/bin/python bench/abuse_latency.py --rounds 3 --seconds 10

On code without the fixes, the catastrophic regex never ends at 10,000 characters and holds a server thread for
good: measure it there with `--regex-chars 40` (about 7 s a match before the fix).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import random
import secrets
import select
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
from api_latency import PG, create_database, drop_database, free_port, loadavg, measure, seed

TARGET_P99_MS = 50.0
ATTACKS = ("none", "upload-nokey", "upload-key", "template", "regex", "similarity")


# -- the attacks ----------------------------------------------------------------------------------------------------


class Attacker(threading.Thread):
    """Sends one kind of request again and again until stopped; records each one's outcome."""

    def __init__(self, name: str, send: Callable[[threading.Event], dict[str, Any]], interval: float) -> None:
        super().__init__(daemon=True, name=f"attack-{name}")
        self.send, self.interval = send, interval
        self.stop = threading.Event()
        self.results: list[dict[str, Any]] = []

    def run(self) -> None:
        while not self.stop.is_set():
            t0 = time.perf_counter()
            try:
                res = self.send(self.stop)
            except (OSError, httpx.HTTPError) as err:
                res = {"status": f"error: {type(err).__name__}"}
            res["seconds"] = time.perf_counter() - t0
            self.results.append(res)
            self.stop.wait(max(0.0, self.interval - res["seconds"]))

    def summary(self) -> dict[str, Any]:
        durations = [r["seconds"] for r in self.results]
        out: dict[str, Any] = {
            "requests": len(self.results),
            "statuses": dict(collections.Counter(str(r["status"]) for r in self.results)),
        }
        if durations:
            out["seconds_median"] = round(statistics.median(durations), 3)
            out["seconds_max"] = round(max(durations), 3)
        sent = [r["sent_mib"] for r in self.results if "sent_mib" in r]
        if sent:
            out["sent_mib_median"] = round(statistics.median(sent), 1)
            out["sent_mib_max"] = round(max(sent), 1)
        return out


def _jsonl_chunk(size: int) -> bytes:
    line = json.dumps({"prompt": "a" * 1000}).encode() + b"\n"
    return line * max(1, size // len(line))


def chunked_upload(host: str, port: int, key: str | None, total: int, stop: threading.Event) -> dict[str, Any]:
    """POST /v1/files as multipart with ``Transfer-Encoding: chunked`` (no Content-Length), ``total`` bytes of JSONL
    in the file part, from a raw socket: it stops sending as soon as the server answers (or the stop is set), then
    reads the status line."""
    boundary = f"abuse-{secrets.token_hex(8)}"
    head = (
        f'--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nfine-tune\r\n'
        f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="big.jsonl"\r\n'
        "Content-Type: application/jsonl\r\n\r\n"
    ).encode()
    tail = f"\r\n--{boundary}--\r\n".encode()
    chunk = _jsonl_chunk(1 << 20)
    auth = f"Authorization: Bearer {key}\r\n" if key else ""
    request = (
        f"POST /v1/files HTTP/1.1\r\nHost: {host}:{port}\r\n{auth}"
        f"Content-Type: multipart/form-data; boundary={boundary}\r\nTransfer-Encoding: chunked\r\n\r\n"
    ).encode()

    def frame(data: bytes) -> bytes:
        return f"{len(data):x}\r\n".encode() + data + b"\r\n"

    sent = 0
    with socket.create_connection((host, port), timeout=60) as sock:
        try:
            sock.sendall(request + frame(head))
            framed = frame(chunk)
            while sent < total and not stop.is_set():
                if select.select([sock], [], [], 0)[0]:
                    break  # the server answered before the end of the body
                sock.sendall(framed)
                sent += len(chunk)
            else:
                if not stop.is_set():
                    sock.sendall(frame(tail) + b"0\r\n\r\n")
        except OSError:
            pass  # the server closed the connection mid-body: its answer may still be readable
        status: int | str = "cut at the window's end" if stop.is_set() else "no answer"
        with contextlib.suppress(OSError):
            sock.settimeout(5 if stop.is_set() else 60)
            answer = b""
            while b"\r\n" not in answer:
                part = sock.recv(4096)
                if not part:
                    break
                answer += part
            if answer.startswith(b"HTTP/1.1 "):
                status = int(answer[9:12])
    return {"status": status, "sent_mib": sent / 2**20}


def json_attack(base: str, key: str, path: str, body: dict[str, Any], timeout: float) -> Callable[..., dict[str, Any]]:
    """POSTs ``body`` on one keep-alive connection (a new client only after a timeout): the attacker's own CPU stays
    small, as it shares the machine with the server."""
    payload = json.dumps(body).encode()
    headers = {"authorization": f"Bearer {key}", "content-type": "application/json"}
    client: list[httpx.Client] = []

    def send(_: threading.Event) -> dict[str, Any]:
        if not client:
            client.append(httpx.Client(base_url=base, timeout=timeout))
        try:
            r = client[0].post(path, content=payload, headers=headers)
        except httpx.TimeoutException:
            client.pop().close()
            return {"status": "client timeout"}
        return {"status": r.status_code}

    return send


def attacks(args: argparse.Namespace, base: str, key_b: str, file_b: str) -> dict[str, Callable[..., dict[str, Any]]]:
    host, port = base.removeprefix("http://").split(":")
    total = int(args.upload_gib * 2**30)
    timeout = args.seconds + 5
    rng = random.Random(0)
    text = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz ") for _ in range(args.similarity_chars))
    other = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz ") for _ in range(args.similarity_chars))
    template_job = {
        "model": "tiny-arith",
        "training_file": file_b,
        "method": {
            "type": "grpo",
            "grpo": {
                "grader": {
                    "type": "string_check",
                    "name": "t",
                    "input": "{{" * 40000,
                    "reference": "x",
                    "operation": "eq",
                }
            },
        },
    }
    regex_run = {
        "grader": {"type": "regex", "name": "evil", "input": "{{sample.output_text}}", "pattern": "^(a|aa)*c"},
        "model_sample": "a" * args.regex_chars,
    }
    similarity_run = {
        "grader": {
            "type": "text_similarity",
            "name": "sim",
            "input": "{{sample.output_text}}",
            "reference": "{{item.ref}}",
            "evaluation_metric": "fuzzy_match",
        },
        "model_sample": text,
        "item": {"ref": other},
    }
    graders_run = "/v1/fine_tuning/alpha/graders/run"
    return {
        "none": lambda stop: (stop.wait(), {"status": "idle"})[1],
        "upload-nokey": lambda stop: chunked_upload(host, int(port), None, total, stop),
        "upload-key": lambda stop: chunked_upload(host, int(port), key_b, total, stop),
        "template": json_attack(base, key_b, "/v1/fine_tuning/jobs", template_job, timeout),
        "regex": json_attack(base, key_b, graders_run, regex_run, timeout),
        "similarity": json_attack(base, key_b, graders_run, similarity_run, timeout),
    }


# -- what the server holds ---------------------------------------------------------------------------------------


def _rss_mib(pid: int) -> float:
    """Resident memory of a process and its descendants (``/proc``), MiB."""
    total = 0
    pids = [pid]
    while pids:
        p = pids.pop()
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
            for task in Path(f"/proc/{p}/task").iterdir():
                pids += [int(c) for c in (task / "children").read_text().split()]
    return total / 1024


class Sampler(threading.Thread):
    """The server's peak RSS and the temporary folder's peak disk use over a window, every 0.1 s."""

    def __init__(self, server_pid: int) -> None:
        super().__init__(daemon=True)
        self.server_pid = server_pid
        self.stop = threading.Event()
        self.tmp = tempfile.gettempdir()
        self.disk_start = shutil.disk_usage(self.tmp).used
        self.peak_rss = 0.0
        self.peak_disk = self.disk_start

    def run(self) -> None:
        while not self.stop.is_set():
            self.peak_rss = max(self.peak_rss, _rss_mib(self.server_pid))
            self.peak_disk = max(self.peak_disk, shutil.disk_usage(self.tmp).used)
            self.stop.wait(0.1)


# -- one window, the rounds, the summary ---------------------------------------------------------------------------


def window(
    name: str,
    send: Callable[..., dict[str, Any]],
    args: argparse.Namespace,
    base: str,
    key_a: str,
    job_a: str,
    server_pid: int,
) -> dict[str, Any]:
    """A's polls for one window while ``send`` runs; the attacker starts first and runs past the window's end. The
    window starts once the 1-minute load average is below ``--idle-load`` (the previous window's load decays first;
    at most 5 minutes)."""
    deadline = time.monotonic() + 300
    while loadavg()[0] >= args.idle_load and time.monotonic() < deadline:
        time.sleep(5)
    sampler = Sampler(server_pid)
    sampler.start()
    attacker = Attacker(name, send, args.attack_interval)
    attacker.start()
    (warm, polls) = measure(
        base,
        key_a,
        f"/v1/fine_tuning/jobs/{job_a}",
        rate=args.rate,
        seconds=args.seconds,
        windows=1,
        warmup=args.warmup,
        max_connections=args.connections,
        server_pid=server_pid,
    )
    attacker.stop.set()
    attacker.join(timeout=args.seconds + 10)
    sampler.stop.set()
    sampler.join()
    polls["warmup_p99_ms"] = warm["p99_ms"]
    polls["attack"] = name
    polls["attacker"] = attacker.summary()
    polls["attacker_stuck"] = attacker.is_alive()
    polls["server_peak_rss_mib"] = round(sampler.peak_rss, 1)
    polls["tmp_disk_growth_mib"] = round((sampler.peak_disk - sampler.disk_start) / 2**20, 1)
    return polls


def summarise(windows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per attack: the median over rounds of A's p50 and p99, with their range, and the rounds under the target."""
    out: dict[str, dict[str, Any]] = {}
    empty: collections.Counter[str] = collections.Counter()
    for name in ATTACKS:
        ws = [w for w in windows if w["attack"] == name]
        if not ws:
            continue
        p50s, p99s = [w["p50_ms"] for w in ws], [w["p99_ms"] for w in ws]
        loads = [x for w in ws for x in (w["loadavg_before"][0], w["loadavg_after"][0])]
        out[name] = {
            "rounds": len(ws),
            "p50_ms_median": round(statistics.median(p50s), 2),
            "p50_ms_range": [min(p50s), max(p50s)],
            "p99_ms_median": round(statistics.median(p99s), 2),
            "p99_ms_range": [min(p99s), max(p99s)],
            "max_ms": max(w["max_ms"] for w in ws),
            "non_200": sum(w["non_200"] for w in ws),
            "rounds_p99_under_target": sum(1 for p in p99s if p < TARGET_P99_MS),
            "loadavg_range": [min(loads), max(loads)],
            "attacker_statuses": dict(sum((collections.Counter(w["attacker"]["statuses"]) for w in ws), empty)),
            "server_peak_rss_mib": max(w["server_peak_rss_mib"] for w in ws),
            "tmp_disk_growth_mib": max(w["tmp_disk_growth_mib"] for w in ws),
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rate", type=float, default=50.0, help="tenant A's job polls per second")
    ap.add_argument("--seconds", type=float, default=10.0, help="length of each measured window")
    ap.add_argument("--warmup", type=float, default=2.0, help="seconds of polls (under attack) before each window")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--idle-load", type=float, default=1.0, help="a window starts once the load is below this")
    ap.add_argument("--attacks", default=",".join(ATTACKS), help=f"comma-separated, of {', '.join(ATTACKS)}")
    ap.add_argument("--attack-interval", type=float, default=0.5, help="least seconds between two attack starts")
    ap.add_argument("--upload-gib", type=float, default=2.0)
    ap.add_argument("--regex-chars", type=int, default=10_000)
    ap.add_argument("--similarity-chars", type=int, default=100_000)
    ap.add_argument("--connections", type=int, default=16, help="most keep-alive connections of A's generator")
    ap.add_argument("--settle", type=float, default=2.0, help="seconds of quiet between windows")
    ap.add_argument("--json", type=Path, help="write every window and the summary here")
    args = ap.parse_args()
    chosen = [a.strip() for a in args.attacks.split(",") if a.strip()]
    unknown = set(chosen) - set(ATTACKS)
    if unknown:
        ap.error(f"unknown attacks {sorted(unknown)}; valid: {', '.join(ATTACKS)}")

    db = create_database()
    home = Path(tempfile.mkdtemp(prefix="proxima-abuse-"))
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
    results: dict[str, Any] = {"command": sys.argv, "loadavg_start": loadavg(), "windows": []}
    try:
        key_a, job_a = seed(env, 10)
        from api.auth import create_key
        from api.db import session_scope

        with session_scope(env["PROXIMA_DATABASE_URL"]) as s:
            _, key_b = create_key(s, tenant_name="attacker")
        log = (home / "server.log").open("w")
        server = subprocess.Popen(
            [sys.executable, "-m", "proxima.cli", "serve", "--no-worker"], env=env, stdout=log, stderr=log
        )
        base = f"http://127.0.0.1:{port}"
        for _ in range(300):
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(base + "/readyz", timeout=1).status_code == 200:
                    break
            time.sleep(0.2)
        dataset = b'{"messages": [{"role": "user", "content": "What is 1 + 1?"}], "answer": "2"}\n'
        up = httpx.post(
            base + "/v1/files",
            headers={"authorization": f"Bearer {key_b}"},
            files={"file": ("b.jsonl", dataset)},
            data={"purpose": "fine-tune"},
        )
        up.raise_for_status()
        senders = attacks(args, base, key_b, up.json()["id"])
        print(f"load average at start: {results['loadavg_start']}; server log {home / 'server.log'}", flush=True)
        for r in range(args.rounds):
            order = chosen[r % len(chosen) :] + chosen[: r % len(chosen)]
            for name in order:
                w = window(name, senders[name], args, base, key_a, job_a, server.pid)
                w["round"] = r + 1
                results["windows"].append(w)
                print(
                    f"round {r + 1} {name:12s} A: p50 {w['p50_ms']:.2f} ms, p99 {w['p99_ms']:.2f} ms, "
                    f"max {w['max_ms']:.2f} ms, non-200 {w['non_200']}, late p99 {w['late_p99_ms']:.2f} ms; "
                    f"load {w['loadavg_before'][0]:.2f} → {w['loadavg_after'][0]:.2f}; "
                    f"server RSS ≤ {w['server_peak_rss_mib']:.0f} MiB, tmp +{w['tmp_disk_growth_mib']:.0f} MiB; "
                    f"attacker {json.dumps(w['attacker'])}" + ("; ATTACKER STUCK" if w["attacker_stuck"] else ""),
                    flush=True,
                )
                if server.poll() is not None:
                    raise SystemExit(f"the server exited ({server.returncode}); see {home / 'server.log'}")
                time.sleep(args.settle)
        results["summary"] = summarise(results["windows"])
        results["loadavg_end"] = loadavg()
        print(
            f"\nA's job polls at {args.rate:g} req/s, {args.rounds} rounds of {args.seconds:g} s (target p99 < "
            f"{TARGET_P99_MS:g} ms):",
            flush=True,
        )
        for name, s in results["summary"].items():
            print(
                f"  {name:12s} p50 {s['p50_ms_median']:.2f} ms ({s['p50_ms_range'][0]:g}–{s['p50_ms_range'][1]:g}), "
                f"p99 {s['p99_ms_median']:.2f} ms ({s['p99_ms_range'][0]:g}–{s['p99_ms_range'][1]:g}), "
                f"max {s['max_ms']:g} ms, p99 under target in {s['rounds_p99_under_target']}/{s['rounds']} rounds, "
                f"load {s['loadavg_range'][0]:g}–{s['loadavg_range'][1]:g}; attacker got {s['attacker_statuses']}",
                flush=True,
            )
        print(f"load average at end: {results['loadavg_end']}", flush=True)
        if args.json:
            args.json.write_text(json.dumps(results, indent=1))
    finally:
        if server is not None:
            server.terminate()
            try:
                server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                server.kill()
        drop_database(db)
        shutil.rmtree(home, ignore_errors=True)


if __name__ == "__main__":
    main()
