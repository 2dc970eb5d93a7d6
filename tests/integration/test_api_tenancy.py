"""Tenancy and authentication: another tenant's objects do not exist; a missing or wrong key is a 401."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx
import pytest

from tests.integration.conftest import add_checkpoint, assert_error, job_body


@pytest.fixture
def a_objects(
    api: httpx.Client, queued_job: dict[str, Any], db: Callable[[], Any], artifact_store: Any
) -> dict[str, str]:
    ckpt = add_checkpoint(db, artifact_store, queued_job["id"], 2)
    return {"job": queued_job["id"], "file": queued_job["training_file"], "ckpt": ckpt}


def a_paths(o: dict[str, str]) -> list[tuple[str, str]]:
    job = f"/v1/fine_tuning/jobs/{o['job']}"
    return [
        ("GET", f"/v1/files/{o['file']}"),
        ("GET", f"/v1/files/{o['file']}/content"),
        ("DELETE", f"/v1/files/{o['file']}"),
        ("GET", job),
        ("GET", f"{job}/events"),
        ("GET", f"{job}/checkpoints"),
        ("GET", f"{job}/checkpoints/{o['ckpt']}/adapter"),
        ("GET", f"{job}/metrics"),
        ("GET", f"{job}/rollouts"),
        ("POST", f"{job}/cancel"),
        ("POST", f"{job}/pause"),
        ("POST", f"{job}/resume"),
    ]


class TestTenancy:
    def test_tenant_b_gets_404_for_every_object_of_tenant_a(
        self, api: httpx.Client, api_b: httpx.Client, a_objects: dict[str, str]
    ) -> None:
        for method, path in a_paths(a_objects):
            assert_error(api_b.request(method, path), 404, code="not_found")
        # ... and nothing of A's changed: A still sees its file and its queued job.
        assert api.get(f"/v1/files/{a_objects['file']}").status_code == 200
        assert api.get(f"/v1/fine_tuning/jobs/{a_objects['job']}").json()["status"] == "queued"
        assert (
            api.get(f"/v1/fine_tuning/jobs/{a_objects['job']}/checkpoints/{a_objects['ckpt']}/adapter").status_code
            == 200
        )

    def test_tenant_b_lists_none_of_tenant_a(self, api_b: httpx.Client, a_objects: dict[str, str]) -> None:
        assert a_objects["file"] not in [f["id"] for f in api_b.get("/v1/files").json()["data"]]
        jobs = api_b.get("/v1/fine_tuning/jobs", params={"limit": 1000}).json()["data"]
        assert a_objects["job"] not in [j["id"] for j in jobs]

    def test_tenant_b_cannot_train_on_tenant_a_file(self, api_b: httpx.Client, a_objects: dict[str, str]) -> None:
        r = api_b.post("/v1/fine_tuning/jobs", json=job_body(a_objects["file"]))
        assert_error(r, 400, param="training_file", code="file_not_found")


class TestAuthentication:
    @pytest.mark.parametrize(
        "headers",
        [{}, {"authorization": "Bearer sk-prx-wrong"}, {"authorization": "Basic abc"}, {"authorization": "Bearer"}],
    )
    def test_missing_or_wrong_key_is_401_everywhere(
        self, anon: httpx.Client, a_objects: dict[str, str], headers: dict[str, str]
    ) -> None:
        paths = [
            *a_paths(a_objects),
            ("GET", "/v1/files"),
            ("POST", "/v1/files"),
            ("GET", "/v1/fine_tuning/jobs"),
            ("POST", "/v1/fine_tuning/jobs"),
            ("GET", "/v1/models"),
            ("POST", "/v1/fine_tuning/alpha/graders/validate"),
        ]
        for method, path in paths:
            r = anon.request(method, path, headers=headers, json={} if method == "POST" else None)
            error = assert_error(r, 401)
            assert error["type"] == "authentication_error", (method, path)
