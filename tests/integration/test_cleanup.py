"""The orphan clean-up (``api.services.cleanup``) against the real database: it removes what interrupted writes
leave (objects with no row, temporaries of killed writes) once they are older than the grace period, and nothing
else. Each test has its own artifact folder, so other tests' objects are never in its listing."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from api import ids
from api.orm import File, Job
from api.services.cleanup import clean_orphans
from api.storage import LocalStore
from tests.integration.conftest import add_checkpoint, set_job

GRACE = 3600.0


@pytest.fixture
def store(tmp_path: Path) -> LocalStore:
    return LocalStore(tmp_path / "artifacts")


def age(store: LocalStore, key: str, seconds: float) -> None:
    """Make the object look ``seconds`` old."""
    t = time.time() - seconds
    os.utime(store.path(key), (t, t))


def add_file_row(db: Callable[[], Any], tenant_id: str, key: str, *, deleted: bool = False) -> None:
    with db() as s:
        s.add(
            File(
                id=ids.file_id(),
                tenant_id=tenant_id,
                filename="x.jsonl",
                purpose="fine-tune",
                bytes=1,
                lines=1,
                storage_key=key,
                created_at=int(time.time()),
                deleted=deleted,
            )
        )


def test_file_objects_without_a_live_row_go_once_past_the_grace_period(
    store: LocalStore, db: Callable[[], Any], settings: Any, tenant_a: Any
) -> None:
    t = tenant_a.id
    kept, orphan, young, deleted = (f"files/{t}/{ids.file_id()}.jsonl" for _ in range(4))
    for key in (kept, orphan, young, deleted):
        store.put_bytes(key, b"{}\n")
    add_file_row(db, t, kept)
    add_file_row(db, t, deleted, deleted=True)  # a delete that died between marking the row and removing the bytes
    for key in (kept, orphan, deleted):
        age(store, key, GRACE + 60)
    age(store, young, 5)  # an upload whose row is being committed right now

    cleaned = clean_orphans(url=settings.db_url, store=store, grace_seconds=GRACE)

    assert (cleaned.files, cleaned.checkpoint_objects, cleaned.temporaries) == (2, 0, 0)
    assert store.list("files") == sorted([kept, young])
    assert clean_orphans(url=settings.db_url, store=store, grace_seconds=GRACE).total == 0  # idempotent


def test_checkpoint_folders_without_a_row_go_unless_a_worker_holds_the_job(
    store: LocalStore, db: Callable[[], Any], settings: Any, queued_job: dict[str, Any]
) -> None:
    job = queued_job["id"]
    recorded = f"jobs/{job}/checkpoints/step-000002"
    add_checkpoint(db, store, job, 2)  # objects, then the row
    dead = f"jobs/{job}/checkpoints/step-000004"  # a worker killed before this checkpoint's row
    for name in ("adapter/adapter_model.safetensors", "adapter.tar.gz"):
        store.put_bytes(f"{dead}/{name}", b"bytes")
    store.put_bytes(f"jobs/{job}/notes.txt", b"a key of no known shape")  # never proven unreferenced: kept
    for key in store.list("jobs"):
        age(store, key, GRACE + 60)

    set_job(db, job, lease_owner="w1", lease_expires_at=time.time() + 60)  # a worker is uploading right now
    assert clean_orphans(url=settings.db_url, store=store, grace_seconds=GRACE).total == 0
    assert len(store.list(dead)) == 2

    set_job(db, job, lease_owner="w1", lease_expires_at=time.time() - 1)  # that worker died
    cleaned = clean_orphans(url=settings.db_url, store=store, grace_seconds=GRACE)
    assert cleaned.checkpoint_objects == 2
    assert store.list(dead) == []
    assert store.list("jobs") == sorted([f"{recorded}/adapter.tar.gz", f"jobs/{job}/notes.txt"])
    with db() as s:
        assert s.get(Job, job) is not None


WRITER = """
import sys, time
from api.storage import LocalStore

def chunks():
    yield b"x" * 4096
    print("writing", flush=True)
    time.sleep(120)

LocalStore(sys.argv[1]).put_stream("files/t/file-killed.jsonl", chunks())
"""


def test_a_write_killed_midway_leaves_a_temporary_that_the_clean_up_removes(store: LocalStore, settings: Any) -> None:
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(store.root)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "writing"
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    finally:
        proc.kill()
    leftovers = [p for p in store.root.rglob("*") if p.is_file()]
    assert len(leftovers) == 1 and leftovers[0].name.endswith(".tmp"), leftovers
    assert store.list() == []  # invisible to readers

    assert clean_orphans(url=settings.db_url, store=store, grace_seconds=GRACE).temporaries == 0  # too young
    later = time.time() + GRACE + 1
    assert clean_orphans(url=settings.db_url, store=store, grace_seconds=GRACE, at=later).temporaries == 1
    assert [p for p in store.root.rglob("*") if p.is_file()] == []
