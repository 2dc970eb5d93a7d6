"""The Tinker-compatible API without a worker: the official SDK's client set-up, sessions and training
sessions as rows, futures that wait, tenancy, and bad input. Requests that need a model stay pending here; the
worker's side is tests/e2e/test_tinker_sessions.py."""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import tinker
from tinker import types

from api.notify import DONE_CHANNEL
from tests.integration.conftest import Tenant, serve
from tests.integration.sql_statements import page_queries, recorded, writes
from tests.integration.test_notify import backends_listening
from tests.waiting import wait_until

POLL_S = 0.5


@pytest.fixture(scope="module")
def tinker_url(settings: Any) -> Iterator[str]:
    """The app with short polls (a pending future answers 'try again' after half a second)."""
    from api.app import create_app

    with serve(create_app(settings.model_copy(update={"session_poll_s": POLL_S}))) as url:
        yield url


def raw(url: str, key: str) -> httpx.Client:
    return httpx.Client(base_url=f"{url}/api/v1", headers={"X-API-Key": f"tml-{key}"}, timeout=30)


def service_client(url: str, tenant: Tenant) -> tinker.ServiceClient:
    return tinker.ServiceClient(base_url=url, api_key=f"tml-{tenant.key}")


def rest_client(url: str, tenant: Tenant) -> tinker.RestClient:
    return tinker.RestClient(base_url=url, api_key=f"tml-{tenant.key}")


def new_session(client: httpx.Client) -> str:
    r = client.post("/create_session", json={"tags": [], "user_metadata": {}, "sdk_version": "0.38.0"})
    assert r.status_code == 200, r.text
    return str(r.json()["session_id"])


def create_model(client: httpx.Client, session_id: str, seq: int = 0, **body: Any) -> httpx.Response:
    payload = {
        "session_id": session_id,
        "model_seq_id": seq,
        "base_model": "tiny-arith",
        "lora_config": {"rank": 8},
        "type": "create_model",
    } | body
    return client.post("/create_model", json=payload)


def forward_backward_body(model_id: str, seq_id: int) -> bytes:
    """A forward_backward body exactly as the SDK writes it."""
    from tinker.proto.request_conv import forward_backward_request_to_proto  # type: ignore[attr-defined]

    datum = types.Datum(
        model_input=types.ModelInput.from_ints([5, 6, 7]),
        loss_fn_inputs={"target_tokens": [6, 7, 1], "weights": [0.0, 1.0, 1.0]},
    )
    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=[datum], loss_fn="cross_entropy"),
        model_id=model_id,
        seq_id=seq_id,
    )
    return bytes(forward_backward_request_to_proto(request).SerializeToString())


class TestClientSetUp:
    def test_the_official_sdk_creates_a_training_client_whose_model_id_it_derives_itself(
        self, tinker_url: str, tenant_a: Tenant
    ) -> None:
        client = service_client(tinker_url, tenant_a)
        training = client.create_lora_training_client(base_model="tiny-arith", rank=8).result()
        info = training.get_info()
        session_id = training.model_id.split(":train:")[0]
        assert training.model_id == f"{session_id}:train:0"
        assert info.model_data.model_name == "tiny-arith" and info.lora_rank == 8
        capabilities = client.create_rest_client().get_server_capabilities().result()
        assert [m.model_name for m in capabilities.supported_models] == ["tiny-arith"]

    def test_a_base_model_not_offered_is_a_400_naming_it(self, tinker_url: str, tenant_a: Tenant) -> None:
        client = service_client(tinker_url, tenant_a)
        with pytest.raises(tinker.BadRequestError, match="base_model: 'gpt-9' is not offered"):
            client.create_lora_training_client(base_model="gpt-9", rank=8).result()

    def test_a_wrong_key_is_a_401_and_a_key_without_the_prefix_too(self, tinker_url: str, tenant_a: Tenant) -> None:
        with raw(tinker_url, "sk-prx-wrong") as client:
            assert client.post("/client/config", json={"sdk_version": "0.38.0"}).status_code == 401
        with httpx.Client(base_url=f"{tinker_url}/api/v1", headers={"X-API-Key": tenant_a.key}) as client:
            assert client.post("/create_session", json={}).status_code == 401
        with httpx.Client(base_url=f"{tinker_url}/api/v1") as client:
            assert client.post("/create_session", json={}).status_code == 401

    def test_a_heartbeat_keeps_a_session_and_a_finished_one_answers_410(
        self, tinker_url: str, tenant_a: Tenant
    ) -> None:
        with raw(tinker_url, tenant_a.key) as client:
            sid = new_session(client)
            assert client.post("/session_heartbeat", json={"session_id": sid}).status_code == 200
            assert client.post(f"/sessions/{sid}/finish", json={"reason": {"type": "success"}}).status_code == 200
            assert client.post("/session_heartbeat", json={"session_id": sid}).status_code == 410


