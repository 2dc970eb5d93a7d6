"""``/v1/training_sessions``: the dashboard's view of Tinker training sessions, against rows written
straight into the database as the Tinker API and its workers write them. Listing tests use a fresh tenant each, so
that sessions made by other tests' tenants cannot change what is listed."""

from __future__ import annotations

import secrets
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from api import ids
from api.orm import SessionCheckpoint, SessionRequest, TinkerClientSession, TrainingSession
from tests.integration.conftest import Tenant, assert_error, http_client, make_tenant
from tests.integration.sql_statements import page_queries

SESSIONS = "/v1/training_sessions"
T0 = 1_767_000_000  # created_at of the sessions made here (unix seconds)


def add_session(
    db: Callable[[], Any], tenant_id: str, *, kind: str = "training", created_at: int = T0, **values: Any
) -> str:
    """A session of a new client session, as the Tinker API creates it: ``<client>:train:0`` or ``…:sample:0``."""
    client_id = ids.tinker_session_id()
    session_id = f"{client_id}:{'train' if kind == 'training' else 'sample'}:0"
    with db() as s:
        s.add(TinkerClientSession(id=client_id, tenant_id=tenant_id, created_at=created_at))
        s.flush()
        s.add(
            TrainingSession(
                id=session_id,
                tenant_id=tenant_id,
                client_session_id=client_id,
                kind=kind,
                created_at=created_at,
                **({"base_model": "tiny-arith", "lora": {"rank": 8}} | values),
            )
        )
    return session_id


def add_request(
    db: Callable[[], Any], tenant_id: str, session_id: str, kind: str, *, created_at: float, **values: Any
) -> str:
    """A request of the session, in the order of the calls (``seq``, the order the API answers them in)."""
    request_id = ids.tinker_request_id()
    with db() as s:
        s.add(
            SessionRequest(
                id=request_id,
                tenant_id=tenant_id,
                session_id=session_id,
                kind=kind,
                dedupe_key=request_id,
                payload=b"",
                created_at=created_at,
                **values,
            )
        )
    return request_id


@pytest.fixture
def tenant(settings: Any, base_url: str) -> Tenant:
    return make_tenant(settings, f"tinker-{secrets.token_hex(4)}")


@pytest.fixture
def client(base_url: str, tenant: Tenant) -> Iterator[httpx.Client]:
    with http_client(base_url, tenant.key) as c:
        yield c


def listed(client: httpx.Client, **params: Any) -> list[str]:
    body = client.get(SESSIONS, params=params).json()
    return [s["id"] for s in body["data"]]


