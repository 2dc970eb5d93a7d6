"""Request bodies: the API key is checked before a byte of the body is read, and every body is
bounded as it streams in, chunked or not.

The server here is a `proxima serve --no-worker` process of its own, on the session's test database, with its own
temporary folder (TMPDIR) and artifact folder: what it reads, writes and holds in memory is measured from /proc
(``wchar``: every byte it wrote, to a disk or not; ``VmHWM``: its peak resident memory), so that nothing the test
process or another test does shows in the figures.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.integration.conftest import Tenant, assert_error, free_port, jsonl, make_tenant, prompts

REPO = Path(__file__).resolve().parents[2]
UPLOAD_LIMIT = 1 << 20  # the server's PROXIMA_MAX_UPLOAD_BYTES
REQUEST_LIMIT = 64 * 1024  # its PROXIMA_MAX_REQUEST_BYTES
MiB = 1 << 20


@dataclass
class Server:
    base: str
    pid: int
    tmp: Path
    artifacts: Path
    tenant: Tenant

    def proc(self, name: str) -> dict[str, int]:
        """``/proc/<pid>/<name>`` (``io`` or ``status``) as numbers: kB for the memory lines, bytes for io."""
        values: dict[str, int] = {}
        for line in Path(f"/proc/{self.pid}/{name}").read_text().splitlines():
            key, _, value = line.partition(":")
            first = value.split()[:1]
            if first and first[0].isdigit():
                values[key] = int(first[0])
        return values

    def written(self) -> int:
        return self.proc("io")["wchar"]

    def reset_peak_memory(self) -> int:
        """Reset the peak resident size to the current one (``clear_refs`` 5) and return it, in kB."""
        Path(f"/proc/{self.pid}/clear_refs").write_text("5")
        return self.proc("status")["VmHWM"]

    def peak_memory(self) -> int:
        return self.proc("status")["VmHWM"]

    def leftovers(self) -> list[str]:
        """Every file in the server's temporary folder and artifact store (a store keeps partial writes as
        dot-files beside their target)."""
        return sorted(str(p) for root in (self.tmp, self.artifacts) for p in root.rglob("*") if p.is_file())


@pytest.fixture(scope="module")
def server(settings: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    root = tmp_path_factory.mktemp("limits")
    tmp, artifacts, home = root / "tmp", root / "artifacts", root / "home"
    for folder in (tmp, artifacts, home):
        folder.mkdir()
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PROXIMA_")} | {
        "PROXIMA_HOME": str(home),
        "PROXIMA_DATABASE_URL": settings.database_url,
        "PROXIMA_BROKER_URL": settings.broker_url,
        "PROXIMA_ARTIFACTS": str(artifacts),
        "PROXIMA_MAX_UPLOAD_BYTES": str(UPLOAD_LIMIT),
        "PROXIMA_MAX_REQUEST_BYTES": str(REQUEST_LIMIT),
        "TMPDIR": str(tmp),
    }
    log = (root / "server.log").open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "proxima.cli", "serve", "--no-worker", "--no-inference", "--port", str(port)],
        cwd=REPO,
        env=env,
        stdout=log,
        stderr=log,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{base}/readyz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, (root / "server.log").read_text()
            time.sleep(0.2)
        yield Server(base, proc.pid, tmp, artifacts, make_tenant(settings, "limits"))
    finally:
        proc.terminate()
        proc.wait(timeout=15)
        log.close()


@dataclass
class Stream:
    """A request body of ``total`` bytes sent in 1 MiB chunks (chunked transfer encoding: no declared length);
    ``sent`` counts what the client handed to the connection before the server's answer stopped it."""

    total: int
    head: bytes = b""
    chunk: bytes = b"x" * MiB
    pause_s: float = 0.0  # after the head: the server reads it (and may answer) before the rest comes
    sent: int = field(default=0, init=False)

    def __iter__(self) -> Iterator[bytes]:
        if self.head:
            self.sent += len(self.head)
            yield self.head
            time.sleep(self.pause_s)
        while self.sent < self.total:
            self.sent += len(self.chunk)
            yield self.chunk


def post(server: Server, path: str, body: Stream, *, key: str | None, content_type: str) -> httpx.Response:
    headers = {"content-type": content_type}
    if key:
        headers["authorization"] = f"Bearer {key}"
    return httpx.post(f"{server.base}{path}", content=body, headers=headers, timeout=60)


MULTIPART = "multipart/form-data; boundary=proxima-test-boundary"
# The start of a well-formed upload: the purpose field, then the file part, whose bytes follow (and never end).
UPLOAD_HEAD = (
    b'--proxima-test-boundary\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nfine-tune\r\n'
    b'--proxima-test-boundary\r\nContent-Disposition: form-data; name="file"; filename="big.jsonl"\r\n'
    b"Content-Type: application/jsonl\r\n\r\n"
)


