"""OpenAI's Evals API through the official client against the real app and PostgreSQL: evals (create, retrieve, list,
update, delete), runs (create, list, retrieve, cancel, delete) and output items; tenancy (another tenant's eval, run or
item is a 404), 401 without a key, and 400s naming the parameter for bad criteria and data sources.

The worker's part is run in-process with ``worker.evals.run_eval`` (no Celery): a ``jsonl`` run graded by a
string_check and a python criterion gives counts and items computed by hand below, and an attempt that takes over from
a dead worker goes on after the items already written.
"""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any, cast

import httpx
import openai
import pytest
from openai import OpenAI
from sqlalchemy import select
from sqlalchemy import update as sa_update

from api.orm import EvalOutputItem, EvalRun, WebhookDelivery, WebhookEvent
from api.repositories import evals as evals_repo
from api.status import EvalRunStatus
from tests.integration.conftest import Tenant, assert_error, make_tenant

ITEM_SCHEMA = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}
EXACT = {
    "type": "string_check",
    "name": "exact",
    "input": "{{sample.output_text}}",
    "reference": "{{item.answer}}",
    "operation": "eq",
}
LENGTH = {  # a tenth of the output's length; raises for an item marked "boom"
    "type": "python",
    "name": "length",
    "source": "def grade(sample, item):\n"
    "    if item.get('boom'):\n"
    "        raise ValueError('boom')\n"
    "    return len(sample['output_text']) / 10\n",
    "pass_threshold": 0.2,
}
# (answer, output): exact passes when they are equal; length passes from 2 characters on; row 4 errors in `length`.
ROWS: list[dict[str, Any]] = [
    {"item": {"answer": "4"}, "sample": {"output_text": "4"}},  # exact pass, length 0.1 fail -> fail
    {"item": {"answer": "10"}, "sample": {"output_text": "10"}},  # pass, 0.2 pass -> pass
    {"item": {"answer": "7"}, "sample": {"output_text": "8"}},  # fail, 0.1 fail -> fail
    {"item": {"answer": "123"}, "sample": {"output_text": "123"}},  # pass, 0.3 pass -> pass
    {"item": {"answer": "5", "boom": True}, "sample": {"output_text": "5"}},  # pass, raises -> errored
]


@pytest.fixture
def client(base_url: str, tenant_a: Tenant) -> OpenAI:
    return OpenAI(api_key=tenant_a.key, base_url=f"{base_url}/v1", max_retries=0)


@pytest.fixture
def other(base_url: str, tenant_b: Tenant) -> OpenAI:
    return OpenAI(api_key=tenant_b.key, base_url=f"{base_url}/v1", max_retries=0)


def make_eval(client: OpenAI, **overrides: Any) -> Any:
    body: dict[str, Any] = {
        "name": "arith",
        "data_source_config": {"type": "custom", "item_schema": ITEM_SCHEMA, "include_sample_schema": True},
        "testing_criteria": [EXACT, LENGTH],
        "metadata": {"team": "a"},
    } | overrides
    return client.evals.create(**body)


def jsonl_run(client: OpenAI, eval_id: str, rows: list[dict[str, Any]] = ROWS) -> Any:
    data_source: Any = {"type": "jsonl", "source": {"type": "file_content", "content": rows}}
    return client.evals.runs.create(eval_id, name="inline", data_source=data_source)