class TestListTrainingSessions:
    def test_lists_newest_first_and_pages_with_after_until_has_more_is_false(
        self, client: httpx.Client, tenant: Tenant, db: Callable[[], Any]
    ) -> None:
        oldest = add_session(db, tenant.id, created_at=T0)
        # Two made in the same second: ordered by id, and a page boundary between them loses neither.
        same = sorted(add_session(db, tenant.id, created_at=T0 + 5) for _ in range(2))
        newest = add_session(db, tenant.id, created_at=T0 + 9)
        expected = [newest, *same, oldest]

        body = client.get(SESSIONS).json()
        assert body["object"] == "list"
        assert [s["id"] for s in body["data"]] == expected
        assert body["has_more"] is False

        pages, after = [], None
        while True:
            params: dict[str, Any] = {"limit": 2} | ({"after": after} if after else {})
            page = client.get(SESSIONS, params=params).json()
            pages.append(([s["id"] for s in page["data"]], page["has_more"]))
            if not page["has_more"]:
                break
            after = page["data"][-1]["id"]
        assert pages == [([newest, same[0]], True), ([same[1], oldest], False)]

    def test_each_session_has_its_status_numbers_and_saved_state_paths(
        self, client: httpx.Client, tenant: Tenant, db: Callable[[], Any]
    ) -> None:
        loaded = add_session(
            db,
            tenant.id,
            created_at=T0 + 2,
            loaded_on="worker-1",
            lora={"rank": 16, "seed": 3},
            request_count=7,
            optimizer_steps=3,
            saved_steps=2,
            last_loss=1.25,
            restores=1,
            last_request_at=T0 + 60,
        )
        closed = add_session(db, tenant.id, created_at=T0 + 1, closed_at=T0 + 90)
        unloaded = add_session(db, tenant.id, created_at=T0)
        with db() as s:
            s.add_all(
                [
                    SessionCheckpoint(
                        tenant_id=tenant.id,
                        session_id=loaded,
                        kind="weights",
                        name="step-2",
                        storage_key="k/1",
                        size_bytes=4096,
                        optimizer_steps=2,
                        created_at=T0 + 30,
                        expires_at=None,
                    ),
                    SessionCheckpoint(
                        tenant_id=tenant.id,
                        session_id=loaded,
                        kind="sampler_weights",
                        name="eval",
                        storage_key="k/2",
                        size_bytes=2048,
                        optimizer_steps=3,
                        created_at=T0 + 40,
                        expires_at=T0 + 3600,
                    ),
                ]
            )

        data = client.get(SESSIONS).json()["data"]
        assert [(s["id"], s["status"], s["worker"]) for s in data] == [
            (loaded, "loaded", "worker-1"),
            (closed, "closed", None),
            (unloaded, "unloaded", None),
        ]
        assert data[0] == {
            "object": "training_session",
            "id": loaded,
            "client_session_id": loaded.split(":")[0],
            "base_model": "tiny-arith",
            "lora_rank": 16,
            "status": "loaded",
            "worker": "worker-1",
            "created_at": T0 + 2,
            "last_request_at": T0 + 60,
            "request_count": 7,
            "optimizer_steps": 3,
            "last_loss": 1.25,
            "restores": 1,
            "saved_steps": 2,
            "saved_states": [
                {
                    "path": f"tinker://{loaded}/weights/step-2",
                    "kind": "weights",
                    "name": "step-2",
                    "optimizer_steps": 2,
                    "size_bytes": 4096,
                    "created_at": T0 + 30,
                    "expires_at": None,
                },
                {
                    "path": f"tinker://{loaded}/sampler_weights/eval",
                    "kind": "sampler_weights",
                    "name": "eval",
                    "optimizer_steps": 3,
                    "size_bytes": 2048,
                    "created_at": T0 + 40,
                    "expires_at": T0 + 3600,
                },
            ],
            "recent_requests": None,
        }

    def test_a_page_and_its_saved_states_cost_the_same_few_queries_whatever_its_size(
        self, client: httpx.Client, tenant: Tenant, db: Callable[[], Any], settings: Any
    ) -> None:
        sessions = [add_session(db, tenant.id, created_at=T0 + i) for i in range(10)]
        with db() as s:
            for session_id in sessions:
                for name in ("a", "b"):
                    s.add(
                        SessionCheckpoint(
                            tenant_id=tenant.id, session_id=session_id, kind="weights", name=name, storage_key=name
                        )
                    )
        small = page_queries(settings.db_url, client, SESSIONS, limit=2)
        large = page_queries(settings.db_url, client, SESSIONS, limit=10)
        after = page_queries(settings.db_url, client, SESSIONS, limit=10, after=sessions[5])
        assert small == large <= 3  # the page and its saved states (and the key, when not cached)
        assert after == small + 1  # and the cursor's position
        body = client.get(SESSIONS, params={"limit": 3, "after": sessions[5]}).json()
        assert [(s["id"], len(s["saved_states"])) for s in body["data"]] == [(i, 2) for i in sessions[4:1:-1]]
        assert body["has_more"] is True

    def test_sampling_sessions_are_not_listed(
        self, client: httpx.Client, tenant: Tenant, db: Callable[[], Any]
    ) -> None:
        training = add_session(db, tenant.id)
        add_session(db, tenant.id, kind="sampling", created_at=T0 + 1)
        assert listed(client) == [training]

    def test_another_tenants_sessions_are_not_listed_nor_usable_as_a_cursor(
        self, client: httpx.Client, tenant: Tenant, settings: Any, db: Callable[[], Any]
    ) -> None:
        mine = add_session(db, tenant.id)
        other = make_tenant(settings, f"tinker-{secrets.token_hex(4)}")
        theirs = add_session(db, other.id, created_at=T0 + 1)
        assert listed(client) == [mine]
        assert client.get(SESSIONS, params={"after": theirs}).json() == {
            "object": "list",
            "data": [],
            "has_more": False,
        }

    def test_without_a_key_is_401(self, anon: httpx.Client) -> None:
        assert_error(anon.get(SESSIONS), 401)

    @pytest.mark.parametrize("limit", [0, 101, "many"])
    def test_a_limit_out_of_range_is_400_naming_limit(self, api: httpx.Client, limit: Any) -> None:
        assert_error(api.get(SESSIONS, params={"limit": limit}), 400, param="limit")

    def test_an_empty_after_is_400_naming_after(self, api: httpx.Client) -> None:
        assert_error(api.get(SESSIONS, params={"after": ""}), 400, param="after")


