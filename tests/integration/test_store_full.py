"""An upload into a full artifact store (the API's side; the worker's is in tests/e2e/test_worker_faults.py): a 507
that says the store is full, nothing half-written left in the store, no row, and the next upload that fits is stored
as usual.

The store is a local folder on a 1 MiB tmpfs of the test's own (mounting one needs root, as CI runs).
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.integration.conftest import Tenant, assert_error, http_client, jsonl, prompts, serve, upload


@pytest.fixture
def small_store(tmp_path: Path) -> Iterator[Path]:
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    folder = tmp_path / "store"
    folder.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(folder)], check=True)
    try:
        yield folder
    finally:
        subprocess.run(["umount", str(folder)], check=True)


def files_in(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())


@pytest.mark.expected_5xx(507)
def test_an_upload_into_a_full_store_is_a_507_and_leaves_nothing(
    settings: Any, tenant_a: Tenant, small_store: Path
) -> None:
    from api.app import create_app

    full = settings.model_copy(update={"artifacts": str(small_store), "max_upload_bytes": 4 << 20})
    row = json.dumps({"prompt": "p" * 1000, "answer": "1"}).encode() + b"\n"
    with serve(create_app(full)) as base, http_client(base, tenant_a.key) as api:
        before = api.get("/v1/files", params={"limit": 10000}).json()["data"]
        too_big = row * 2000  # 2 MB into 1 MiB
        assert_error(
            upload(api, too_big), 507, param=None, code="store_full", message_contains="the artifact store is full"
        )
        assert files_in(small_store) == []  # no temporary file, no partial object
        assert api.get("/v1/files", params={"limit": 10000}).json()["data"] == before
        fits = jsonl(prompts(3))
        stored = upload(api, fits)
        assert stored.status_code == 200, stored.text
        assert api.get(f"/v1/files/{stored.json()['id']}/content").content == fits