class TestCreateEval:
    def test_an_eval_is_answered_in_openais_shape_and_retrieved_the_same(self, client: OpenAI) -> None:
        ev = make_eval(client)
        assert ev.id.startswith("eval_") and ev.object == "eval" and ev.name == "arith"
        assert ev.metadata == {"team": "a"}
        schema = ev.data_source_config.schema_
        assert ev.data_source_config.type == "custom" and schema["required"] == ["item", "sample"]
        assert schema["properties"]["item"] == ITEM_SCHEMA
        exact, length = (c.to_dict() for c in ev.testing_criteria)
        assert exact == EXACT  # a string_check passes on a score of 1: no threshold
        assert (length["type"], length["pass_threshold"], length["source"]) == ("python", 0.2, LENGTH["source"])
        assert client.evals.retrieve(ev.id).to_dict() == ev.to_dict()

    def test_without_a_key_it_is_a_401(self, anon: httpx.Client) -> None:
        assert_error(anon.post("/v1/evals", json={}), 401)
        assert_error(anon.get("/v1/evals"), 401)

    @pytest.mark.parametrize(
        ("config", "param"),
        [
            ({"type": "stored_completions"}, "data_source_config.type"),
            ({"type": "logs", "metadata": {}}, "data_source_config.type"),
            ({"type": "custom"}, "data_source_config.item_schema"),
            ({"type": "custom", "item_schema": {"type": "nope"}}, "data_source_config.item_schema"),
            ({"type": "custom", "item_schema": {}, "extra": 1}, "data_source_config.extra"),
            # valid schemas that no item can be checked by: never fetched, never recursed into without end
            (
                {"type": "custom", "item_schema": {"$ref": "https://93.184.216.34/s.json"}},
                "data_source_config.item_schema",
            ),
            ({"type": "custom", "item_schema": {"$ref": "#/$defs/nowhere"}}, "data_source_config.item_schema"),
            ({"type": "custom", "item_schema": {"$ref": "#"}}, "data_source_config.item_schema"),
        ],
    )
    def test_a_bad_data_source_config_is_a_400_naming_it(
        self, api: httpx.Client, config: dict[str, Any], param: str
    ) -> None:
        body = {"data_source_config": config, "testing_criteria": [EXACT]}
        assert_error(api.post("/v1/evals", json=body), 400, param=param)

    @pytest.mark.parametrize(
        ("criteria", "param"),
        [
            ([{k: v for k, v in EXACT.items() if k != "reference"}], "testing_criteria[0].reference"),
            ([EXACT, {**LENGTH, "source": "def nope(:\n"}], "testing_criteria[1].source"),
            ([EXACT, {**LENGTH, "source": "def other(sample, item):\n    return 1\n"}], "testing_criteria[1].source"),
            ([{**EXACT, "pass_threshold": 0.5}], "testing_criteria[0].pass_threshold"),
            ([{**EXACT, "type": "text_similarity", "evaluation_metric": "fuzzy_match"}], None),
            ([EXACT, {**EXACT, "operation": "ne"}], "testing_criteria[1].name"),
            ([{"type": "reward_model", "name": "rm", "model": "ftjob-x"}], None),
            ([{**LENGTH, "pass_threshold": "high"}], "testing_criteria[0].pass_threshold"),
            ([{**EXACT, "type": ["string_check"]}], "testing_criteria[0].type"),
            ([EXACT, {**LENGTH, "type": {"python": True}}], "testing_criteria[1].type"),
        ],
    )
    def test_a_bad_criterion_is_a_400_naming_it(
        self, api: httpx.Client, criteria: list[dict[str, Any]], param: str | None
    ) -> None:
        body = {"data_source_config": {"type": "custom", "item_schema": ITEM_SCHEMA}, "testing_criteria": criteria}
        error = assert_error(api.post("/v1/evals", json=body), 400)
        assert error["param"] is not None and error["param"].startswith("testing_criteria[")
        if param is not None:
            assert error["param"] == param, error

    def test_text_similarity_needs_its_pass_threshold(self, api: httpx.Client) -> None:
        criterion = {**EXACT, "type": "text_similarity", "evaluation_metric": "fuzzy_match"}
        criterion.pop("operation")
        body = {"data_source_config": {"type": "custom", "item_schema": {}}, "testing_criteria": [criterion]}
        assert_error(api.post("/v1/evals", json=body), 400, param="testing_criteria[0].pass_threshold")
        r = api.post("/v1/evals", json={**body, "testing_criteria": [{**criterion, "pass_threshold": 0.8}]})
        assert r.status_code == 200 and r.json()["testing_criteria"][0]["pass_threshold"] == 0.8