class TestRetrieveTrainingSession:
    def test_returns_the_session_with_its_recent_requests_newest_first_and_their_errors(
        self, client: httpx.Client, tenant: Tenant, db: Callable[[], Any]
    ) -> None:
        session_id = add_session(db, tenant.id, request_count=3, optimizer_steps=1, last_loss=2.5)
        fb = add_request(
            db,
            tenant.id,
            session_id,
            "forward_backward",
            created_at=T0 + 1.0,
            status="done",
            loss=2.5,
            finished_at=T0 + 1.5,
        )
        step = add_request(
            db, tenant.id, session_id, "optim_step", created_at=T0 + 2.0, status="done", finished_at=T0 + 2.25
        )
        failed = add_request(
            db,
            tenant.id,
            session_id,
            "forward_backward",
            created_at=T0 + 3.0,
            status="failed",
            error={"error": "target_tokens: 3 tokens for 4 inputs", "category": "user"},
            finished_at=T0 + 3.5,
        )
        pending = add_request(db, tenant.id, session_id, "sample", created_at=T0 + 4.0)

        r = client.get(f"{SESSIONS}/{session_id}")
        assert r.status_code == 200, r.text
        body = r.json()
        assert (body["id"], body["status"], body["request_count"], body["last_loss"]) == (
            session_id,
            "unloaded",
            3,
            2.5,
        )
        assert body["recent_requests"] == [
            {
                "id": pending,
                "kind": "sample",
                "status": "pending",
                "loss": None,
                "error": None,
                "created_at": T0 + 4.0,
                "finished_at": None,
            },
            {
                "id": failed,
                "kind": "forward_backward",
                "status": "failed",
                "loss": None,
                "error": "target_tokens: 3 tokens for 4 inputs",
                "created_at": T0 + 3.0,
                "finished_at": T0 + 3.5,
            },
            {
                "id": step,
                "kind": "optim_step",
                "status": "done",
                "loss": None,
                "error": None,
                "created_at": T0 + 2.0,
                "finished_at": T0 + 2.25,
            },
            {
                "id": fb,
                "kind": "forward_backward",
                "status": "done",
                "loss": 2.5,
                "error": None,
                "created_at": T0 + 1.0,
                "finished_at": T0 + 1.5,
            },
        ]

    def test_another_tenants_session_is_404(self, api: httpx.Client, tenant_b: Tenant, db: Callable[[], Any]) -> None:
        theirs = add_session(db, tenant_b.id)
        assert_error(api.get(f"{SESSIONS}/{theirs}"), 404, param="session_id")

    def test_a_sampling_session_is_404(self, api: httpx.Client, tenant_a: Tenant, db: Callable[[], Any]) -> None:
        sampler = add_session(db, tenant_a.id, kind="sampling")
        assert_error(api.get(f"{SESSIONS}/{sampler}"), 404, param="session_id")

    def test_an_unknown_session_is_404(self, api: httpx.Client) -> None:
        assert_error(api.get(f"{SESSIONS}/sess-unknown:train:0"), 404, param="session_id")

    def test_without_a_key_is_401(self, anon: httpx.Client, tenant_a: Tenant, db: Callable[[], Any]) -> None:
        assert_error(anon.get(f"{SESSIONS}/{add_session(db, tenant_a.id)}"), 401)
