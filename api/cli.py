"""``proxima``'s service commands: serve, worker, keys, db, and REST clients for files and jobs (design §7).

The trainer's local commands (train, eval, models, datasets) come from ``trainer.cli`` and are served by the same
application, so one console script covers both. They import torch, so they are loaded only when one of them is run
or listed: the API process that ``proxima serve`` runs, and the REST clients, never import torch.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any

import httpx
import typer
from rich.console import Console
from typer.core import TyperGroup

from api.status import TERMINAL_STATUSES, JobStatus
from trainer.spec import metrics as M

TRAINER_COMMANDS = ("train", "eval", "models", "datasets")


@functools.cache
def _trainer_commands() -> TyperGroup:
    """``trainer.cli``'s commands (importing it imports torch)."""
    from trainer.cli import app as trainer_app

    group = typer.main.get_command(trainer_app)
    assert isinstance(group, TyperGroup)
    return group


class _Commands(TyperGroup):
    """The service's commands, and the trainer's taken from ``trainer.cli`` when one is run or listed."""

    def list_commands(self, ctx: typer.Context) -> list[str]:  # type: ignore[override]
        return [*TRAINER_COMMANDS, *super().list_commands(ctx)]

    def get_command(self, ctx: typer.Context, cmd_name: str) -> Any:  # type: ignore[override]
        if cmd_name in TRAINER_COMMANDS:
            return _trainer_commands().get_command(ctx, cmd_name)
        return super().get_command(ctx, cmd_name)


app = typer.Typer(
    cls=_Commands,
    help="Proxima: reinforcement-learning fine-tuning of language models with LoRA.",
    no_args_is_help=True,
)
console = Console(stderr=True, soft_wrap=True)  # messages stay on one line: scripts grep them


@app.callback()
def _setup(ctx: typer.Context) -> None:
    if ctx.invoked_subcommand in TRAINER_COMMANDS and (callback := _trainer_commands().callback) is not None:
        callback()  # the trainer's own set-up (quieter libraries), as when its group runs them
    if ctx.invoked_subcommand in ("train", "eval"):
        # The deployment's judge, embeddings endpoint and URL policy (PROXIMA_JUDGE_*, PROXIMA_EMBEDDINGS_*,
        # PROXIMA_GRADER_*), as a worker hands them to its trainer: score_model, label_model, endpoint and cosine
        # graders grade the same way locally.
        from api.services.graders import remote_config
        from api.settings import get_settings
        from trainer.loops.evaluate import configure_remote

        configure_remote(remote_config(get_settings()))


files_app = typer.Typer(help="Datasets on a Proxima server (REST).", no_args_is_help=True)
jobs_app = typer.Typer(help="Fine-tuning jobs on a Proxima server (REST).", no_args_is_help=True)
keys_app = typer.Typer(help="API keys (admin, on the server's machine).", no_args_is_help=True)
db_app = typer.Typer(help="The service database.", no_args_is_help=True)
tools_app = typer.Typer(help="Built-in tool servers for agent jobs.", no_args_is_help=True)
app.add_typer(files_app, name="files")
app.add_typer(jobs_app, name="jobs")
app.add_typer(keys_app, name="keys")
app.add_typer(db_app, name="db")
app.add_typer(tools_app, name="tools")

LOCAL_KEY_FILE = "local_api_key"


def _settings() -> Any:
    from api.settings import get_settings

    return get_settings()


def local_key_path() -> Path:
    return _settings().home / LOCAL_KEY_FILE


def ensure_local_key() -> str:
    """On the embedded default, a key for tenant ``local`` is created on first start and kept (mode 600)."""
    from api.auth import create_key
    from api.db import session_scope

    path = local_key_path()
    if path.exists():
        return path.read_text().strip()
    with session_scope(_settings().db_url) as session:
        _, key = create_key(session, tenant_name="local")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(key + "\n")
    path.chmod(0o600)
    return key


def prepare_database() -> None:
    from api.migrate import upgrade

    s = _settings()
    s.home.mkdir(parents=True, exist_ok=True)
    if s.database_url is None or s.run_migrations:  # the embedded SQLite database is ours to migrate
        upgrade(s.db_url)