class TestListUpdateDelete:
    def test_list_pages_by_cursor_in_either_order(self, base_url: str, settings: Any) -> None:
        fresh = OpenAI(api_key=make_tenant(settings, f"lister-{time.time_ns()}").key, base_url=f"{base_url}/v1")
        made = [make_eval(fresh, name=f"e{i}") for i in range(3)]
        ids = [e.id for e in sorted(made, key=lambda e: (e.created_at, e.id))]  # within a second: by id
        first = fresh.evals.list(limit=2)
        assert [e.id for e in first.data] == ids[:2] and first.has_more
        assert [e.id for e in fresh.evals.list(limit=2)] == ids  # the client follows the cursor
        assert [e.id for e in fresh.evals.list(order="desc")] == ids[::-1]

    def test_update_sets_the_name_and_the_metadata(self, client: OpenAI) -> None:
        ev = make_eval(client)
        updated = client.evals.update(ev.id, name="renamed", metadata={"k": "v"})
        assert (updated.name, updated.metadata) == ("renamed", {"k": "v"})
        assert client.evals.retrieve(ev.id).name == "renamed"

    def test_delete_removes_the_eval_and_its_runs(self, client: OpenAI) -> None:
        ev = make_eval(client)
        run = jsonl_run(client, ev.id)
        deleted = client.evals.delete(ev.id)
        assert (deleted.eval_id, deleted.deleted, deleted.object) == (ev.id, True, "eval.deleted")
        with pytest.raises(openai.NotFoundError):
            client.evals.retrieve(ev.id)
        with pytest.raises(openai.NotFoundError):
            client.evals.runs.retrieve(run.id, eval_id=ev.id)

    def test_another_tenants_eval_run_and_item_are_404(self, client: OpenAI, other: OpenAI, settings: Any) -> None:
        from worker.evals import run_eval

        ev = make_eval(client)
        run = jsonl_run(client, ev.id)
        assert run_eval(run.id, settings=settings, worker_id="w-tenancy") == "completed"
        item = client.evals.runs.output_items.list(run.id, eval_id=ev.id).data[0]
        calls = [
            lambda: other.evals.retrieve(ev.id),
            lambda: other.evals.update(ev.id, name="x"),
            lambda: other.evals.delete(ev.id),
            lambda: other.evals.runs.create(ev.id, data_source=cast(Any, {"type": "jsonl", "source": {}})),
            lambda: other.evals.runs.list(ev.id),
            lambda: other.evals.runs.retrieve(run.id, eval_id=ev.id),
            lambda: other.evals.runs.cancel(run.id, eval_id=ev.id),
            lambda: other.evals.runs.delete(run.id, eval_id=ev.id),
            lambda: other.evals.runs.output_items.list(run.id, eval_id=ev.id),
            lambda: other.evals.runs.output_items.retrieve(item.id, eval_id=ev.id, run_id=run.id),
        ]
        for call in calls:
            with pytest.raises(openai.NotFoundError):
                call()
        assert ev.id not in [e.id for e in other.evals.list()]
        assert client.evals.retrieve(ev.id).name == "arith"  # untouched


