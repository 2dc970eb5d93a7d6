"""``files.create(expires_after=...)`` through the official ``openai`` client: the file's ``expires_at``, OpenAI's
range of seconds, a 404 from the moment it expires, a job creation naming it refused, the clean-up's deletion of its
row and bytes (``api.services.cleanup``), and a worker that finds a queued job's file expired failing it."""

from __future__ import annotations

import io
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import httpx2
import openai
import pytest
from openai import OpenAI

from api.orm import File
from api.services.cleanup import clean_orphans, delete_expired_files
from api.storage import LocalStore
from tests.integration.conftest import Tenant, assert_error, job_body, jsonl, prompts
from worker.errors import JobError
from worker.job_prepare import _download_file


@pytest.fixture
def client(base_url: str, tenant_a: Tenant) -> Iterator[OpenAI]:
    with (
        httpx2.Client(timeout=30) as http,
        OpenAI(base_url=f"{base_url}/v1", api_key=tenant_a.key, max_retries=0, http_client=http) as c,
    ):
        yield c


def create(client: OpenAI, seconds: int, anchor: str = "created_at") -> Any:
    return client.files.create(
        file=("train.jsonl", io.BytesIO(jsonl(prompts(2)))),
        purpose="fine-tune",
        expires_after={"anchor": anchor, "seconds": seconds},  # type: ignore[typeddict-item]
    )


def expire(db: Callable[[], Any], file_id: str) -> None:
    """Move the file's expiry into the past, as the hour after its upload would."""
    with db() as s:
        s.query(File).filter(File.id == file_id).update({"expires_at": int(time.time()) - 1})


def test_expires_after_sets_expires_at_and_a_file_without_it_never_expires(client: OpenAI) -> None:
    for seconds in (3600, 2_592_000):  # OpenAI's bounds, both included
        made = create(client, seconds)
        assert made.expires_at == made.created_at + seconds
        assert client.files.retrieve(made.id).expires_at == made.expires_at
    plain = client.files.create(file=("t.jsonl", io.BytesIO(jsonl(prompts(1)))), purpose="fine-tune")
    assert plain.expires_at is None


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"expires_after[anchor]": "created_at", "expires_after[seconds]": "3599"}, "expires_after.seconds"),
        ({"expires_after[anchor]": "created_at", "expires_after[seconds]": "2592001"}, "expires_after.seconds"),
        ({"expires_after[anchor]": "created_at", "expires_after[seconds]": "soon"}, "expires_after.seconds"),
        ({"expires_after[anchor]": "last_active_at", "expires_after[seconds]": "3600"}, "expires_after.anchor"),
        ({"expires_after[seconds]": "3600"}, "expires_after.anchor"),
        ({"expires_after[anchor]": "created_at"}, "expires_after.seconds"),
        ({"expires_after": '{"anchor": "created_at", "seconds": 60}'}, "expires_after.seconds"),
        ({"expires_after": '{"anchor": "created_at", "seconds": 3600, "ttl": 1}'}, "expires_after"),
        ({"expires_after": "in an hour"}, "expires_after"),
    ],
)
def test_a_bad_expiry_is_a_400_naming_its_field_and_stores_nothing(
    api: httpx.Client, artifact_store: Any, tenant_a: Tenant, fields: dict[str, str], param: str
) -> None:
    before = list(artifact_store.list(f"files/{tenant_a.id}"))
    r = api.post("/v1/files", files={"file": ("t.jsonl", jsonl(prompts(1)))}, data={"purpose": "fine-tune", **fields})
    assert_error(r, 400, param=param)
    assert list(artifact_store.list(f"files/{tenant_a.id}")) == before


def test_expires_after_as_one_json_field_is_taken_too(api: httpx.Client) -> None:
    policy = '{"anchor": "created_at", "seconds": 3600}'
    r = api.post(
        "/v1/files",
        files={"file": ("t.jsonl", jsonl(prompts(1)))},
        data={"purpose": "fine-tune", "expires_after": policy},
    )
    assert r.status_code == 200, r.text
    assert r.json()["expires_at"] == r.json()["created_at"] + 3600


def test_the_sdk_names_the_field_of_an_expiry_out_of_range(client: OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        create(client, 60)
    assert err.value.param == "expires_after.seconds"  # type: ignore[attr-defined]


def test_an_expired_file_is_gone_for_its_tenant_then_deleted_by_the_clean_up(
    client: OpenAI, api: httpx.Client, db: Callable[[], Any], settings: Any, tmp_path: Path, tenant_a: Tenant
) -> None:
    store = LocalStore(tmp_path / "artifacts")
    made, kept = create(client, 3600), create(client, 7200)
    for f in (made, kept):
        store.put_bytes(f"files/{tenant_a.id}/{f.id}.jsonl", b"{}\n")  # the clean-up's own store
    expire(db, made.id)

    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(made.id)
    assert made.id not in [f.id for f in client.files.list()]
    r = api.post("/v1/fine_tuning/jobs", json=job_body(kept.id, validation_file=made.id))
    error = assert_error(r, 400, param="validation_file", code="file_expired")
    assert made.id in error["message"]

    cleaned = clean_orphans(url=settings.db_url, store=store)
    assert cleaned.expired_files >= 1
    with db() as s:
        assert s.get(File, made.id).deleted is True and s.get(File, kept.id).deleted is False
    assert store.list(f"files/{tenant_a.id}") == [f"files/{tenant_a.id}/{kept.id}.jsonl"]
    assert delete_expired_files(url=settings.db_url, store=store) == 0  # nothing left to delete
    assert client.files.retrieve(kept.id).id == kept.id


def test_a_worker_fails_a_job_whose_file_expired_before_it_read_it(
    client: OpenAI, db: Callable[[], Any], settings: Any, tmp_path: Path
) -> None:
    made = create(client, 3600)
    ctx: Any = SimpleNamespace(url=settings.db_url, store=None, db=lambda what, fn: fn())
    expire(db, made.id)
    with pytest.raises(JobError) as err:
        _download_file(ctx, made.id, tmp_path / "train.jsonl")
    assert err.value.code == "invalid_file" and made.id in str(err.value)
    assert not (tmp_path / "train.jsonl").exists()