@tools_app.command("calculator")
def tools_calculator(
    host: Annotated[str, typer.Option(help="bind address")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="port")] = 8765,
    latency_ms: Annotated[
        float, typer.Option(help="wait this long before every answer (to try slow tools; at most 60,000)")
    ] = 0.0,
) -> None:
    """The calculator tool server (OpenAI agent RFT's function_call → function_call_output at POST /), the tool of
    tiny-calc's agent task; in the foreground until interrupted. A job's tool entry: {"name": "calculator",
    "server_url": "http://HOST:PORT/"}."""
    from trainer.agents import calculator_server

    if not 0 <= latency_ms <= calculator_server.MAX_LATENCY_S * 1000:
        console.print(f"[red]error:[/red] --latency-ms must be in 0..{calculator_server.MAX_LATENCY_S * 1000:g}")
        raise typer.Exit(2)
    print(f"calculator tool at http://{host}:{port}/", flush=True)
    calculator_server.serve(host, port, latency_ms / 1000)


@db_app.command("upgrade")
def db_upgrade(revision: Annotated[str, typer.Argument()] = "head") -> None:
    """Apply Alembic migrations to the configured database."""
    from api.migrate import upgrade

    upgrade(_settings().db_url, revision)
    console.print(f"database at {revision}")


@keys_app.command("create")
def keys_create(tenant: Annotated[str, typer.Option(help="tenant name (created when new)")]) -> None:
    """Print a new API key for a tenant."""
    from api.auth import create_key
    from api.db import session_scope

    prepare_database()
    with session_scope(_settings().db_url) as session:
        t, key = create_key(session, tenant_name=tenant)
    console.print(f"tenant {t.name} ({t.id})")
    print(key)


def _utc(ts: int | None) -> str:
    return "-" if ts is None else time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ts))


@keys_app.command("list")
def keys_list(
    as_json: Annotated[bool, typer.Option("--json", help="one JSON array of tenants with their keys")] = False,
) -> None:
    """Tenants and their keys: each key's id, prefix, created and revoked times (never the key)."""
    from api.auth import tenants_with_keys
    from api.db import session_scope

    prepare_database()
    with session_scope(_settings().db_url) as session:
        rows: list[dict[str, Any]] = [
            {
                "tenant": {"id": t.id, "name": t.name, "created_at": t.created_at},
                "keys": [
                    {"id": k.id, "prefix": k.prefix, "created_at": k.created_at, "revoked_at": k.revoked_at}
                    for k in keys
                ],
            }
            for t, keys in tenants_with_keys(session)
        ]
    if as_json:
        _print(rows)
        return
    for row in rows:
        t = row["tenant"]
        print(f"{t['name']}  {t['id']}  created {_utc(t['created_at'])}")
        for k in row["keys"]:
            revoked = f"revoked {_utc(k['revoked_at'])}" if k["revoked_at"] is not None else "active"
            print(f"  key {k['id']:<6} {k['prefix']}…  created {_utc(k['created_at'])}  {revoked}")
        if not row["keys"]:
            print("  (no keys)")


@keys_app.command("revoke")
def keys_revoke(
    key: Annotated[str, typer.Argument(help="the key's id or prefix (as `proxima keys list` shows), or the key")],
) -> None:
    """Revoke a key: every API process refuses it from its next request (PostgreSQL tells them at once)."""
    from api.auth import find_keys, revoke
    from api.db import session_scope

    prepare_database()
    with session_scope(_settings().db_url) as session:
        found = find_keys(session, key)
        if not found:
            console.print(f"[red]error:[/red] no key matches {key!r} (see `proxima keys list`)")
            raise typer.Exit(2)
        if len(found) > 1:
            ids = ", ".join(f"{k.id} ({k.prefix}…)" for k in found)
            console.print(f"[red]error:[/red] {key!r} matches {len(found)} keys: {ids}; name one by its id")
            raise typer.Exit(2)
        target = found[0]
        revoked = revoke(session, key_id=target.id)
        tenant_id, prefix, revoked_at = target.tenant_id, target.prefix, target.revoked_at
    if revoked:
        console.print(f"revoked key {target.id} ({prefix}…) of tenant {tenant_id}")
    else:
        console.print(f"key {target.id} ({prefix}…) of tenant {tenant_id} was already revoked at {_utc(revoked_at)}")