class TestRuns:
    def test_a_run_is_queued_listed_canceled_once_and_deleted(self, client: OpenAI, base_url: str) -> None:
        ev = make_eval(client)
        run = jsonl_run(client, ev.id)
        assert run.id.startswith("evalrun_") and (run.object, run.status, run.eval_id) == ("eval.run", "queued", ev.id)
        assert run.result_counts.total == 0 and run.per_model_usage is None
        assert run.report_url == f"{base_url}/dashboard/#/evals/{ev.id}/runs/{run.id}"  # absolute, as OpenAI's
        assert run.data_source.to_dict()["source"]["content"][0]["item"] == {"answer": "4"}
        assert [r.id for r in client.evals.runs.list(ev.id, status="queued")] == [run.id]
        assert client.evals.runs.cancel(run.id, eval_id=ev.id).status == "canceled"
        with pytest.raises(openai.ConflictError):
            client.evals.runs.cancel(run.id, eval_id=ev.id)
        assert [r.id for r in client.evals.runs.list(ev.id, status="canceled")] == [run.id]
        deleted = client.evals.runs.delete(run.id, eval_id=ev.id)
        assert (deleted.run_id, deleted.deleted) == (run.id, True)
        assert client.evals.runs.list(ev.id).data == []

    @pytest.mark.parametrize(
        ("data_source", "param"),
        [
            ({"type": "responses", "source": {"type": "responses"}}, "data_source.type"),
            ({"type": "jsonl", "source": {"type": "stored_completions"}}, "data_source.source.type"),
            ({"type": "jsonl", "source": {"type": "file_id", "id": "file-nope"}}, "data_source.source.id"),
            ({"type": "jsonl", "source": {"type": "file_content", "content": []}}, "data_source.source.content"),
            (
                {"type": "jsonl", "source": {"type": "file_content", "content": [ROWS[0], {"item": {"answer": 3}}]}},
                "data_source.source.content[1].item",
            ),
            (
                {
                    "type": "completions",
                    "source": {"type": "file_content", "content": [ROWS[0]]},
                    "input_messages": {"type": "template", "template": [{"role": "user", "content": "{{itm.q}}"}]},
                    "model": "tiny-arith",
                },
                "data_source.input_messages.template[0].content",
            ),
            (
                {
                    "type": "completions",
                    "source": {"type": "file_content", "content": [ROWS[0]]},
                    "input_messages": {"type": "item_reference", "item_reference": "messages"},
                    "model": "tiny-arith",
                },
                "data_source.input_messages.item_reference",
            ),
            (
                {
                    "type": "completions",
                    "source": {"type": "file_content", "content": [ROWS[0]]},
                    "input_messages": {"type": "template", "template": [{"role": "user", "content": "hi"}]},
                    "model": "gpt-4o",
                },
                "data_source.model",
            ),
            (
                {
                    "type": "completions",
                    "source": {"type": "file_content", "content": [ROWS[0]]},
                    "input_messages": {"type": "template", "template": [{"role": "user", "content": "hi"}]},
                    "model": "tiny-arith",
                    "sampling_params": {"temperature": 9},
                },
                "data_source.sampling_params.temperature",
            ),
        ],
    )
    def test_a_bad_data_source_is_a_400_naming_it(
        self, client: OpenAI, api: httpx.Client, data_source: dict[str, Any], param: str
    ) -> None:
        ev = make_eval(client)
        assert_error(api.post(f"/v1/evals/{ev.id}/runs", json={"data_source": data_source}), 400, param=param)

    def test_another_tenants_file_is_no_such_file(self, client: OpenAI, other: OpenAI) -> None:
        theirs = other.files.create(file=("rows.jsonl", b'{"item": {"answer": "1"}}\n'), purpose="fine-tune")
        ev = make_eval(client)
        data_source: Any = {"type": "jsonl", "source": {"type": "file_id", "id": theirs.id}}
        with pytest.raises(openai.BadRequestError) as err:
            client.evals.runs.create(ev.id, data_source=data_source)
        assert err.value.param == "data_source.source.id"


