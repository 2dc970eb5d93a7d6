"""The dashboard's Evals pages in a real browser (Playwright, Debian's Chromium) against the app on PostgreSQL with no
worker: the evals and runs are made over the API with the official client, and the runs' output items and results
are written as a worker writes them (claim the run, add its graded items under the lease, finish it). Screenshots of
the three pages go to ``$PROXIMA_TEST_ARTIFACTS/dashboard/`` as the other dashboard tests' do."""

from __future__ import annotations

import os
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from openai import OpenAI
from playwright.sync_api import Page, expect

from api import ids
from api.auth import create_key
from api.db import session_scope
from api.migrate import upgrade
from api.orm import EvalOutputItem
from api.repositories import evals as evals_repo
from api.settings import Settings
from api.status import EvalRunStatus
from tests.e2e.conftest import create_pg_database, drop_pg_database
from tests.integration.conftest import serve
from tests.redis_dbs import claim_redis_url, release_redis_url

REPO = Path(__file__).resolve().parents[2]
ARTIFACTS = Path(os.environ.get("PROXIMA_TEST_ARTIFACTS") or REPO / "test-artifacts") / "dashboard"
WORKER = "worker-evals-1"
GRADED = 21  # items sampled and graded; one more, whose sampling timed out, makes two more than a page
ITEMS = GRADED + 1
TIMEOUT = "the inference server did not answer within 30 s"
ERROR_CODE = "sandbox_unavailable"
ERROR = "python graders cannot run on this worker: no bubblewrap"
DATED = re.compile(r"\d{4}-\d\d-\d\d ")

EXACT: Any = {  # the SDK types criteria as TypedDicts; these are what a user sends
    "type": "string_check",
    "name": "exact",
    "input": "{{sample.output_text}}",
    "reference": "{{item.answer}}",
    "operation": "eq",
}
CLOSE: Any = {
    "type": "text_similarity",
    "name": "close",
    "input": "{{sample.output_text}}",
    "reference": "{{item.answer}}",
    "evaluation_metric": "fuzzy_match",
    "pass_threshold": 0.8,
}
ITEM_SCHEMA = {
    "type": "object",
    "properties": {"question": {"type": "string"}, "answer": {"type": "string"}},
    "required": ["question", "answer"],
}


@dataclass
class Deployment:
    base: str
    key: str
    eval_id: str  # two criteria, a completed run and, newer, a failed one
    empty_id: str  # no runs
    other_tenant_eval_id: str
    run_id: str  # completed: ITEMS graded items
    failed_run_id: str


def item(i: int) -> dict[str, str]:
    return {"question": f"What is {i} + {i + 1}?", "answer": str(2 * i + 1)}


def graded(i: int) -> tuple[str, float, float]:
    """Item i's output and its (exact, close) scores: every third item from i=1 is wrong; the first three of those
    only by a trailing dot, which fuzzy_match scores 0.8 (a pass of `close`), the others by ten (0.5, a fail)."""
    answer = item(i)["answer"]
    if i % 3 != 1:
        return answer, 1.0, 1.0
    if i < 10:
        return f"{answer}.", 0.0, 0.8
    return str(int(answer) + 10), 0.0, 0.5


# By hand from graded(): `exact` fails i = 1, 4, 7, 10, 13, 16, 19 (7 of 21), `close` fails i = 10, 13, 16, 19 (4);
# an item passes when both do: 14 pass, 7 fail, and the item that was never sampled is errored (in neither rate).
EXACT_RATE, EXACT_COUNTS = "66.7%", "14 / 21"
CLOSE_RATE, CLOSE_COUNTS = "81.0%", "17 / 21"
FAILED_ROWS = ["1", "4", "7", "10", "13", "16", "19", str(GRADED)]  # the API's `fail` includes the errored item


def result(name: str, kind: str, score: float, passed: bool) -> dict[str, Any]:
    return {
        "name": name,
        "type": kind,
        "score": score,
        "passed": passed,
        "sample": None,
        "errored": False,
        "errors": [],
    }


def output_item(run_id: str, eval_id: str, i: int) -> EvalOutputItem:
    """Item i as the worker writes it (worker/evals.py): the sample in OpenAI's shape and a result per criterion, or,
    for the last item, a sample whose request timed out and no results."""
    sample: dict[str, Any] = {
        "input": [{"role": "user", "content": item(i)["question"]}],
        "output": [],
        "finish_reason": None,
        "model": "tiny-arith",
        "usage": None,
        "error": None,
        "temperature": 0.0,
        "top_p": None,
        "max_completion_tokens": 8,
        "seed": 0,
    }
    results: list[dict[str, Any]] = []
    if i < GRADED:
        output, exact, close = graded(i)
        results = [
            result("exact", "string_check", exact, exact >= 1.0),
            result("close", "text_similarity", close, close >= 0.8),
        ]
        usage = {"prompt_tokens": 9, "completion_tokens": 2, "total_tokens": 11, "cached_tokens": 0}
        sample |= {"output": [{"role": "assistant", "content": output}], "finish_reason": "stop", "usage": usage}
    else:
        sample["error"] = {"code": "timeout", "message": TIMEOUT}
    errored = sample["error"] is not None
    return EvalOutputItem(
        id=ids.output_item_id(),
        run_id=run_id,
        eval_id=eval_id,
        datasource_item_id=i,
        datasource_item=item(i),
        sample=sample,
        results=results,
        status="pass" if not errored and all(r["passed"] for r in results) else "fail",
        errored=errored,
    )