@app.command()
def worker(
    concurrency: Annotated[int, typer.Option(help="jobs at a time (one per GPU)")] = 1,
    hostname: Annotated[str | None, typer.Option(help="worker name")] = None,
) -> None:
    """A Celery worker alone (one per GPU in production)."""
    from worker.main import run_worker

    prepare_database()
    if parent := os.environ.pop(SERVE_PID_ENV, None):
        _exit_with_parent(int(parent))
    run_worker(_settings(), concurrency=concurrency, hostname=hostname)


@app.command()
def inference(
    host: Annotated[str | None, typer.Option(help="bind address (default PROXIMA_INFERENCE_HOST or 127.0.0.1)")] = None,
    port: Annotated[int | None, typer.Option(help="port (default PROXIMA_INFERENCE_PORT or 8001)")] = None,
) -> None:
    """The inference server: chat completions of the base models and their LoRA adapters (it imports torch)."""
    from worker.inference import run_server

    s = _settings()
    if parent := os.environ.pop(SERVE_PID_ENV, None):
        _exit_with_parent(int(parent))
    run_server(s, host=host or s.inference_host, port=port or s.inference_port)


SERVE_PID_ENV = "PROXIMA_SERVE_PID"


def _exit_with_parent(parent_pid: int) -> None:
    """A worker started by `proxima serve` shuts down (warmly, via SIGTERM) when that process is gone."""
    import threading

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(1.0)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, daemon=True, name="proxima-parent-watch").start()


def serving_app() -> Any:
    """The app as ``proxima serve`` runs it, with the heap it was built with frozen out of the garbage collector.

    Without torch the API's heap is still some 125,000 objects (SQLAlchemy, botocore, pydantic, Celery and kombu),
    which every full collection walks: about 130 ms on the shared 2-core CI machine. Requests that allocate a lot
    set those collections off: unfrozen, the 10,000-row metrics read took 620-710 ms at its median where frozen it
    takes 430 ms (``bench/api_latency.py``, the same load). Frozen, the start-up heap is never scanned; what requests
    allocate is collected as before.
    """
    import gc
    import logging

    from api.app import create_app

    settings = _settings()
    logging.basicConfig(
        level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s %(request_id)s %(message)s"
    )
    app = create_app(settings)
    gc.collect()
    gc.freeze()
    return app


@app.command()
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

    from trainer.builtin_models import BuiltinModelError, install_missing

    s = _settings()
    prepare_database()
    try:  # the offered built-in models come with the project: a new machine serves them at once
        for done in install_missing(s.base_models, s.model_store):
            console.print(f"installed the shipped build of {done.name} in {done.path}")
    except BuiltinModelError as err:
        console.print(f"[yellow]warning:[/yellow] {err}")
    if s.embedded:
        key = ensure_local_key()
        console.print(f"embedded backends under {s.home}; local API key: {key}")
    children: list[subprocess.Popen[bytes]] = []
    if s.inference_url is None and not no_inference:
        children.append(_start_inference(s))
    if not no_worker:
        env = {**os.environ, SERVE_PID_ENV: str(os.getpid())}
        children.append(subprocess.Popen([sys.executable, "-m", "api.cli", "worker"], env=env))
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
        for child in children:
            child.send_signal(signal.SIGTERM)
        for child in children:
            try:
                child.wait(timeout=30)
            except subprocess.TimeoutExpired:
                child.kill()


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def _start_inference(s: Any) -> subprocess.Popen[bytes]:
    """`proxima inference` as a child of `proxima serve`: on PROXIMA_INFERENCE_PORT when it is set, else on a free
    port (several deployments on one machine), with a shared key made for this run unless PROXIMA_INFERENCE_API_KEY
    is set (nothing else on the machine can use it); the API is pointed at it through the environment, which the
    app's settings (and uvicorn's worker processes) read."""
    from api.settings import get_settings

    port = s.inference_port if "inference_port" in s.model_fields_set else _free_port()
    key = s.inference_api_key.get_secret_value() if s.inference_api_key is not None else secrets.token_urlsafe(32)
    host = "127.0.0.1" if s.inference_host in ("0.0.0.0", "::", "") else s.inference_host
    url = f"http://{'[' + host + ']' if ':' in host else host}:{port}"
    os.environ["PROXIMA_INFERENCE_API_KEY"] = key
    env = {**os.environ, SERVE_PID_ENV: str(os.getpid())}
    child = subprocess.Popen([sys.executable, "-m", "api.cli", "inference", "--port", str(port)], env=env)
    os.environ["PROXIMA_INFERENCE_URL"] = url
    get_settings.cache_clear()
    console.print(f"inference server (`proxima inference`) starting at {url}")
    return child


