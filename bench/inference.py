"""Chat-completion latency and throughput of `proxima inference`, base model versus a LoRA adapter, and
the time to first token with a cold and a warm adapter.

The script starts `proxima inference` itself (tiny-arith from the test model cache, or ``--model-dir``), in a fresh
``PROXIMA_HOME``, registers an adapter (``--adapter``: a trained PEFT adapter folder; default a LoRA r 16 on every
linear layer with random A and B, built here: its cost is that of any adapter of that shape), then:

- **load**: for 1, 8 and 32 concurrent clients (``--clients``), each a closed loop (the next request when the
  previous one is answered) of non-streamed chat completions of tiny-arith questions at temperature 0 and
  ``max_tokens`` 8, for ``--duration`` seconds after ``--warmup`` seconds (2), once against the base and once
  against the adapter: latency percentiles, requests/s and completion tokens/s;
- **time to first token**: a streamed request's wall time until its first content chunk, with the adapter cold
  (registered under a fresh name just before: its weights load within the request) and warm (the same name again),
  and the base's, once a round.

``--rounds`` rounds (3), base and adapter alternating which goes first; each window starts once the 1-minute load
average is below ``--idle-load`` (1) and records it; medians over the rounds are reported with their range.

    .venv/bin/python bench/inference.py                      # the figures in BENCHMARKS.md
    .venv/bin/python bench/inference.py --duration 1 --warmup 0.5 --clients 1 8 --rounds 1 --idle-load 99  # smoke
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from trainer.builtin_models import shipped

REPO = Path(__file__).resolve().parent.parent
KEY = "bench-key"


def _loadavg() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def make_adapter(model_dir: Path, out: Path) -> Path:
    import torch

    from trainer.generation.models import add_lora, load_base_model
    from trainer.spec.lora import LoraSpec

    model = add_lora(load_base_model(str(model_dir), torch.device("cpu")), LoraSpec(r=16, alpha=32.0), seed=0)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.01)
    model.save_pretrained(str(out))
    return out


def _question(rng: random.Random) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"What is {rng.randint(0, 99)} + {rng.randint(0, 99)}?"}]


def start_server(home: Path, model_dir: Path, precision: str) -> tuple[subprocess.Popen[bytes], str]:
    (home / "models").mkdir(parents=True, exist_ok=True)
    link = home / "models" / "tiny-arith"
    if not link.exists():
        link.symlink_to(model_dir.resolve())
    port = _free_port()
    env = {
        **os.environ,
        "PROXIMA_HOME": str(home),
        "PROXIMA_BASE_MODELS": '["tiny-arith"]',
        "PROXIMA_INFERENCE_API_KEY": KEY,
        "PROXIMA_INFERENCE_PRECISION": precision,
    }
    proc = subprocess.Popen([sys.executable, "-m", "proxima.cli", "inference", "--port", str(port)], env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit("the inference server exited")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise SystemExit("the inference server did not start within 300 s")


def _percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def load(url: str, model: str, clients: int, duration: float, max_tokens: int, warmup: float) -> dict[str, Any]:
    """``clients`` closed-loop clients for ``duration`` seconds after ``warmup`` seconds."""
    latencies: list[float] = []
    tokens = [0]
    errors = [0]
    lock = threading.Lock()
    t_start = time.perf_counter() + warmup
    t_end = t_start + duration

    def client(i: int) -> None:
        rng = random.Random(i)
        with httpx.Client(headers={"Authorization": f"Bearer {KEY}"}, timeout=300) as http:
            while (now := time.perf_counter()) < t_end:
                body = {"model": model, "messages": _question(rng), "temperature": 0, "max_tokens": max_tokens}
                r = http.post(f"{url}/v1/chat/completions", json=body)
                done = time.perf_counter()
                if now >= t_start and done <= t_end:
                    with lock:
                        if r.status_code == 200:
                            latencies.append(done - now)
                            tokens[0] += r.json()["usage"]["completion_tokens"]
                        else:
                            errors[0] += 1

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {
        "model": model,
        "clients": clients,
        "requests": len(latencies),
        "errors": errors[0],
        "p50_ms": 1000 * _percentile(latencies, 0.50),
        "p95_ms": 1000 * _percentile(latencies, 0.95),
        "p99_ms": 1000 * _percentile(latencies, 0.99),
        "requests_per_s": len(latencies) / duration,
        "completion_tokens_per_s": tokens[0] / duration,
    }


def first_token_s(url: str, model: str) -> float:
    body = {"model": model, "messages": _question(random.Random(0)), "temperature": 0, "max_tokens": 8, "stream": True}
    t0 = time.perf_counter()
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, headers=headers, timeout=300) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line.removeprefix("data: "))
                if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                    return time.perf_counter() - t0
    raise RuntimeError("no content chunk")


def register(url: str, name: str, path: Path) -> None:
    r = httpx.post(
        f"{url}/v1/load_lora_adapter",
        json={"lora_name": name, "lora_path": str(path), "base_model_name": "tiny-arith"},
        headers={"Authorization": f"Bearer {KEY}"},
        timeout=60,
    )
    r.raise_for_status()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", type=Path, default=shipped("tiny-arith"))
    parser.add_argument("--adapter", type=Path, default=None, help="a PEFT adapter folder (default: a random one)")
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--duration", type=float, default=30.0, help="measured seconds per (model, clients)")
    parser.add_argument("--warmup", type=float, default=2.0, help="unmeasured seconds before each measurement")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--precision", choices=["auto", "fp32", "bf16"], default="auto")
    parser.add_argument("--rounds", type=int, default=3, help="rounds; base and adapter alternate which goes first")
    parser.add_argument("--idle-load", type=float, default=1.0, help="a window starts once the load is below this")
    args = parser.parse_args()
    if not (args.model_dir / "config.json").is_file():
        raise SystemExit(f"no model in {args.model_dir}: build it with `proxima models build tiny-arith`")
    work = Path(tempfile.mkdtemp(prefix="proxima-inference-bench-"))
    adapter = args.adapter or make_adapter(args.model_dir, work / "adapter")
    load_before = _loadavg()
    proc, url = start_server(work / "home", args.model_dir, args.precision)
    windows: list[dict[str, Any]] = []
    ttft: dict[str, list[float]] = {"base": [], "adapter_cold": [], "adapter_warm": []}
    try:
        register(url, "adapter", adapter)
        for rnd in range(args.rounds):
            # the two sides alternate which goes first, round by round
            models = ("tiny-arith", "adapter") if rnd % 2 == 0 else ("adapter", "tiny-arith")
            for clients in args.clients:
                for model in models:
                    start_load = _wait_for_idle(args.idle_load)
                    w = load(url, model, clients, args.duration, args.max_tokens, args.warmup)
                    w |= {"round": rnd + 1, "load_start": start_load, "load_end": _loadavg()}
                    windows.append(w)
                    print(
                        f"round {rnd + 1} {model:10s} {clients:3d} clients: {w['requests_per_s']:.1f} req/s, "
                        f"p50 {w['p50_ms']:.1f} ms, p99 {w['p99_ms']:.1f} ms, errors {w['errors']}; "
                        f"load {start_load:.2f} → {w['load_end']:.2f}",
                        flush=True,
                    )
            _wait_for_idle(args.idle_load)
            copy = work / f"adapter-{rnd}"  # a new path and name: nothing of it is loaded yet
            shutil.copytree(adapter, copy)
            register(url, f"cold-{rnd}", copy)
            ttft["adapter_cold"].append(first_token_s(url, f"cold-{rnd}"))
            ttft["adapter_warm"].append(first_token_s(url, f"cold-{rnd}"))
            ttft["base"].append(first_token_s(url, "tiny-arith"))
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        shutil.rmtree(work, ignore_errors=True)
    summary = {
        "windows": windows,
        "ttft_ms": {k: [1000 * x for x in v] for k, v in ttft.items()},
        "loadavg_before": load_before,
        "loadavg_after": _loadavg(),
        "precision": args.precision,
        "duration_s": args.duration,
        "rounds": args.rounds,
    }

    def spread(xs: list[float]) -> str:
        return f"{statistics.median(xs):.1f} ({min(xs):.1f}–{max(xs):.1f})"

    print(f"\nmedians over {args.rounds} rounds (range):")
    print("| model | clients | requests/s | completion tokens/s | p50 ms | p99 ms | errors | load at starts |")
    print("|---|---:|---:|---:|---:|---:|---:|---|")
    for clients in args.clients:
        for model in ("tiny-arith", "adapter"):
            ws = [w for w in windows if w["model"] == model and w["clients"] == clients]
            loads = [w["load_start"] for w in ws]
            print(
                f"| {model} | {clients} | {spread([w['requests_per_s'] for w in ws])} | "
                f"{spread([w['completion_tokens_per_s'] for w in ws])} | {spread([w['p50_ms'] for w in ws])} | "
                f"{spread([w['p99_ms'] for w in ws])} | {sum(w['errors'] for w in ws)} | "
                f"{min(loads):.2f}–{max(loads):.2f} |"
            )
    t = summary["ttft_ms"]
    print(
        f"\ntime to first token, median ms (range): base {spread(t['base'])}, adapter cold "
        f"{spread(t['adapter_cold'])}, warm {spread(t['adapter_warm'])}"
    )
    print(f"load average: {load_before:.2f} before, {summary['loadavg_after']:.2f} after")
    print("RESULT " + json.dumps(summary))


def _wait_for_idle(limit: float, patience_s: float = 300.0) -> float:
    """Wait until the 1-minute load average is below ``limit`` (at most ``patience_s``); the load then."""
    deadline = time.monotonic() + patience_s
    while _loadavg() >= limit and time.monotonic() < deadline:
        time.sleep(2)
    return _loadavg()


if __name__ == "__main__":
    main()
