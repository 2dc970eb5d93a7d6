"""``POST /v1/fine_tuning/jobs`` with OpenAI's RFT ``response_format`` over HTTP: kept on the job and answered back as
given; refused with a 400 naming the field where it cannot apply or breaks the schema rules."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.integration.conftest import GRADER, assert_error, job_body

SCHEMA = {
    "type": "object",
    "properties": {"answer": {"type": "integer"}},
    "required": ["answer"],
    "additionalProperties": False,
}
FORMAT = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True}}


def reinforcement(training_file: str, **block: Any) -> dict[str, Any]:
    return job_body(
        training_file,
        method={"type": "reinforcement", "reinforcement": {"grader": GRADER, **block}},
    )


def test_a_json_schema_format_is_kept_on_the_job_and_answered_as_given(api: httpx.Client, training_file: str) -> None:
    r = api.post("/v1/fine_tuning/jobs", json=reinforcement(training_file, response_format=FORMAT))
    assert r.status_code == 200, r.text
    job = r.json()
    assert job["method"]["reinforcement"]["response_format"] == FORMAT
    again = api.get(f"/v1/fine_tuning/jobs/{job['id']}")
    assert again.status_code == 200 and again.json()["method"]["reinforcement"]["response_format"] == FORMAT


@pytest.mark.parametrize(
    ("fmt", "param", "message"),
    [
        (
            {"type": "json_schema", "json_schema": {"name": "a", "schema": {**SCHEMA, "required": []}, "strict": True}},
            "method.reinforcement.response_format.json_schema.schema",
            "strict mode needs every property required; missing: answer",
        ),
        (
            {"type": "json_schema", "json_schema": {"name": "a", "schema": {"uniqueItems": True}}},
            "method.reinforcement.response_format.json_schema.schema",
            "'uniqueItems' cannot be enforced",
        ),
        ({"type": "xml"}, "method.reinforcement.response_format", "must be one of text, json_object, json_schema"),
    ],
)
def test_a_bad_format_is_a_400_naming_where(
    api: httpx.Client, training_file: str, fmt: dict[str, Any], param: str, message: str
) -> None:
    r = api.post("/v1/fine_tuning/jobs", json=reinforcement(training_file, response_format=fmt))
    assert_error(r, 400, param=param, message_contains=message)


def test_a_method_that_samples_no_answers_is_a_400_naming_the_field(api: httpx.Client, training_file: str) -> None:
    body = job_body(training_file, method={"type": "supervised", "supervised": {"response_format": FORMAT}})
    r = api.post("/v1/fine_tuning/jobs", json=body)
    assert_error(r, 400, param="method.supervised.response_format", message_contains="samples no answers")