# -- REST clients ---------------------------------------------------------------------------------------------

ApiBase = Annotated[str | None, typer.Option("--api-base", envvar="PROXIMA_API_BASE", help="server URL")]
ApiKey = Annotated[str | None, typer.Option("--api-key", envvar="PROXIMA_API_KEY", help="API key")]


class Client:
    """A thin REST client; errors print OpenAI's envelope message and exit 2."""

    def __init__(self, base: str | None, key: str | None) -> None:
        s = _settings()
        self.base = (base or f"http://{s.host}:{s.port}").rstrip("/")
        if key is None and local_key_path().exists():
            key = local_key_path().read_text().strip()
        if not key:
            console.print("[red]error:[/red] no API key: pass --api-key or set PROXIMA_API_KEY")
            raise typer.Exit(2)
        self.http = httpx.Client(
            base_url=self.base + "/v1",
            headers={"Authorization": f"Bearer {key}"},
            timeout=httpx.Timeout(60.0, connect=10.0),
        )

    def request(self, method: str, path: str, **kw: Any) -> httpx.Response:
        try:
            r = self.http.request(method, path, **kw)
        except httpx.HTTPError as err:
            console.print(f"[red]error:[/red] cannot reach {self.base}: {err}")
            raise typer.Exit(2) from None
        if r.status_code >= 400:
            try:
                e = r.json()["error"]
                msg = e["message"] + (f" (param: {e['param']})" if e.get("param") else "")
            except (ValueError, KeyError, TypeError):
                msg = r.text
            console.print(f"[red]error {r.status_code}:[/red] {msg}")
            raise typer.Exit(2)
        return r

    def json(self, method: str, path: str, **kw: Any) -> Any:
        return self.request(method, path, **kw).json()


def _print(obj: Any) -> None:
    print(json.dumps(obj, indent=2))


@files_app.command("upload")
def files_upload(path: Path, purpose: str = "fine-tune", api_base: ApiBase = None, api_key: ApiKey = None) -> None:
    """Upload a JSONL dataset; prints the file object."""
    c = Client(api_base, api_key)
    with path.open("rb") as f:
        _print(c.json("POST", "/files", files={"file": (path.name, f, "application/jsonl")}, data={"purpose": purpose}))


@files_app.command("list")
def files_list(api_base: ApiBase = None, api_key: ApiKey = None) -> None:
    c = Client(api_base, api_key)
    for f in c.json("GET", "/files")["data"]:
        print(f"{f['id']}  {f['purpose']:<20} {f['bytes']:>10}  {f['filename']}")


@jobs_app.command("create")
def jobs_create(
    spec: Annotated[Path, typer.Argument(help="job body (JSON or YAML) with file ids")],
    api_base: ApiBase = None,
    api_key: ApiKey = None,
) -> None:
    """Create a job from a spec whose files are file ids; prints the job."""
    import yaml

    c = Client(api_base, api_key)
    _print(c.json("POST", "/fine_tuning/jobs", json=yaml.safe_load(spec.read_text())))


@jobs_app.command("list")
def jobs_list(limit: int = 20, api_base: ApiBase = None, api_key: ApiKey = None) -> None:
    c = Client(api_base, api_key)
    for j in c.json("GET", "/fine_tuning/jobs", params={"limit": limit})["data"]:
        method = j.get("method", {}).get("type", "")
        print(f"{j['id']}  {j['status']:<16} {method:<10} {j['model']}")


@jobs_app.command("get")
def jobs_get(job_id: str, api_base: ApiBase = None, api_key: ApiKey = None) -> None:
    _print(Client(api_base, api_key).json("GET", f"/fine_tuning/jobs/{job_id}"))


@jobs_app.command("cancel")
def jobs_cancel(job_id: str, api_base: ApiBase = None, api_key: ApiKey = None) -> None:
    _print(Client(api_base, api_key).json("POST", f"/fine_tuning/jobs/{job_id}/cancel"))