class TestAuthenticatedBeforeTheBody:
    def test_a_chunked_2gib_upload_without_a_key_is_401_having_read_and_written_nothing(self, server: Server) -> None:
        body, written = Stream(2 << 30, head=UPLOAD_HEAD), server.written()
        response = post(server, "/v1/files", body, key=None, content_type=MULTIPART)
        assert_error(response, 401, code="missing_api_key")
        assert response.headers["connection"] == "close"
        # What the socket buffers took before the answer: the server read none of it (it would take it all).
        assert body.sent < 32 * MiB, body.sent
        assert server.written() - written < 64 * 1024  # the answer, a log line: no temporary file
        assert server.leftovers() == []

    def test_a_wrong_key_is_401_before_the_body_too(self, server: Server) -> None:
        body = Stream(2 << 30, head=UPLOAD_HEAD)
        response = post(server, "/v1/files", body, key="sk-not-a-key", content_type=MULTIPART)
        assert_error(response, 401, code="invalid_api_key")
        assert body.sent < 32 * MiB, body.sent

    def test_a_256mb_json_body_without_a_key_is_refused_without_the_server_growing(self, server: Server) -> None:
        before = server.reset_peak_memory()
        body = Stream(256 * MiB)
        response = post(server, "/v1/fine_tuning/jobs", body, key=None, content_type="application/json")
        assert_error(response, 401, code="missing_api_key")
        assert body.sent < 32 * MiB, body.sent
        assert server.peak_memory() - before < 4 * 1024, "kB"  # a few MB at most (it was ~750 MB)


class TestBodiesAreBounded:
    def test_a_chunked_upload_over_the_limit_is_413_as_it_passes_and_leaves_nothing(self, server: Server) -> None:
        body, written = Stream(2 << 30, head=UPLOAD_HEAD), server.written()
        response = post(server, "/v1/files", body, key=server.tenant.key, content_type=MULTIPART)
        assert_error(response, 413, param="file", code="file_too_large", message_contains=str(UPLOAD_LIMIT))
        assert body.sent < UPLOAD_LIMIT + 32 * MiB, body.sent
        assert server.written() - written < UPLOAD_LIMIT + MiB  # at most what it spooled up to the limit
        # The guard's 413 goes out as the body passes the limit; the handler, told the client is gone, then removes
        # its partial write (at once on an idle machine, later on a busy one)
        deadline = time.monotonic() + 10
        while server.leftovers() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert server.leftovers() == []

    def test_the_routes_own_413_closes_the_connection_and_reads_no_more_of_the_body(self, server: Server) -> None:
        """The file part passes the upload limit while the whole body is still within the guard's (the multipart
        framing's slack): the route answers first, and its answer, given before the body ended, closes the connection
        too, so the server does not read and drop the remaining 2 GiB (it did: uvicorn keeps a connection it may
        reuse, and reads the rest of the request to reach the next)."""
        body = Stream(2 << 30, head=UPLOAD_HEAD + b"x" * (UPLOAD_LIMIT + 1), pause_s=1.0)
        response = post(server, "/v1/files", body, key=server.tenant.key, content_type=MULTIPART)
        assert_error(response, 413, param="file", code="file_too_large", message_contains="the file exceeds")
        assert response.headers["connection"] == "close"
        assert body.sent < UPLOAD_LIMIT + 32 * MiB, body.sent

    def test_a_declared_length_over_the_limit_is_413_before_reading(self, server: Server) -> None:
        response = httpx.post(
            f"{server.base}/v1/fine_tuning/jobs",
            content=b"{" + b" " * (REQUEST_LIMIT + 1),
            headers={"authorization": f"Bearer {server.tenant.key}", "content-type": "application/json"},
        )
        assert_error(response, 413, param=None, code="request_too_large", message_contains=str(REQUEST_LIMIT))

    def test_a_chunked_json_body_over_the_limit_is_413_without_the_server_growing(self, server: Server) -> None:
        before = server.reset_peak_memory()
        body = Stream(256 * MiB)
        response = post(server, "/v1/fine_tuning/jobs", body, key=server.tenant.key, content_type="application/json")
        assert_error(response, 413, code="request_too_large")
        assert body.sent < 32 * MiB, body.sent
        assert server.peak_memory() - before < 4 * 1024, "kB"

    def test_bodies_within_the_limits_are_served(self, server: Server) -> None:
        with httpx.Client(base_url=server.base, headers={"authorization": f"Bearer {server.tenant.key}"}) as api:
            content = jsonl(prompts(4))
            uploaded = api.post("/v1/files", files={"file": ("t.jsonl", content)}, data={"purpose": "fine-tune"})
            assert uploaded.status_code == 200, uploaded.text
            assert uploaded.json()["bytes"] == len(content)
            # A chunked JSON body within the limit (no declared length) is read whole.
            spec = {
                "model": "tiny-arith",
                "training_file": uploaded.json()["id"],
                "method": {"type": "supervised", "supervised": {}},
            }
            response = api.post(
                "/v1/fine_tuning/jobs",
                content=iter([json.dumps(spec).encode()]),
                headers={"content-type": "application/json"},
            )
            assert response.status_code == 200, response.text
            assert response.json()["status"] == "validating_files"