class TestGrading:
    def test_a_jsonl_run_counts_and_items_are_exactly_the_hand_computed_ones(
        self, client: OpenAI, settings: Any
    ) -> None:
        from worker.evals import run_eval

        ev = make_eval(client)
        run = jsonl_run(client, ev.id)
        assert run_eval(run.id, settings=settings, worker_id="w-grading") == "completed"
        done = client.evals.runs.retrieve(run.id, eval_id=ev.id)
        assert done.status == "completed" and done.error is None and done.per_model_usage is None
        assert done.result_counts.to_dict() == {"total": 5, "errored": 1, "failed": 2, "passed": 2}
        assert [r.to_dict() for r in done.per_testing_criteria_results] == [
            {"testing_criteria": "exact", "passed": 4, "failed": 1},
            {"testing_criteria": "length", "passed": 2, "failed": 2},
        ]
        items = list(client.evals.runs.output_items.list(run.id, eval_id=ev.id, limit=2))  # followed by cursor
        assert [i.datasource_item_id for i in items] == [0, 1, 2, 3, 4]
        assert [i.status for i in items] == ["fail", "pass", "fail", "pass", "fail"]
        scores = [[(r.name, r.score, r.passed) for r in i.results] for i in items]
        assert scores[:4] == [
            [("exact", 1.0, True), ("length", 0.1, False)],
            [("exact", 1.0, True), ("length", 0.2, True)],
            [("exact", 0.0, False), ("length", 0.1, False)],
            [("exact", 1.0, True), ("length", 0.3, True)],
        ]
        boom = items[4].results[1].to_dict()
        assert (boom["score"], boom["passed"], boom["errored"]) == (0.0, False, True)
        assert "boom" in boom["errors"][0]
        assert items[1].datasource_item == {"answer": "10"} and items[1].sample.to_dict() == {"output_text": "10"}
        passing = client.evals.runs.output_items.list(run.id, eval_id=ev.id, status="pass")
        assert [i.datasource_item_id for i in passing] == [1, 3]
        one = client.evals.runs.output_items.retrieve(items[3].id, eval_id=ev.id, run_id=run.id)
        assert one.to_dict() == items[3].to_dict()

    def test_a_worker_taking_over_a_dead_workers_run_goes_on_after_its_items(
        self, client: OpenAI, settings: Any, db: Any
    ) -> None:
        from worker.evals import run_eval

        ev = make_eval(client)
        run = jsonl_run(client, ev.id)
        with db() as s:  # the first worker claimed it, wrote item 0 and died (its lease expired)
            assert evals_repo.claim(s, run_id=run.id, worker_id="dead", lease_seconds=30, at=0.0)
            s.add(_item(run.id, ev.id))
        assert run_eval(run.id, settings=settings, worker_id="w-alive") == "completed"
        done = client.evals.runs.retrieve(run.id, eval_id=ev.id)
        assert done.result_counts.to_dict() == {"total": 5, "errored": 1, "failed": 1, "passed": 3}  # item 0: kept
        with db() as s:
            assert evals_repo.claim(s, run_id=run.id, worker_id="late", lease_seconds=30) is False  # finished

    def test_a_cancel_seen_by_the_worker_ends_the_run_canceled_with_its_event(
        self, client: OpenAI, settings: Any, db: Any
    ) -> None:
        from worker.evals import run_eval

        ev = make_eval(client)
        run = jsonl_run(client, ev.id)
        with db() as s:
            assert evals_repo.claim(s, run_id=run.id, worker_id="w1", lease_seconds=30)
        assert client.evals.runs.cancel(run.id, eval_id=ev.id).status == "in_progress"  # asked; w1 ends it
        with db() as s:
            assert evals_repo.renew(s, run_id=run.id, worker_id="w1", lease_seconds=30) == (True, True)
            assert evals_repo.finish(s, run_id=run.id, worker_id="w1", status=EvalRunStatus.CANCELED)
        assert client.evals.runs.retrieve(run.id, eval_id=ev.id).status == "canceled"
        assert run_eval(run.id, settings=settings, worker_id="w2") == "skipped"


def _item(run_id: str, eval_id: str) -> EvalOutputItem:
    return EvalOutputItem(
        id="outputitem_dead0",
        run_id=run_id,
        eval_id=eval_id,
        datasource_item_id=0,
        datasource_item=ROWS[0]["item"],
        sample=ROWS[0]["sample"],
        results=[
            {"name": "exact", "type": "string_check", "score": 1.0, "passed": True, "errored": False},
            {"name": "length", "type": "python", "score": 1.0, "passed": True, "errored": False},
        ],
        status="pass",
        errored=False,
        created_at=0,
    )