def completions_source(n: int) -> Any:  # the SDK types data sources as TypedDicts
    return {
        "type": "completions",
        "model": "tiny-arith",
        "source": {"type": "file_content", "content": [{"item": item(i)} for i in range(n)]},
        "input_messages": {"type": "template", "template": [{"role": "user", "content": "{{item.question}}"}]},
        "sampling_params": {"temperature": 0.0, "max_completion_tokens": 8, "seed": 0},
    }


def make_evals(base: str, key: str, other_key: str) -> tuple[str, str, str, str, str]:
    """Over the API: an empty eval, then the eval looked at with a run that completes and, newer, one that fails."""
    client = OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0, timeout=30)
    config: Any = {"type": "custom", "item_schema": ITEM_SCHEMA, "include_sample_schema": True}
    other = OpenAI(base_url=f"{base}/v1", api_key=other_key, max_retries=0, timeout=30)
    other_id = other.evals.create(name="another team's eval", data_source_config=config, testing_criteria=[EXACT]).id
    empty_id = client.evals.create(name="no runs yet", data_source_config=config, testing_criteria=[EXACT]).id
    eval_id = client.evals.create(name="arith", data_source_config=config, testing_criteria=[EXACT, CLOSE]).id
    run = client.evals.runs.create(eval_id, name="greedy", data_source=completions_source(ITEMS))
    time.sleep(1.05)  # runs are ordered by their creation second: the failed one is the newer
    failed = client.evals.runs.create(eval_id, name="server down", data_source=completions_source(2))
    return eval_id, empty_id, other_id, run.id, failed.id


def run_as_worker(database_url: str, eval_id: str, run_id: str, failed_run_id: str) -> None:
    """The worker's writes: claim, the graded items under the lease, the end (which tallies the counts)."""
    with session_scope(database_url) as s:
        assert evals_repo.claim(s, run_id=run_id, worker_id=WORKER, lease_seconds=60)
        rows = [output_item(run_id, eval_id, i) for i in range(ITEMS)]
        assert evals_repo.add_items(s, run_id=run_id, worker_id=WORKER, lease_seconds=60, rows=rows)
        assert evals_repo.finish(s, run_id=run_id, worker_id=WORKER, status=EvalRunStatus.COMPLETED)
        assert evals_repo.claim(s, run_id=failed_run_id, worker_id=WORKER, lease_seconds=60)
        error = {"code": ERROR_CODE, "message": ERROR}
        assert evals_repo.finish(s, run_id=failed_run_id, worker_id=WORKER, status=EvalRunStatus.FAILED, error=error)


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    from api.app import create_app

    root = tmp_path_factory.mktemp("evals-dashboard")
    database_url = create_pg_database()
    broker = claim_redis_url()
    try:
        upgrade(database_url)
        settings = Settings(
            home=root / "home", database_url=database_url, broker_url=broker, artifacts=str(root / "artifacts")
        )
        with session_scope(database_url) as s:
            _, key = create_key(s, tenant_name="evals-team")
            _, other_key = create_key(s, tenant_name="other-team")
        with serve(create_app(settings)) as url:
            eval_id, empty_id, other_id, run_id, failed_id = make_evals(url, key, other_key)
            run_as_worker(database_url, eval_id, run_id, failed_id)
            yield Deployment(url, key, eval_id, empty_id, other_id, run_id, failed_id)
    finally:
        release_redis_url(broker)
        drop_pg_database(database_url)


def screenshot(page: Page, name: str) -> None:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=ARTIFACTS / f"{name}.png", full_page=True)


def sign_in(page: Page, d: Deployment) -> None:
    page.goto(f"{d.base}/dashboard/")
    page.get_by_label("API key").fill(d.key)
    page.get_by_role("button", name="Sign in").click()
    expect(page.get_by_role("heading", name="Fine-tuning jobs")).to_be_visible()