def _step_of(event: dict[str, Any]) -> int | None:
    """The training step an event follows, where it names one: a metrics event's or a checkpoint's ``step``, a stop
    request's ``completed_step``."""
    data = event.get("data") or {}
    for field in ("step", "completed_step"):
        value = data.get(field)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def follow_job(c: Client, job_id: str, *, poll: float = 1.0) -> dict[str, Any]:
    """Print a progress line per step (reward, KL, ETA) and the job's messages until the job ends; returns the job.

    Lines come in the order things happened, not in the order they are read: a message that follows a step (a
    checkpoint of step N, a stop after step N, or any message recorded after step N's metrics event) prints after
    step N's line. The metrics and the events are two reads, and the worker writes a step's metrics row, its metrics
    event and its checkpoint separately, so a message read before the metrics of its step waits for them (or for the
    job's end)."""
    seen_events: set[str] = set()
    pending: list[tuple[int, str]] = []  # messages read, not printed yet, oldest first: (the step they follow, line)
    after = 0  # the step the latest message follows: messages keep their own order
    last_step = 0  # the latest step whose metrics row was read
    while True:
        job = c.json("GET", f"/fine_tuning/jobs/{job_id}")
        events = c.json("GET", f"/fine_tuning/jobs/{job_id}/events", params={"limit": 50})["data"]
        for e in reversed(events):  # oldest first
            if e["id"] in seen_events:
                continue
            seen_events.add(e["id"])
            step = _step_of(e)
            if e.get("type", "message") == "metrics":
                after = max(after, step or 0)  # the messages recorded after it follow that step
                continue
            after = max(after, step or 0)
            pending.append((after, f"[dim]{e['level']}[/dim] {e['message']}"))
        rows = c.json("GET", f"/fine_tuning/jobs/{job_id}/metrics", params={"after_step": last_step})["data"]
        lines: list[tuple[int, int, int, str]] = []  # (step, 0 for its metrics line or 1 for a message, order, line)
        for row in rows:
            m = row["metrics"]
            last_step = max(last_step, row["step"])
            if row["step"] == 0:
                continue
            eta = job.get("estimated_finish")
            eta_s = f"  eta {max(0, int(eta - time.time()))}s" if eta else ""
            kl = f"  kl {m[M.KL_MEAN]:.4f}" if M.KL_MEAN in m else ""
            line = (
                f"step {row['step']}/{job.get('total_steps') or '?'}  reward {m.get(M.REWARD_MEAN, 0.0):.3f}{kl}{eta_s}"
            )
            lines.append((row["step"], 0, len(lines), line))
        ended = job["status"] in TERMINAL_STATUSES  # read before the metrics: nothing more will come
        ready = 0
        while ready < len(pending) and (ended or pending[ready][0] <= last_step):
            ready += 1
        lines += [(step, 1, i, line) for i, (step, line) in enumerate(pending[:ready])]
        del pending[:ready]
        for *_, line in sorted(lines):
            console.print(line)
        if ended:
            return job
        time.sleep(poll)


@jobs_app.command("follow")
def jobs_follow(job_id: str, api_base: ApiBase = None, api_key: ApiKey = None) -> None:
    """Follow a job live until it ends."""
    job = follow_job(Client(api_base, api_key), job_id)
    console.print(f"{job['id']}: {job['status']}" + (f" ({job['error']['message']})" if job.get("error") else ""))
    if job["status"] != JobStatus.SUCCEEDED:
        raise typer.Exit(1)


@jobs_app.command("download")
def jobs_download(
    job_id: str,
    output: Annotated[Path, typer.Option("--output", "-o")] = Path("adapter.tar.gz"),
    checkpoint: Annotated[str | None, typer.Option(help="a checkpoint id; default: final")] = None,
    api_base: ApiBase = None,
    api_key: ApiKey = None,
) -> None:
    """Download the final adapter archive (or a checkpoint's)."""
    c = Client(api_base, api_key)
    download_adapter(c, job_id, output, checkpoint=checkpoint)
    print(output)