class TestEvents:
    def test_a_runs_end_is_an_event_about_the_run_for_the_subscribed_endpoints(
        self, base_url: str, settings: Any, db: Any
    ) -> None:
        tenant = make_tenant(settings, f"evals-events-{time.time_ns()}")
        client = OpenAI(api_key=tenant.key, base_url=f"{base_url}/v1", max_retries=0)
        hook = client.webhooks.create(
            name="ci", url="https://93.184.216.34/hooks", event_types=["eval.run.succeeded", "eval.run.canceled"]
        )
        try:
            events = self._events(client, settings, db, tenant.id)
        finally:
            client.webhooks.delete(hook.id)  # its deliveries, owed to no one, go with it: other tests deliver
        assert sorted(events.rows) == sorted(
            [
                ("eval.run.canceled", "eval.run", events.canceled, hook.id),
                ("eval.run.succeeded", "eval.run", events.completed, hook.id),
            ]
        )

    @staticmethod
    def _events(client: OpenAI, settings: Any, db: Any, tenant_id: str) -> Any:
        from worker.evals import run_eval

        ev = make_eval(client)
        canceled, completed = jsonl_run(client, ev.id), jsonl_run(client, ev.id)
        client.evals.runs.cancel(canceled.id, eval_id=ev.id)
        assert run_eval(completed.id, settings=settings, worker_id="w-events") == "completed"
        columns = (WebhookEvent.type, WebhookEvent.subject_type, WebhookEvent.subject_id, WebhookDelivery.endpoint_id)
        with db() as s:
            rows = s.execute(
                select(*columns)
                .join(WebhookDelivery, WebhookDelivery.event_id == WebhookEvent.id)
                .where(WebhookEvent.tenant_id == tenant_id)
            ).all()
        return SimpleNamespace(rows=[tuple(r) for r in rows], canceled=canceled.id, completed=completed.id)


class TestWorkerEdges:
    def test_a_file_line_that_is_not_an_item_fails_the_run_naming_the_line(self, client: OpenAI, settings: Any) -> None:
        from worker.evals import run_eval

        rows = b'{"item": {"answer": "1"}}\n{"answer": "2"}\n'
        uploaded = client.files.create(file=("rows.jsonl", rows), purpose="evals")
        ev = make_eval(client)
        data_source: Any = {"type": "jsonl", "source": {"type": "file_id", "id": uploaded.id}}
        run = client.evals.runs.create(ev.id, data_source=data_source)
        assert run_eval(run.id, settings=settings, worker_id="w-bad-file") == "failed"
        failed = client.evals.runs.retrieve(run.id, eval_id=ev.id)
        assert failed.status == "failed" and failed.error.code == "invalid_file"
        assert f"file {uploaded.id!r}, line 2" in failed.error.message
        assert failed.result_counts.total == 0

    def test_the_sweeper_wakes_lost_and_orphaned_runs_and_settles_a_canceled_one(
        self, client: OpenAI, settings: Any, db: Any
    ) -> None:
        from worker.evals import sweep_eval_runs

        ev = make_eval(client)
        waiting, dead, stopping = (jsonl_run(client, ev.id) for _ in range(3))
        with db() as s:
            evals_repo.mark_enqueued(s, run_id=waiting.id)
            s.execute(
                sa_update(EvalRun).where(EvalRun.id == waiting.id).values(enqueued_at=time.time() - 3600)
            )  # its message lost an hour ago
            for run in (dead, stopping):  # claimed by workers that died: their leases expired long ago
                assert evals_repo.claim(s, run_id=run.id, worker_id="dead", lease_seconds=1, at=0.0)
            assert evals_repo.request_cancel(s, run_id=stopping.id)
        sent: list[tuple[str, list[str], str]] = []

        class App:
            def send_task(self, name: str, args: list[str], queue: str) -> None:
                sent.append((name, args, queue))

        woken = sweep_eval_runs(App(), settings, queued_grace_seconds=60)
        mine = {dead.id, waiting.id}
        assert sorted(r for r in woken if r in mine | {stopping.id}) == sorted(mine)
        assert sorted(args[0] for name, args, queue in sent if args[0] in mine) == sorted(mine)
        assert {(name, queue) for name, _, queue in sent} == {("proxima.evals.run", "celery")}
        assert client.evals.runs.retrieve(stopping.id, eval_id=ev.id).status == "canceled"
        assert client.evals.runs.retrieve(dead.id, eval_id=ev.id).status == "in_progress"  # the next worker claims it