class TestTenancy:
    def test_another_tenants_session_model_and_futures_answer_404(
        self, tinker_url: str, tenant_a: Tenant, tenant_b: Tenant
    ) -> None:
        with raw(tinker_url, tenant_a.key) as a, raw(tinker_url, tenant_b.key) as b:
            sid = new_session(a)
            created = create_model(a, sid).json()
            model_id, request_id = created["model_id"], created["request_id"]
            assert b.post("/get_info", json={"model_id": model_id}).status_code == 404
            assert b.post("/retrieve_future", json={"request_id": request_id}).status_code == 404
            assert b.post("/session_heartbeat", json={"session_id": sid}).status_code == 404
            assert create_model(b, sid, seq=1).status_code == 404
            r = b.post("/forward_backward", content=forward_backward_body(model_id, 1))
            assert r.status_code == 404
            assert b.get(f"/training_runs/{model_id}").status_code == 404
            assert a.get(f"/training_runs/{model_id}").status_code == 200
        with pytest.raises(tinker.NotFoundError):
            service_client(tinker_url, tenant_b).create_rest_client().get_training_run(model_id).result()


class TestFutures:
    def test_a_future_without_a_worker_is_held_then_answered_408_try_again(
        self, tinker_url: str, tenant_a: Tenant
    ) -> None:
        with raw(tinker_url, tenant_a.key) as client:
            model_id = create_model(client, new_session(client)).json()["model_id"]
            future = client.post("/forward_backward", content=forward_backward_body(model_id, 1)).json()
            start = time.monotonic()
            r = client.post("/retrieve_future", json={"request_id": future["request_id"]})
            assert r.status_code == 408 and r.json()["type"] == "try_again"
            assert time.monotonic() - start >= POLL_S * 0.9

    @pytest.mark.alone  # the answer's latency is the evidence of the wake-up
    def test_a_held_poll_is_woken_by_the_workers_notification_not_by_its_fallback_poll(
        self, settings: Any, tenant_a: Tenant, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """A request finished (as a worker finishes it: ``repo.finish_request`` and a commit) while its poll is held
        is answered at once: the fallback re-read comes only after 60 s here, and the poll is held up to 30 s."""
        import threading

        from api.app import create_app
        from api.db import session_scope
        from api.repositories import tinker as repo
        from api.routes import tinker as routes

        monkeypatch.setattr(routes, "NOTIFIED_POLL_S", 60.0)
        app = create_app(settings.model_copy(update={"session_poll_s": 30.0}))
        listening = len(backends_listening(settings.db_url, DONE_CHANNEL))
        with serve(app) as url, raw(url, tenant_a.key) as client:
            wait_until(lambda: len(backends_listening(settings.db_url, DONE_CHANNEL)) > listening, "the app's listener")
            model_id = create_model(client, new_session(client)).json()["model_id"]
            future = client.post("/forward_backward", content=forward_backward_body(model_id, 1)).json()
            answer: dict[str, Any] = {}
            read, read_only = threading.Event(), routes.read_only

            async def reading(url: str, fn: Any, /, **kwargs: Any) -> Any:
                row = await read_only(url, fn, **kwargs)
                if kwargs.get("request_id") == future["request_id"]:
                    read.set()
                return row

            monkeypatch.setattr(routes, "read_only", reading)

            def poll() -> None:
                r = client.post("/retrieve_future", json={"request_id": future["request_id"]})
                answer.update(status=r.status_code, body=r.json(), at=time.monotonic())

            poller = threading.Thread(target=poll)
            poller.start()
            wait_until(read.is_set, "the poll to read the pending row", timeout=10)  # it waits from then on
            assert poller.is_alive()
            with session_scope(settings.db_url) as s:
                repo.finish_request(
                    s,
                    request_id=future["request_id"],
                    result=None,
                    result_format=None,
                    error={"error": "the worker says no", "category": "user"},
                )
            finished = time.monotonic()
            poller.join(timeout=25)
        assert answer["status"] == 200, answer
        assert answer["body"] == {"error": "the worker says no", "category": "user"}
        assert answer["at"] - finished < 10  # woken, not the 60 s re-read nor the 30 s hold

    def test_a_resent_request_is_the_same_request(self, tinker_url: str, tenant_a: Tenant) -> None:
        with raw(tinker_url, tenant_a.key) as client:
            model_id = create_model(client, new_session(client)).json()["model_id"]
            body = forward_backward_body(model_id, 1)
            first, second = (client.post("/forward_backward", content=body).json() for _ in range(2))
            assert first["request_id"] == second["request_id"]
            step = {"model_id": model_id, "seq_id": 2, "adam_params": {"learning_rate": 1e-3}}
            assert client.post("/optim_step", json=step).json() == client.post("/optim_step", json=step).json()

    def test_create_model_completes_at_once_and_unknown_futures_are_404(
        self, tinker_url: str, tenant_a: Tenant
    ) -> None:
        with raw(tinker_url, tenant_a.key) as client:
            created = create_model(client, new_session(client)).json()
            r = client.post("/retrieve_future", json={"request_id": created["request_id"]})
            assert r.status_code == 200 and r.json() == {"model_id": created["model_id"], "type": "create_model"}
            assert client.post("/retrieve_future", json={"request_id": "req-nope"}).status_code == 404


class TestBadInput:
    @pytest.mark.parametrize(
        ("path", "body", "param"),
        [
            ("/create_model", {"model_seq_id": 0, "base_model": "tiny-arith"}, "session_id"),
            ("/optim_step", {"model_id": "x"}, "seq_id"),
            ("/asample", {"sampling_session_id": "x", "seq_id": 0}, "prompt"),
            ("/save_weights", {"model_id": "x"}, "seq_id"),
            ("/retrieve_future", {}, "request_id"),
        ],
    )
    def test_a_missing_field_is_a_400_naming_it(
        self, tinker_url: str, tenant_a: Tenant, path: str, body: dict[str, Any], param: str
    ) -> None:
        with raw(tinker_url, tenant_a.key) as client:
            r = client.post(path, json=body)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == param

    def test_a_body_that_is_not_a_protobuf_is_a_400(self, tinker_url: str, tenant_a: Tenant) -> None:
        with raw(tinker_url, tenant_a.key) as client:
            r = client.post("/forward_backward", content=b"\xff\xff\xff not a protobuf")
        assert r.status_code == 400, r.text

    def test_a_bad_checkpoint_name_and_path_are_400s(self, tinker_url: str, tenant_a: Tenant) -> None:
        with raw(tinker_url, tenant_a.key) as client:
            sid = new_session(client)
            model_id = create_model(client, sid).json()["model_id"]
            r = client.post("/save_weights", json={"model_id": model_id, "seq_id": 1, "path": "a/b"})
            assert r.status_code == 400 and r.json()["error"]["param"] == "path"
            r = client.post("/load_weights", json={"model_id": model_id, "seq_id": 1, "path": "s3://x"})
            assert r.status_code == 400 and "tinker://" in r.json()["error"]["message"]
            r = client.post(
                "/create_sampling_session",
                json={"session_id": sid, "sampling_session_seq_id": 0, "model_path": f"tinker://{model_id}/weights/x"},
            )
            assert r.status_code == 400

    def test_a_forward_backward_bigger_than_the_json_limit_is_accepted(self, tinker_url: str, tenant_a: Tenant) -> None:
        """The SDK sends up to ~5 MB per forward_backward: the Tinker routes have their own body limit."""
        from tinker.proto.request_conv import forward_backward_request_to_proto  # type: ignore[attr-defined]

        with raw(tinker_url, tenant_a.key) as client:
            model_id = create_model(client, new_session(client)).json()["model_id"]
            n = 2000
            datum = types.Datum(
                model_input=types.ModelInput.from_ints([5] * n),
                loss_fn_inputs={"target_tokens": [6] * n, "weights": [1.0] * n},
            )
            request = types.ForwardBackwardRequest(
                forward_backward_input=types.ForwardBackwardInput(data=[datum] * 40, loss_fn="cross_entropy"),
                model_id=model_id,
                seq_id=1,
            )
            body = bytes(forward_backward_request_to_proto(request).SerializeToString())
            assert len(body) > 1024 * 1024
            r = client.post("/forward_backward", content=body)
        assert r.status_code == 200, r.text
        assert json.loads(r.text)["model_id"] == model_id


# -- the SDK's REST side: listings page in SQL, GETs write nothing --------------------------------------------------


def record_checkpoint(
    settings: Any, tenant_id: str, run_id: str, kind: str, name: str, *, files: dict[str, bytes] | None = None
) -> str:
    """A checkpoint as the worker records one after saving it (``repo.record_checkpoint``), its files in the store;
    its ``tinker://`` path."""
    from api.db import session_scope
    from api.repositories import tinker as repo
    from api.storage import store_from_url

    key = f"tinker/{tenant_id}/{run_id.replace(':', '-')}/{kind}/{name}"
    store = store_from_url(settings.artifacts_url)
    for filename, data in (files or {"adapter_model.safetensors": b"weights"}).items():
        store.put_bytes(f"{key}/{filename}", data)
    with session_scope(settings.db_url) as s:
        repo.record_checkpoint(
            s,
            tenant_id=tenant_id,
            session_id=run_id,
            kind=kind,
            name=name,
            storage_key=key,
            size_bytes=7,
            optimizer_steps=1,
            ttl_seconds=None,
        )
    return f"tinker://{run_id}/{kind}/{name}"


def tenant_rows(settings: Any, tenant_id: str) -> list[tuple[Any, ...]]:
    """Every row of the tenant's Tinker tables, column by column, in a fixed order."""
    from sqlalchemy import select

    from api.db import session_scope
    from api.orm import Sampler, SessionCheckpoint, SessionRequest, TinkerClientSession, TrainingSession

    out: list[tuple[Any, ...]] = []
    with session_scope(settings.db_url) as s:
        for table in (TinkerClientSession, TrainingSession, Sampler, SessionCheckpoint, SessionRequest):
            columns = list(table.__table__.columns)
            stmt = select(*columns).where(table.tenant_id == tenant_id).order_by(*table.__table__.primary_key)
            out += [(table.__tablename__, *row) for row in s.execute(stmt).all()]
    return out


@pytest.fixture
def fresh_tenant(settings: Any) -> Tenant:
    """A tenant of its own, so that what other tests made cannot change what is listed."""
    from tests.integration.conftest import make_tenant

    return make_tenant(settings, f"tinker-rest-{secrets.token_hex(4)}")


def training_runs(client: httpx.Client, session_id: str, n: int) -> list[str]:
    return [create_model(client, session_id, seq=i).json()["model_id"] for i in range(n)]


class TestTrainingRunsList:
    def test_pages_by_offset_with_each_runs_latest_checkpoints_and_the_total(
        self, tinker_url: str, settings: Any, fresh_tenant: Tenant
    ) -> None:
        with raw(tinker_url, fresh_tenant.key) as client:
            runs = training_runs(client, new_session(client), 5)
        for run in runs:
            for kind, name in (("weights", "a"), ("sampler_weights", "s"), ("weights", "b")):
                record_checkpoint(settings, fresh_tenant.id, run, kind, name)
        rest = rest_client(tinker_url, fresh_tenant)
        everything = rest.list_training_runs(limit=100).result()
        assert sorted(r.training_run_id for r in everything.training_runs) == sorted(runs)
        assert (everything.cursor.offset, everything.cursor.limit, everything.cursor.total_count) == (0, 100, 5)
        pages = [rest.list_training_runs(limit=2, offset=offset).result() for offset in (0, 2, 4)]
        assert [r.training_run_id for p in pages for r in p.training_runs] == [
            r.training_run_id for r in everything.training_runs
        ]
        assert [p.cursor.total_count for p in pages] == [5, 5, 5]
        for listed in everything.training_runs:
            assert listed.last_checkpoint is not None and listed.last_sampler_checkpoint is not None
            assert listed.last_checkpoint.tinker_path == f"tinker://{listed.training_run_id}/weights/b"
            assert listed.last_sampler_checkpoint.checkpoint_id == "sampler_weights/s"
            assert listed.lora_rank == 8 and listed.model_owner == fresh_tenant.id
        one = rest.get_training_run(runs[0]).result()
        assert one.last_checkpoint is not None and one.last_checkpoint.checkpoint_id == "weights/b"

    def test_a_page_costs_the_same_few_queries_whatever_its_size(
        self, tinker_url: str, settings: Any, fresh_tenant: Tenant
    ) -> None:
        with raw(tinker_url, fresh_tenant.key) as client:
            for run in training_runs(client, new_session(client), 6):
                record_checkpoint(settings, fresh_tenant.id, run, "weights", "a")
                record_checkpoint(settings, fresh_tenant.id, run, "sampler_weights", "s")
            small = page_queries(settings.db_url, client, "/training_runs", limit=1)
            large = page_queries(settings.db_url, client, "/training_runs", limit=6)
        assert small == large <= 4  # the page, the total, the latest checkpoints (and the key, when not cached)


class TestCheckpointsList:
    def test_lists_the_tenants_checkpoints_newest_first_by_offset_in_a_fixed_number_of_queries(
        self, tinker_url: str, settings: Any, fresh_tenant: Tenant
    ) -> None:
        with raw(tinker_url, fresh_tenant.key) as client:
            runs = training_runs(client, new_session(client), 2)
            made = [
                record_checkpoint(settings, fresh_tenant.id, run, "weights", f"c{i}") for i in range(3) for run in runs
            ]
            small = page_queries(settings.db_url, client, "/checkpoints", limit=1)
            large = page_queries(settings.db_url, client, "/checkpoints", limit=6)
        assert small == large <= 2
        rest = rest_client(tinker_url, fresh_tenant)
        pages = [rest.list_user_checkpoints(limit=4, offset=offset).result() for offset in (0, 4)]
        assert [c.tinker_path for p in pages for c in p.checkpoints] == made[::-1]
        assert [c.tinker_path for c in rest.list_checkpoints(runs[0]).result().checkpoints] == made[0::2]


class TestClientSessions:
    def test_a_session_names_its_training_runs_and_samplers_and_the_list_names_the_sessions(
        self, tinker_url: str, fresh_tenant: Tenant
    ) -> None:
        with raw(tinker_url, fresh_tenant.key) as client:
            sid = new_session(client)
            runs = training_runs(client, sid, 2)
            body = {"session_id": sid, "sampling_session_seq_id": 0, "base_model": "tiny-arith"}
            sampler = client.post("/create_sampling_session", json=body).json()["sampling_session_id"]
            assert client.get("/sessions").json() == {"sessions": [sid]}
        rest = rest_client(tinker_url, fresh_tenant)
        info = rest.get_session(sid).result()
        assert (sorted(info.training_run_ids), info.sampler_ids) == (sorted(runs), [sampler])
        assert rest.get_sampler(sampler).result().base_model == "tiny-arith"


class TestGetsWriteNothing:
    def test_every_get_leaves_the_rows_as_they_were_and_sends_no_write(
        self, tinker_url: str, settings: Any, fresh_tenant: Tenant
    ) -> None:
        with raw(tinker_url, fresh_tenant.key) as client:
            sid = new_session(client)
            [run] = training_runs(client, sid, 1)
            body = {"session_id": sid, "sampling_session_seq_id": 0, "base_model": "tiny-arith"}
            sampler = client.post("/create_sampling_session", json=body).json()["sampling_session_id"]
            record_checkpoint(settings, fresh_tenant.id, run, "weights", "w")
            files = {"adapter_config.json": b"{}", "adapter_model.safetensors": b"\x00" * 64}
            record_checkpoint(settings, fresh_tenant.id, run, "external_weights", "export", files=files)
            before = tenant_rows(settings, fresh_tenant.id)
            gets = [
                "/training_runs",
                f"/training_runs/{run}",
                f"/training_runs/{run}/checkpoints",
                "/checkpoints",
                "/sessions",
                f"/sessions/{sid}",
                f"/samplers/{sampler}",
                f"/training_runs/{run}/checkpoints/external_weights/export/external_weights_urls",
            ]
            with recorded(settings.db_url) as seen:
                answers = [client.get(path) for path in gets]
                again = client.get(gets[-1])
                downloads = {name: httpx.get(url).content for name, url in again.json()["urls"].items()}
        assert [r.status_code for r in answers] == [200] * len(gets)
        # The SDK clients of other tests keep heartbeating their own sessions meanwhile: those are POSTs.
        assert [w for w in writes(seen) if "last_heartbeat_at" not in w] == []
        assert tenant_rows(settings, fresh_tenant.id) == before
        assert answers[-1].json() == again.json()  # the same links, made with the export
        assert downloads == files

    def test_an_export_is_downloadable_from_its_links_until_it_expires(
        self, tinker_url: str, settings: Any, fresh_tenant: Tenant, db: Any
    ) -> None:
        from api.orm import SessionCheckpoint

        with raw(tinker_url, fresh_tenant.key) as client:
            [run] = training_runs(client, new_session(client), 1)
            path = record_checkpoint(settings, fresh_tenant.id, run, "external_weights", "export")
        urls = rest_client(tinker_url, fresh_tenant).get_external_weights_urls(path)
        [url] = urls.result().urls.values()
        assert httpx.get(url).content == b"weights"
        assert httpx.get(url.rsplit("/", 1)[0] + "/.hidden").status_code == 404
        with db() as s:
            s.query(SessionCheckpoint).filter_by(session_id=run).update({"expires_at": int(time.time()) - 1})
        assert httpx.get(url).status_code == 404


class TestCheckpointEdits:
    def test_a_checkpoint_gets_a_ttl_and_is_deleted_with_its_bytes(
        self, tinker_url: str, settings: Any, fresh_tenant: Tenant, artifact_store: Any
    ) -> None:
        with raw(tinker_url, fresh_tenant.key) as client:
            [run] = training_runs(client, new_session(client), 1)
            path = record_checkpoint(settings, fresh_tenant.id, run, "weights", "w")
            r = client.put(f"/training_runs/{run}/checkpoints/weights/w/ttl", json={"ttl_seconds": 3600})
            assert (r.status_code, r.json()) == (200, {})
            [listed] = client.get(f"/training_runs/{run}/checkpoints").json()["checkpoints"]
            assert listed["expires_at"] is not None
            r = client.delete(f"/training_runs/{run}/checkpoints/weights/w")
            assert (r.status_code, r.json()) == (200, {})
            assert client.delete(f"/training_runs/{run}/checkpoints/weights/w").status_code == 404
            assert client.put(f"/training_runs/{run}/checkpoints/weights/w/ttl", json={}).status_code == 404
        prefix = path.removeprefix("tinker://").replace(":", "-").split("/")[0]
        assert artifact_store.list(f"tinker/{fresh_tenant.id}/{prefix}") == []
