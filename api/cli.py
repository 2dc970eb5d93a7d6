"""``proxima``'s commands that need the API package alone: the service's keys and database, and REST clients for
files and jobs (the console script itself, with the commands that start workers and train, is ``proxima.cli``).

Nothing here imports torch or the worker: the REST clients and the API process that ``proxima serve`` runs stay
light.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Annotated, Any

import httpx
import typer
from rich.console import Console

from api.status import TERMINAL_STATUSES, JobStatus
from trainer.spec import metrics as M

console = Console(stderr=True, soft_wrap=True)  # messages stay on one line: scripts grep them

files_app = typer.Typer(help="Datasets on a Proxima server (REST).", no_args_is_help=True)
jobs_app = typer.Typer(help="Fine-tuning jobs on a Proxima server (REST).", no_args_is_help=True)
keys_app = typer.Typer(help="API keys (admin, on the server's machine).", no_args_is_help=True)
db_app = typer.Typer(help="The service database.", no_args_is_help=True)

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