class TestReviewedEdges:
    """Items a schema cannot check, large items, rows without a sample, how runs end, what the sweeper re-sends."""

    def test_an_item_the_schema_cannot_check_is_a_400_on_the_schema_inline_and_fails_a_file_run(
        self, client: OpenAI, api: httpx.Client, settings: Any
    ) -> None:
        from worker.evals import run_eval

        # an empty item passes both; an item with `a` meets an unreachable $ref, or one that never ends
        for schema in (
            {"properties": {"a": {"$ref": "https://93.184.216.34/a.json"}}},
            {"properties": {"a": {"$ref": "#/properties/a"}}},
        ):
            ev = make_eval(client, data_source_config={"type": "custom", "item_schema": schema})
            inline = {"type": "jsonl", "source": {"type": "file_content", "content": [{"item": {"a": 1}}]}}
            response = api.post(f"/v1/evals/{ev.id}/runs", json={"data_source": inline})
            assert_error(response, 400, param="data_source_config.item_schema", code="invalid_item_schema")
            uploaded = client.files.create(file=("rows.jsonl", b'{"item": {"a": 1}}\n'), purpose="evals")
            run = client.evals.runs.create(
                ev.id, data_source=cast(Any, {"type": "jsonl", "source": {"type": "file_id", "id": uploaded.id}})
            )
            assert run_eval(run.id, settings=settings, worker_id="w-bad-schema") == "failed"
            error = client.evals.runs.retrieve(run.id, eval_id=ev.id).error
            assert error.code == "invalid_item_schema" and "data_source_config.item_schema" in error.message

    def test_a_remote_ref_is_never_fetched(self, api: httpx.Client, monkeypatch: pytest.MonkeyPatch) -> None:
        import urllib.request

        fetched: list[Any] = []
        monkeypatch.setattr(urllib.request, "urlopen", lambda *a, **kw: fetched.append(a) or pytest.fail("fetched"))
        schema = {"$ref": "https://93.184.216.34/s.json"}
        body = {"data_source_config": {"type": "custom", "item_schema": schema}, "testing_criteria": [EXACT]}
        assert_error(api.post("/v1/evals", json=body), 400, param="data_source_config.item_schema")
        assert fetched == []

    def test_an_item_that_does_not_fit_is_named_without_repeating_all_of_it(
        self, client: OpenAI, api: httpx.Client
    ) -> None:
        ev = make_eval(client)
        huge = ["x" * 5000]
        source = {"type": "file_content", "content": [{"item": {"answer": huge}}]}
        response = api.post(f"/v1/evals/{ev.id}/runs", json={"data_source": {"type": "jsonl", "source": source}})
        error = assert_error(response, 400, param="data_source.source.content[0].item")
        assert "item['answer']: fails type: string" in error["message"] and "x" * 150 in error["message"]
        assert len(error["message"]) < 600, len(error["message"])

    def test_a_row_without_a_sample_is_stored_as_an_empty_object_and_shown_as_null(
        self, client: OpenAI, settings: Any, db: Any
    ) -> None:
        from worker.evals import run_eval

        ev = make_eval(client, testing_criteria=[{**EXACT, "input": "{{item.answer}}"}])
        run = jsonl_run(client, ev.id, rows=[{"item": {"answer": "1"}}])
        assert run_eval(run.id, settings=settings, worker_id="w-no-sample") == "completed"
        with db() as s:
            assert s.scalars(select(EvalOutputItem.sample).where(EvalOutputItem.run_id == run.id)).all() == [{}]
        assert [i.sample for i in client.evals.runs.output_items.list(run.id, eval_id=ev.id)] == [None]

    def test_a_canceled_run_whose_worker_died_ends_with_the_counts_of_its_items(
        self, client: OpenAI, settings: Any, db: Any
    ) -> None:
        from worker.evals import sweep_eval_runs

        class App:
            def send_task(self, name: str, args: list[str], queue: str) -> None:
                pass

        ev = make_eval(client)
        run = jsonl_run(client, ev.id)
        written = _item(run.id, ev.id)
        written.id = f"outputitem_{run.id}"
        with db() as s:  # its worker wrote item 0, was asked to cancel and died
            assert evals_repo.claim(s, run_id=run.id, worker_id="dead", lease_seconds=1, at=0.0)
            s.add(written)
            assert evals_repo.request_cancel(s, run_id=run.id)
        sweep_eval_runs(App(), settings, queued_grace_seconds=3600)
        done = client.evals.runs.retrieve(run.id, eval_id=ev.id)
        assert done.status == "canceled" and done.result_counts.to_dict() == {
            "total": 1,
            "errored": 0,
            "failed": 0,
            "passed": 1,
        }
        assert [r.to_dict() for r in done.per_testing_criteria_results] == [
            {"testing_criteria": "exact", "passed": 1, "failed": 0},
            {"testing_criteria": "length", "passed": 1, "failed": 0},
        ]

    def test_a_batch_is_checked_against_its_own_items_only(
        self, client: OpenAI, db: Any, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        ev = make_eval(client)
        run = jsonl_run(client, ev.id)
        written, again, fresh = (_item(run.id, ev.id) for _ in range(3))
        written.id, again.id, fresh.id = (f"outputitem_{n}_{run.id}" for n in ("written", "again", "fresh"))
        fresh.datasource_item_id = 1
        with db() as s:
            assert evals_repo.claim(s, run_id=run.id, worker_id="w", lease_seconds=30)
            s.add(written)
        # not every item of the run per batch: a run of n items would read n²/BATCH rows
        monkeypatch.setattr(evals_repo, "done_item_ids", lambda *a, **kw: pytest.fail("read every item"))
        with db() as s:
            assert evals_repo.add_items(s, run_id=run.id, worker_id="w", lease_seconds=30, rows=[again, fresh])
        with db() as s:
            ids = s.scalars(select(EvalOutputItem.id).where(EvalOutputItem.run_id == run.id)).all()
        assert sorted(ids) == sorted([written.id, fresh.id])  # the item written already is not written again

    def test_the_sweeper_resends_only_the_runs_whose_message_the_broker_lost(
        self, client: OpenAI, settings: Any, db: Any
    ) -> None:
        from celery import Celery

        from api.tasks import DEFAULT_QUEUE, RUN_EVAL
        from worker.broker import task_arg_of
        from worker.sweeper import sweep_evals_once

        app = Celery("test-eval-sweep", broker=settings.celery_broker_url)
        ev = make_eval(client)
        kept, lost = jsonl_run(client, ev.id), jsonl_run(client, ev.id)
        with app.connection_for_write() as conn:  # the broker restarted empty; then kept's message came again
            conn.default_channel.queue_purge(DEFAULT_QUEUE)
        app.send_task(RUN_EVAL, args=[kept.id], queue=DEFAULT_QUEUE)
        with db() as s:  # both enqueued an hour ago
            s.execute(sa_update(EvalRun).where(EvalRun.id.in_([kept.id, lost.id])).values(enqueued_at=1.0))
        try:
            woken = sweep_evals_once(app, settings, queued_grace_seconds=60)
            with app.connection_for_read() as conn:
                raws = conn.default_channel.client.lrange(DEFAULT_QUEUE, 0, -1)
        finally:
            app.close()
        assert lost.id in woken and kept.id not in woken
        messages = [task_arg_of(raw, task=RUN_EVAL) for raw in raws]
        assert (messages.count(kept.id), messages.count(lost.id)) == (1, 1)