def download_adapter(c: Client, job_id: str, output: Path, *, checkpoint: str | None = None) -> Path:
    if checkpoint is None:
        job = c.json("GET", f"/fine_tuning/jobs/{job_id}")
        if job["status"] != JobStatus.SUCCEEDED:
            console.print(f"[red]error:[/red] job {job_id} is {job['status']}; pass --checkpoint for a checkpoint")
            raise typer.Exit(2)
        files = [c.json("GET", f"/files/{fid}") for fid in job["result_files"]]
        target = next(f for f in files if f["filename"].endswith(".tar.gz"))
        path = f"/files/{target['id']}/content"
    else:
        path = f"/fine_tuning/jobs/{job_id}/checkpoints/{checkpoint}/adapter"
    with c.http.stream("GET", path) as r, output.open("wb") as f:
        if r.status_code >= 400:
            console.print(f"[red]error {r.status_code}:[/red] {r.read().decode(errors='replace')}")
            raise typer.Exit(2)
        for chunk in r.iter_bytes():
            f.write(chunk)
    return output


# -- the README's main job ------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Stages:
    """The demo's stages, each named with how long it takes here before it starts and how long it took after: plain
    lines, which read the same in a terminal and in a log."""

    def __init__(self, total: int) -> None:
        self.total, self.done = total, 0
        self.started = time.monotonic()

    @contextlib.contextmanager
    def stage(self, name: str, expected: str) -> Iterator[None]:
        self.done += 1
        console.print(f"[bold][{self.done}/{self.total}] {name}[/bold] ({expected})", highlight=False)
        began = time.monotonic()
        yield
        console.print(f"      done in {time.monotonic() - began:.1f} s", highlight=False)

    def finish(self) -> None:
        console.print(f"[bold]demo done in {time.monotonic() - self.started:.0f} s[/bold]", highlight=False)


# What the demo trains: GRPO on the tiny-arith task (what the README's figures are of).
DEMO_GRADER = {
    "type": "string_check",
    "name": "accuracy",
    "input": "{{sample.output_text}}",
    "reference": "{{item.answer}}",
    "operation": "eq",
}


def demo_job(files: dict[str, str], steps: int) -> dict[str, Any]:
    hp = {"max_steps": steps, "batch_size": 8, "group_size": 8, "learning_rate": 3e-4, "beta": 0.04,
          "max_completion_tokens": 8, "eval_interval": 10, "checkpoint_interval": 10}  # fmt: skip
    return {
        "model": "tiny-arith",
        "training_file": files["train"],
        "validation_file": files["validation"],
        "suffix": "demo",
        "seed": 0,
        "method": {"type": "grpo", "grpo": {"grader": DEMO_GRADER, "hyperparameters": hp}},
    }


@app.command()
def demo(
    workdir: Annotated[Path, typer.Option(help="where the demo writes its data and downloads")] = Path("runs/demo"),
    steps: Annotated[int, typer.Option(help="training steps")] = 40,
) -> None:
    """The main job end to end on the embedded default: install tiny-arith, start the service, upload the dataset,
    create a GRPO job over REST, follow it live, download the adapter, compare base and trained accuracy."""
    from trainer.builtin_models import tiny_arith
    from trainer.cli import install_builtin

    stages = Stages(5)
    console.print(f"Proxima's demo: GRPO teaches tiny-arith to carry, on this machine, in {steps} steps")
    with stages.stage("base model", "under a second: the shipped build, copied and checked"):
        install_builtin(tiny_arith.MODEL_NAME)
    data = workdir / "data"
    tiny_arith.write_arithmetic_datasets(data)
    with stages.stage("starting the service", "a few seconds: the API, a worker and the inference server"):
        server, base = _start_demo_server(workdir)
    c: Client | None = None
    try:
        c = Client(base, None)
        with stages.stage("uploading the datasets", "a second"):
            files = {name: _upload(c, data / f"{name}.jsonl") for name in ("train", "validation")}
        expected = f"about {max(5, steps // 3)} s on 2 cores with fast bf16 matmuls, up to twice that in fp32"
        with stages.stage(f"training: GRPO, {steps} steps of 8 prompts × 8 samples", expected):
            job = c.json("POST", "/fine_tuning/jobs", json=demo_job(files, steps))
            console.print(f"      created {job['id']}; its steps as they finish:")
            job = follow_job(c, job["id"])
            if job["status"] != JobStatus.SUCCEEDED:
                console.print(f"[red]job {job['status']}[/red]: {job.get('error')}")
                raise typer.Exit(1)
            console.print(f"      fine-tuned model {job['fine_tuned_model']}")
        with stages.stage("evaluating the downloaded adapter", "a few seconds"):
            _evaluate_demo(c, job, workdir, data)
    finally:
        if c is not None:
            c.http.close()
        _stop(server)
    stages.finish()


