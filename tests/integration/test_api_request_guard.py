"""Paths and query strings: a NUL byte or a string that is not UTF-8 anywhere in a path or a
query string is a 400 naming the parameter, on every route, before it can reach PostgreSQL (which cannot store a
NUL). And a method a path does not serve is a 405 that lists, in ``Allow``, every method it does serve."""

from __future__ import annotations

import re
from typing import Any

import httpx
import pytest

from tests.integration.conftest import assert_error

BAD_TEXT = {"nul": "a%00b", "invalid-utf8": "a%FFb", "lone-surrogate-utf8": "a%ED%A0%80b"}


def operations(client: httpx.Client) -> list[tuple[str, str, dict[str, Any]]]:
    document = client.get("/openapi.json").json()
    return [(method.upper(), path, op) for path, item in document["paths"].items() for method, op in item.items()]


def fill(path: str, bad: str, *, target: str | None = None) -> str:
    """``path`` with every parameter set to a harmless value, ``target`` to ``bad``."""
    return re.sub(r"\{(\w+)\}", lambda m: bad if m.group(1) == target else "x1", path)


@pytest.mark.parametrize("bad", BAD_TEXT.values(), ids=BAD_TEXT.keys())
def test_bad_text_in_any_path_parameter_is_a_400_naming_it(api: httpx.Client, bad: str) -> None:
    cases = [
        (method, fill(path, bad, target=name), name)
        for method, path, op in operations(api)
        for name in re.findall(r"\{(\w+)\}", path)
    ]
    assert len(cases) >= 14  # every route with a path parameter, each parameter
    for method, url, name in cases:
        response = api.request(method, url)
        assert_error(response, 400, param=name, message_contains=f"{name}: must be UTF-8 text without NUL")


@pytest.mark.parametrize("bad", BAD_TEXT.values(), ids=BAD_TEXT.keys())
def test_bad_text_in_any_query_parameter_is_a_400_naming_it(api: httpx.Client, bad: str) -> None:
    cases = [
        (method, fill(path, "x1"), p["name"])
        for method, path, op in operations(api)
        for p in op.get("parameters", ())
        if p["in"] == "query"
    ]
    assert len(cases) >= 10
    for method, url, name in cases:
        response = api.request(method, f"{url}?{name}={bad}")
        assert_error(response, 400, param=name, message_contains=f"{name}: must be UTF-8 text")


@pytest.mark.parametrize(
    ("query", "param"),
    [
        ("metadata%5Bk%5D=a%00b", "metadata[k]"),  # the job list's metadata filter (it answered 500)
        ("metadata%5Bk%00%5D=v", "metadata[k\\x00]"),  # a bad name is named as it came, NUL shown escaped
        ("after=%00", "after"),
        ("unknown=%00", "unknown"),  # a parameter no route reads is still refused
    ],
)
def test_bad_text_in_the_job_list_query_is_a_400(api: httpx.Client, query: str, param: str) -> None:
    assert_error(api.get(f"/v1/fine_tuning/jobs?{query}"), 400, param=param)


def test_bad_text_is_refused_without_a_key_too(anon: httpx.Client) -> None:
    assert_error(anon.get("/v1/files/a%00b"), 400, param="file_id")
    assert_error(anon.get("/v1/files?after=%00"), 400, param="after")


def test_bad_text_in_a_path_no_route_names_is_a_400(anon: httpx.Client) -> None:
    # The dashboard's static files: a NUL reached the file system's path functions (a 500).
    assert_error(anon.get("/dashboard/app%00.js"), 400, param=None)


def test_plain_text_still_reaches_the_routes(api: httpx.Client) -> None:
    # Percent-encoded UTF-8 is text: it is decoded and served (here: no such file).
    assert_error(api.get("/v1/files/caf%C3%A9"), 404, param="file_id")
    assert api.get("/v1/fine_tuning/jobs?metadata%5Bk%5D=caf%C3%A9").status_code == 200


class TestMethodNotAllowed:
    @pytest.mark.parametrize(
        ("method", "path", "allow"),
        [
            ("PUT", "/v1/files", "GET, POST"),  # two routes share the path: both methods are listed
            ("TRACE", "/v1/files/file-x", "DELETE, GET"),
            ("PATCH", "/v1/fine_tuning/jobs/ftjob-x", "GET"),
            ("GET", "/v1/fine_tuning/jobs/ftjob-x/cancel", "POST"),
            ("POST", "/healthz", "GET"),
        ],
    )
    def test_405_lists_every_method_the_path_serves(
        self, api: httpx.Client, method: str, path: str, allow: str
    ) -> None:
        response = api.request(method, path)
        assert_error(response, 405)
        assert response.headers["allow"] == allow