def test_evals_list_runs_pass_rates_output_items_and_a_failed_runs_error(page: Page, deployment: Deployment) -> None:
    d = deployment
    sign_in(page, d)
    page.get_by_role("navigation", name="Main").get_by_role("link", name="Evals").click()
    expect(page.get_by_role("heading", name="Evals", exact=True)).to_be_visible()
    expect(page.locator('[data-nav="evals"]')).to_have_attribute("aria-current", "page")

    # The list: name and id, criteria, data source, created, the latest run's status and name; this tenant's only.
    expect(page.locator("table.evals-table tbody tr")).to_have_count(2)
    expect(page.locator(f'tr[data-eval-id="{d.eval_id}"] td')).to_have_text(
        [f"arith{d.eval_id}", "2", "custom", DATED, "failed server down"]
    )
    expect(page.locator(f'tr[data-eval-id="{d.empty_id}"] td')).to_have_text(
        [f"no runs yet{d.empty_id}", "1", "custom", DATED, "no runs"]
    )
    expect(page.locator(f'tr[data-eval-id="{d.other_tenant_eval_id}"]')).to_have_count(0)
    screenshot(page, "evals")

    # An eval's page: its criteria, and its runs newest first with counts and each criterion's pass rate.
    page.get_by_role("link", name="arith", exact=True).click()
    expect(page.get_by_role("heading", name="arith", exact=True)).to_be_visible()
    assert page.url.endswith(f"#/evals/{d.eval_id}")
    criteria = page.locator("table.testing-criteria tbody tr")
    expect(criteria.nth(0).locator("td").nth(2)).to_have_text("{{sample.output_text}} eq {{item.answer}}")
    expect(criteria.nth(1).locator("td").nth(3)).to_have_text("0.8")
    runs = page.locator("table.eval-runs tbody tr")
    expect(runs).to_have_count(2)
    expect(runs.first).to_have_attribute("data-run-id", d.failed_run_id)
    expect(runs.first.locator("td").nth(1)).to_have_text(f"failed{ERROR}")
    done = page.locator(f'tr[data-run-id="{d.run_id}"]')
    # Run, status, model, data source, passed, failed, errored, total, then exact's and close's pass rates.
    expect(done.locator("td").nth(1)).to_have_text("completed")
    expect(done.locator("td").nth(2)).to_have_text("tiny-arith")
    expect(done.locator("td").nth(3)).to_have_text(f"completions · {ITEMS} inline items")
    expect(done.locator("td").nth(4)).to_have_text("14")
    expect(done.locator("td").nth(5)).to_have_text("7")
    expect(done.locator("td").nth(6)).to_have_text("1")
    expect(done.locator("td").nth(7)).to_have_text(str(ITEMS))
    expect(done.locator('td[data-criterion="exact"]')).to_have_text(f"{EXACT_RATE}{EXACT_COUNTS}")
    expect(done.locator('td[data-criterion="close"]')).to_have_text(f"{CLOSE_RATE}{CLOSE_COUNTS}")
    expect(done.locator('td[data-criterion="close"] meter')).to_have_attribute("value", str(17 / 21))
    screenshot(page, "eval")

    # The run's page: its output items a page at a time, filtered, and one opened with its grades.
    done.get_by_role("link", name="greedy").click()
    expect(page.get_by_role("heading", name="greedy")).to_be_visible()
    expect(page.locator("table.run-criteria tr[data-criterion='exact'] td")).to_have_text(
        ["exact", "14", "7", f"{EXACT_RATE}{EXACT_COUNTS}"]
    )
    expect(page.locator(".summary-item", has_text="Tokens").locator("dd")).to_have_text(str(11 * GRADED))
    items = page.locator("table.output-items tbody tr")
    expect(items).to_have_count(20)
    page.get_by_role("button", name="Load more").click()
    expect(items).to_have_count(ITEMS)
    expect(page.get_by_role("button", name="Load more")).to_be_hidden()
    expect(items.last.locator("td").nth(1)).to_have_text("error")
    expect(items.last.locator("td").nth(3)).to_have_text(f"sampling failed: {TIMEOUT}")
    page.get_by_label("Show").select_option("fail")
    expect(items.locator("td:nth-child(1)")).to_have_text(FAILED_ROWS)
    assert page.url.endswith(f"#/evals/{d.eval_id}/runs/{d.run_id}?status=fail")

    page.get_by_role("button", name="Open item 10").click()
    opened = page.locator("section.output-item")
    expect(opened.get_by_role("heading", name="Item 10 fail")).to_be_focused()
    expect(opened.locator("table.item-results tbody tr")).to_have_text(
        ["exactstring_check0fail", "closetext_similarity0.5fail"]
    )
    expect(opened.locator(".sample-meta")).to_have_text("tiny-arith · finish: stop · 9 prompt + 2 completion tokens")
    expect(opened.locator(".msg")).to_have_text(["userWhat is 10 + 11?", "assistant31"])
    expect(opened.locator("pre")).to_contain_text('"answer": "21"')
    screenshot(page, "eval-run")
    item_id = opened.get_attribute("data-item-id")
    # The address opens the same item on a fresh load.
    page.goto(f"{d.base}/dashboard/#/evals/{d.eval_id}/runs/{d.run_id}?status=fail&item={item_id}")
    page.reload()
    expect(page.locator("section.output-item").get_by_role("heading", name="Item 10 fail")).to_be_visible()
    expect(page.get_by_label("Show")).to_have_value("fail")

    # The failed run's page: its error, and no results.
    page.goto(f"{d.base}/dashboard/#/evals/{d.eval_id}/runs/{d.failed_run_id}")
    expect(page.locator(".run-error-box")).to_have_text(f"Failed ({ERROR_CODE}): {ERROR}")
    expect(page.get_by_text("No results yet.")).to_be_visible()
    expect(page.get_by_text("No output items yet.")).to_be_visible()
