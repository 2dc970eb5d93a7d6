"""The OpenAPI document is true: clients are generated from it, so it declares the bearer key and
every error the API answers, and schemathesis finds no server error and no answer that contradicts it.

schemathesis runs as its command line does (``--checks all``, every phase, NUL bytes allowed) against the real
service of tests/integration/conftest.py, with a valid key of a tenant of its own, and a bounded number of examples
per operation so that it stays under a minute.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.integration.conftest import (
    add_checkpoint,
    http_client,
    job_body,
    jsonl,
    make_tenant,
    prompts,
    set_job,
    upload,
    validate,
)

MAX_EXAMPLES = 10
SEED = 12  # fixed: a failure here reproduces with the same command (printed with its output)


def config(*, files: list[str], jobs: list[str], checkpoints: list[str]) -> str:
    """schemathesis's configuration.

    positive_data_acceptance expects a request the schema allows to succeed. A schema cannot say that an id refers to
    an existing object (an `after` cursor, a `training_file`), and such a reference answers 400 as in OpenAI's API;
    400 is documented for every operation. The ids of real objects of the tenant are drawn half the time for the
    parameters that name one, so that the answers about real objects (a job, its checkpoints, metrics, events, a
    file's content) are checked against the document too, not only 404s. A warning that the run did not test what
    it meant to (no valid key, an unreadable document) fails it. Deleting a base model is the one 403 (as OpenAI's,
    permission to delete only what the tenant fine-tuned): its operation expects it, and is left out of the check for
    a key that answers only 401/403, since the one model the dictionary names is a base model."""
    return f"""\
[checks.positive_data_acceptance]
expected-statuses = ["2xx", "400", "401", "404", "409"]

[warnings]
fail-on = ["missing_auth", "base_url_mismatch", "unresolvable_reference", "missing_deserializer"]

[[operations]]
include-path = "/v1/models/{{model_id}}"
include-method = "DELETE"
checks.positive_data_acceptance.expected-statuses = ["2xx", "400", "401", "403", "404", "409"]
warnings.fail-on = ["base_url_mismatch", "unresolvable_reference", "missing_deserializer"]

[dictionaries.files]
values = {json.dumps(files)}

[dictionaries.jobs]
values = {json.dumps(jobs)}

[dictionaries.checkpoints]
values = {json.dumps(checkpoints)}

[dictionaries.models]
values = ["tiny-arith"]

[parameters]
"path.file_id" = {{ dictionary = "files", probability = 0.5 }}
"path.fine_tuning_job_id" = {{ dictionary = "jobs", probability = 0.5 }}
"path.checkpoint_id" = {{ dictionary = "checkpoints", probability = 0.5 }}
"path.model_id" = {{ dictionary = "models", probability = 0.5 }}
"body.training_file" = {{ dictionary = "files", probability = 0.5 }}
"body.validation_file" = {{ dictionary = "files", probability = 0.5 }}
"""


@pytest.fixture(scope="module")
def document(base_url: str) -> dict[str, Any]:
    return httpx.get(f"{base_url}/openapi.json").json()


def operations(document: dict[str, Any]) -> list[tuple[str, str, dict[str, Any]]]:
    return [(m.upper(), path, op) for path, item in document["paths"].items() for m, op in item.items()]


def error_schema(answer: dict[str, Any]) -> str:
    return str(answer["content"]["application/json"]["schema"]["$ref"])


class TestDocument:
    def test_the_bearer_key_is_declared_on_every_v1_operation(self, document: dict[str, Any]) -> None:
        schemes = document["components"]["securitySchemes"]
        assert schemes == {
            "bearerAuth": {"type": "http", "scheme": "bearer", "description": schemes["bearerAuth"]["description"]}
        }
        ops = operations(document)
        assert len(ops) >= 22
        for method, path, op in ops:
            if path.startswith("/v1/"):
                assert op["security"] == [{"bearerAuth": []}], (method, path)
                assert "401" in op["responses"], (method, path)
            else:
                assert "security" not in op, (method, path)

    def test_errors_are_documented_with_the_envelope_and_no_422(self, document: dict[str, Any]) -> None:
        envelope = document["components"]["schemas"]["ErrorResponse"]
        assert envelope["required"] == ["error"]
        error = document["components"]["schemas"]["ErrorObject"]
        assert set(error["required"]) == {"message", "type", "param", "code"}
        assert "HTTPValidationError" not in document["components"]["schemas"]
        for method, path, op in operations(document):
            answers = op["responses"]
            assert "422" not in answers, (method, path)  # validation errors are 400s
            expected = {"400"}
            if path.startswith("/v1/"):
                expected |= {"401", "503"}
            if "{" in path:
                expected.add("404")
            if "requestBody" in op:
                expected.add("413")
            assert expected <= set(answers), (method, path, sorted(answers))
            for status, answer in answers.items():
                if status >= "400":
                    assert error_schema(answer) == "#/components/schemas/ErrorResponse", (method, path, status)
            if "503" in answers:
                assert "Retry-After" in answers["503"]["headers"]

    @pytest.mark.parametrize(
        ("method", "path", "status"),
        [
            ("POST", "/v1/fine_tuning/jobs/{fine_tuning_job_id}/cancel", "409"),
            ("POST", "/v1/fine_tuning/jobs/{fine_tuning_job_id}/pause", "409"),
            ("POST", "/v1/fine_tuning/jobs/{fine_tuning_job_id}/resume", "409"),
            ("POST", "/v1/files", "507"),
            ("GET", "/readyz", "503"),
        ],
    )
    def test_particular_errors_are_documented(
        self, document: dict[str, Any], method: str, path: str, status: str
    ) -> None:
        assert status in document["paths"][path][method.lower()]["responses"]

    def test_the_upload_purpose_is_an_enum(self, document: dict[str, Any]) -> None:
        from api.schemas import FILE_PURPOSES

        request_body = document["paths"]["/v1/files"]["post"]["requestBody"]
        form = request_body["content"]["multipart/form-data"]["schema"]
        assert request_body["required"] is True and form["required"] == ["file", "purpose"]
        assert form["properties"]["purpose"]["enum"] == list(FILE_PURPOSES)
        assert form["properties"]["file"] == {
            "type": "string",
            "contentMediaType": "application/octet-stream",
            "title": "File",
        }


def test_schemathesis_finds_no_server_error_and_no_answer_against_the_document(
    base_url: str, settings: Any, db: Callable[[], Any], artifact_store: Any, tmp_path: Path
) -> None:
    tenant = make_tenant(settings, "schemathesis")
    with http_client(base_url, tenant.key) as api:
        uploaded = upload(api, jsonl(prompts()))
        assert uploaded.status_code == 200, uploaded.text
        file_id = uploaded.json()["id"]
        jobs = []
        for status in ("queued", "paused", "succeeded"):
            created = api.post("/v1/fine_tuning/jobs", json=job_body(file_id))
            assert created.status_code == 200, created.text
            jobs.append(created.json()["id"])
            assert validate(settings, jobs[-1]) == "queued"
            if status != "queued":
                set_job(db, jobs[-1], status=status)
        checkpoints = [add_checkpoint(db, artifact_store, job, step=2) for job in jobs[1:]]
    (tmp_path / "schemathesis.toml").write_text(config(files=[file_id], jobs=jobs, checkpoints=checkpoints))
    command = [
        sys.executable,
        "-m",
        "schemathesis.cli",
        "--config-file",
        str(tmp_path / "schemathesis.toml"),
        "run",
        f"{base_url}/openapi.json",
        # This app has no inference server (its completions are 503s by design): the completions are fuzzed against a
        # real one in tests/integration/test_api_chat_completions.py.
        "--exclude-path-regex",
        "^/v1/(chat/)?completions$",
        "--checks",
        "all",
        "--phases",
        "examples,coverage,fuzzing,stateful",
        "--generation-allow-x00",
        "true",
        "--max-examples",
        str(MAX_EXAMPLES),
        "--seed",
        str(SEED),
        "--generation-database",
        "none",
        "--header",
        f"Authorization: Bearer {tenant.key}",
        "--request-timeout",
        "20",
        "--no-color",
    ]
    result = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-20000:]
    assert "Tested: 48" in output, output[-3000:]  # every operation (a new one raises this count)
    for phase in ("Coverage", "Fuzzing", "Stateful"):  # run, not skipped (examples: the document has none)
        assert f"✅ {phase}" in output, output[-3000:]