def _start_demo_server(workdir: Path) -> tuple[subprocess.Popen[bytes], str]:
    """``proxima serve`` on a free port, its output in ``workdir/server.log``; once it is ready, with its URL."""
    workdir.mkdir(parents=True, exist_ok=True)
    port = _free_port()
    env = {**os.environ, "PROXIMA_PORT": str(port)}
    with (workdir / "server.log").open("w") as log:
        server = subprocess.Popen([sys.executable, "-m", "api.cli", "serve"], env=env, stdout=log, stderr=log)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        try:
            if httpx.get(base + "/readyz", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if server.poll() is not None or time.monotonic() > deadline:
            _stop(server)
            console.print(f"[red]error:[/red] the server did not start; see {workdir / 'server.log'}")
            raise typer.Exit(2)
        time.sleep(0.5)
    console.print(f"      up at {base} (embedded SQLite, broker and artifact folder under {_settings().home})")
    return server, base


def _stop(server: subprocess.Popen[bytes]) -> None:
    server.send_signal(signal.SIGTERM)
    try:
        server.wait(timeout=60)
    except subprocess.TimeoutExpired:
        server.kill()


def _upload(c: Client, path: Path) -> str:
    with path.open("rb") as f:
        file_id: str = c.json("POST", "/files", files={"file": (path.name, f)}, data={"purpose": "fine-tune"})["id"]
    console.print(f"      {path.name}: {file_id}")
    return file_id


def _evaluate_demo(c: Client, job: dict[str, Any], workdir: Path, data: Path) -> None:
    """The downloaded adapter loaded with PEFT here against the base, then both asked one question over chat."""
    import tarfile

    archive = download_adapter(c, job["id"], workdir / "adapter.tar.gz")
    adapter_dir = workdir / "adapter"
    with tarfile.open(archive) as tar:
        tar.extractall(adapter_dir, filter="data")
    base_acc, trained_acc = _accuracy_with_and_without(adapter_dir, data / "validation.jsonl", DEMO_GRADER)
    console.print(
        f"      validation greedy accuracy (the adapter in {adapter_dir}, loaded with PEFT here): "
        f"base {base_acc:.3f} → trained {trained_acc:.3f}"
    )
    question = "What is 57 + 68?"  # a carry: tiny-arith's base model tends to drop it (15)
    for model in ("tiny-arith", job["fine_tuned_model"]):
        body = {"model": model, "messages": [{"role": "user", "content": question}], "temperature": 0}
        r = c.http.post("/chat/completions", json=body)
        said = r.json()["choices"][0]["message"]["content"] if r.status_code == 200 else f"(HTTP {r.status_code})"
        console.print(f"      chat completion of {model}: {question} → {said}")


def _accuracy_with_and_without(adapter_dir: Path, data: Path, grader_obj: dict[str, Any]) -> tuple[float, float]:
    """Greedy mean reward of tiny-arith alone and with the adapter (``PeftModel.from_pretrained``)."""
    from transformers.utils import logging as hf_logging

    from trainer.builtin_models import tiny_arith
    from trainer.cli import resolve_model
    from trainer.generation.encoding import encode_prompts
    from trainer.generation.models import (
        default_device,
        load_adapter,
        load_base_model,
        load_tokenizer,
        resolve_precision,
    )
    from trainer.grading import graders
    from trainer.loops.evaluate import evaluate
    from trainer.spec.data import load_prompts

    hf_logging.disable_progress_bar()  # the loading bar of 38 small tensors says nothing
    g = graders.parse_grader(grader_obj)
    items = load_prompts(data, grader=g)
    path = resolve_model(tiny_arith.MODEL_NAME)
    tok = load_tokenizer(path)
    prompts = encode_prompts(tok, items, max_prompt_tokens=1_000)
    device = default_device()
    precision = resolve_precision("auto", device)
    model = load_adapter(load_base_model(path, device), adapter_dir)
    trained = evaluate(model, tok, prompts, items, g, max_new_tokens=8, precision=precision).mean_reward
    with model.disable_adapter():
        base = evaluate(model, tok, prompts, items, g, max_new_tokens=8, precision=precision).mean_reward
    return base, trained


def main() -> None:  # pragma: no cover
    sys.exit(app())


if __name__ == "__main__":  # pragma: no cover
    main()
