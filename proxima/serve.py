"""``proxima serve``, ``proxima worker`` and ``proxima inference``: the service's processes.

``serve`` runs the API in its own process and starts a worker and the inference server as its children (each
``python -m proxima.cli ...``), which end when it ends. The worker and the inference server import torch; they are
imported in the commands that run them, so that ``serve`` and the API processes it starts never do.
"""

from __future__ import annotations

import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Annotated, Any

import typer

from api.cli import console, ensure_local_key, prepare_database, serving_app
from api.settings import Settings, get_settings
from trainer.builtin_models import BuiltinModelError, install_missing

SERVE_PID_ENV = "PROXIMA_SERVE_PID"
"""Set for the children of ``proxima serve``: the parent's pid, which they watch to end with it."""


def worker(
    concurrency: Annotated[int, typer.Option(help="jobs at a time (one per GPU)")] = 1,
    hostname: Annotated[str | None, typer.Option(help="worker name")] = None,
) -> None:
    """A Celery worker alone (one per GPU in production)."""
    from worker.main import run_worker

    prepare_database()
    if parent := os.environ.pop(SERVE_PID_ENV, None):
        _exit_with_parent(int(parent))
    run_worker(get_settings(), concurrency=concurrency, hostname=hostname)


def inference(
    host: Annotated[str | None, typer.Option(help="bind address (default PROXIMA_INFERENCE_HOST or 127.0.0.1)")] = None,
    port: Annotated[int | None, typer.Option(help="port (default PROXIMA_INFERENCE_PORT or 8001)")] = None,
) -> None:
    """The inference server: chat completions of the base models and their LoRA adapters (it imports torch)."""
    from worker.inference import run_server

    s = get_settings()
    if parent := os.environ.pop(SERVE_PID_ENV, None):
        _exit_with_parent(int(parent))
    run_server(s, host=host or s.inference_host, port=port or s.inference_port)


def _exit_with_parent(parent_pid: int) -> None:
    """A worker started by `proxima serve` shuts down (warmly, via SIGTERM) when that process is gone."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(1.0)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, daemon=True, name="proxima-parent-watch").start()


def serve(
    host: Annotated[str | None, typer.Option(help="bind address (default PROXIMA_HOST or 127.0.0.1)")] = None,
    port: Annotated[int | None, typer.Option(help="port (default PROXIMA_PORT or 8000)")] = None,
    no_worker: Annotated[bool, typer.Option("--no-worker", help="serve the API only")] = False,
    no_inference: Annotated[
        bool, typer.Option("--no-inference", help="start no inference server (chat completions then answer 503)")
    ] = False,
    workers: Annotated[int, typer.Option(help="API processes (uvicorn workers)")] = 1,
) -> None:
    """The API, (unless --no-worker) one worker and, unless PROXIMA_INFERENCE_URL names one or --no-inference, the
    inference server of chat completions (`proxima inference`), on the configured or the embedded backends."""
    import uvicorn

    s = get_settings()
    prepare_database()
    _install_builtin_models(s)
    if s.embedded:
        key = ensure_local_key()
        console.print(f"embedded backends under {s.home}; local API key: {key}")
    children: list[subprocess.Popen[bytes]] = []
    if s.inference_url is None and not no_inference:
        children.append(_start_inference(s))
    if not no_worker:
        env = {**os.environ, SERVE_PID_ENV: str(os.getpid())}
        children.append(subprocess.Popen([sys.executable, "-m", "proxima.cli", "worker"], env=env))
    # uvicorn raises the SIGTERM it caught again once it has shut down, which with the default handler would end this
    # process before the `finally` below stops the worker and the inference server: raised as SystemExit instead.
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        # Each uvicorn worker process builds its own app through the factory.
        target: Any = serving_app() if workers == 1 else "api.cli:serving_app"
        uvicorn.run(
            target,
            factory=workers > 1,
            workers=workers,
            host=host or s.host,
            port=port or s.port,
            log_level="warning",
            timeout_graceful_shutdown=5,
        )
    finally:
        _stop_children(children)


def _install_builtin_models(s: Settings) -> None:
    """The offered built-in models come with the project: a new machine serves them at once."""
    try:
        for done in install_missing(s.base_models, s.model_store):
            console.print(f"installed the shipped build of {done.name} in {done.path}")
    except BuiltinModelError as err:
        console.print(f"[yellow]warning:[/yellow] {err}")


def _stop_children(children: list[subprocess.Popen[bytes]]) -> None:
    for child in children:
        child.send_signal(signal.SIGTERM)
    for child in children:
        try:
            child.wait(timeout=30)
        except subprocess.TimeoutExpired:
            child.kill()


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def _start_inference(s: Settings) -> subprocess.Popen[bytes]:
    """`proxima inference` as a child of `proxima serve`: on PROXIMA_INFERENCE_PORT when it is set, else on a free
    port (several deployments on one machine), with a shared key made for this run unless PROXIMA_INFERENCE_API_KEY
    is set (nothing else on the machine can use it); the API is pointed at it through the environment, which the
    app's settings (and uvicorn's worker processes) read."""
    port = s.inference_port if "inference_port" in s.model_fields_set else free_port()
    key = s.inference_api_key.get_secret_value() if s.inference_api_key is not None else secrets.token_urlsafe(32)
    host = "127.0.0.1" if s.inference_host in ("0.0.0.0", "::", "") else s.inference_host
    url = f"http://{'[' + host + ']' if ':' in host else host}:{port}"
    os.environ["PROXIMA_INFERENCE_API_KEY"] = key
    env = {**os.environ, SERVE_PID_ENV: str(os.getpid())}
    child = subprocess.Popen([sys.executable, "-m", "proxima.cli", "inference", "--port", str(port)], env=env)
    os.environ["PROXIMA_INFERENCE_URL"] = url
    get_settings.cache_clear()
    console.print(f"inference server (`proxima inference`) starting at {url}")
    return child


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
