"""The browser dashboard against a real deployment: ``proxima serve`` (API and one worker) on PostgreSQL and Redis,
real jobs on the tiny random model, driven with Playwright in Debian's headless Chromium.

Screenshots of every page are written to ``$PROXIMA_TEST_ARTIFACTS/dashboard/`` (default
``test-artifacts/dashboard/``, git-ignored). Chromium comes from the system (Debian's ``chromium``; ``make test``
installs it when missing): without it these tests fail, they do not skip.
"""

from __future__ import annotations

import json
import os
import re
import tarfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from playwright.sync_api import Locator, Page, expect

from trainer.spec import metrics as M

from .dashboard_support import (
    DashboardServer,
    assert_fits,
    create_job,
    hyperparameters,
    metrics,
    upload,
    wait_job,
)

REPO = Path(__file__).resolve().parents[2]
ARTIFACTS = Path(os.environ.get("PROXIMA_TEST_ARTIFACTS") or REPO / "test-artifacts") / "dashboard"
SHORT_STEPS = 6
WAIT_MS = 60_000


@dataclass
class Deployment:
    server: DashboardServer
    key_a: str
    key_b: str
    api: httpx.Client  # tenant A
    train_file: Path
    short: str  # a job that runs to the end
    long: str  # a job that is still running when the cancel test cancels it

    @property
    def dashboard(self) -> str:
        return f"{self.server.base}/dashboard/"

    def wait(
        self, job_id: str, check: Callable[[dict[str, Any]], bool], what: str, timeout: float = 180.0
    ) -> dict[str, Any]:
        return wait_job(self.api, job_id, check, what=what, server=self.server, timeout=timeout)


@pytest.fixture(scope="module")
def deployment(
    tmp_path_factory: pytest.TempPathFactory, random_model_dir: Path, arithmetic_data: Path
) -> Iterator[Deployment]:
    server = DashboardServer(tmp_path_factory.mktemp("dashboard"), model_dir=random_model_dir)
    try:
        server.start()
        key_a, key_b = server.api_key("team-a"), server.api_key("team-b")
        api = server.client(key_a)
        train = upload(api, arithmetic_data / "train.jsonl")
        val = upload(api, arithmetic_data / "validation.jsonl")
        # One worker runs them in turn: the short job first, then the long one (cancelled by a test).
        short = create_job(api, training_file=train, validation_file=val, suffix="short", hp=hyperparameters(steps=6))
        long = create_job(
            api,
            training_file=train,
            validation_file=val,
            suffix="long",
            hp=hyperparameters(steps=2000, checkpoint_interval=1000, eval_interval=1000),
        )
        yield Deployment(server, key_a, key_b, api, arithmetic_data / "train.jsonl", short["id"], long["id"])
        api.close()
    finally:
        server.close()


def screenshot(page: Page, name: str, *, full_page: bool = True) -> None:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=ARTIFACTS / f"{name}.png", full_page=full_page)


def sign_in(page: Page, d: Deployment, key: str) -> None:
    page.goto(d.dashboard)
    page.get_by_label("API key").fill(key)
    page.get_by_role("button", name="Sign in").click()
    expect(page.get_by_role("heading", name="Fine-tuning jobs")).to_be_visible()


def go(page: Page, d: Deployment, route: str) -> None:
    page.goto(f"{d.dashboard}#/{route}")


def chart(page: Page, chart_id: str) -> Locator:
    return page.locator(f'figure[data-chart="{chart_id}"]')


def count(points: list[dict[str, Any]], name: str) -> int:
    return sum(name in p["metrics"] for p in points)


def vocabulary_names(grader: str) -> list[str]:
    """Every name of the trainer's vocabulary, with each family's series for one sub-grader."""
    return [*M.METRICS, *(family.name(grader) for family in M.FAMILIES)]


def test_root_redirects_and_a_wrong_key_is_refused_then_the_jobs_table_lists_the_tenants_jobs(
    page: Page, deployment: Deployment
) -> None:
    d = deployment
    page.goto(d.server.base + "/")
    assert page.url == d.dashboard
    page.get_by_label("API key").fill("sk-prx-not-a-key")
    page.get_by_role("button", name="Sign in").click()
    expect(page.get_by_role("alert").filter(has_text="This key was refused")).to_be_visible()
    expect(page.get_by_label("API key")).to_have_attribute("aria-invalid", "true")

    sign_in(page, d, d.key_a)
    rows = page.locator("table.jobs-table tbody tr")
    expect(rows).to_have_count(2)
    for job_id, suffix in ((d.short, "short"), (d.long, "long")):
        row = page.locator(f'tr[data-job-id="{job_id}"]')
        expect(row.get_by_role("link", name=job_id)).to_be_visible()
        expect(row).to_contain_text(suffix)
        expect(row).to_contain_text("grpo")
        expect(row).to_contain_text("tiny-random")

    # Filters: the short job succeeds while the long one runs; the table follows without a reload.
    d.wait(d.short, lambda j: j["status"] == "succeeded", "the short job to succeed")
    page.get_by_label("Status").select_option("succeeded")
    expect(rows).to_have_count(1)
    expect(page.locator(f'tr[data-job-id="{d.short}"]')).to_contain_text(f"{SHORT_STEPS} / {SHORT_STEPS}")
    expect(page.locator(f'tr[data-job-id="{d.short}"] td[data-label="Reward"]')).to_have_text(re.compile(r"^-?\d"))
    assert page.url.endswith("#/jobs?status=succeeded")
    page.get_by_label("Status").select_option("")
    page.get_by_label("Method").select_option("grpo")
    expect(rows).to_have_count(2)
    screenshot(page, "jobs")


def test_job_page_charts_have_one_point_per_step_the_metrics_endpoint_returns(
    page: Page, deployment: Deployment
) -> None:
    d = deployment
    d.wait(d.short, lambda j: j["status"] == "succeeded", "the short job to succeed")
    points = metrics(d.api, d.short)
    assert count(points, M.REWARD_MEAN) == SHORT_STEPS
    # What the page is fed: a real run's names, all of them the trainer's vocabulary.
    assert sorted({n for p in points for n in p["metrics"] if not M.is_known(n)}) == []

    sign_in(page, d, d.key_a)
    go(page, d, f"jobs/{d.short}")
    expect(page.get_by_role("heading", name=d.short)).to_be_visible()
    expect(page.locator("#charts")).to_have_attribute("data-steps", str(len(points)))
    expect(chart(page, "reward")).to_have_attribute("data-points", str(count(points, M.REWARD_MEAN)))
    expect(chart(page, "val-reward")).to_have_attribute("data-points", str(count(points, M.VAL_REWARD_MEAN)))
    expect(chart(page, "kl")).to_have_attribute("data-points", str(count(points, M.KL_MEAN)))
    expect(chart(page, "loss")).to_have_attribute("data-points", str(count(points, M.LOSS_TOTAL)))
    # One curve per named sub-grader; names outside the preferred set get their own chart.
    graders = f"{M.reward_of('exact')} {M.reward_of('sim')}"
    expect(chart(page, "reward-graders")).to_have_attribute("data-series", graders)
    expect(chart(page, f"metric:{M.GRAD_NORM}")).to_have_attribute("data-points", str(count(points, M.GRAD_NORM)))
    expect(chart(page, "reward").locator(".chart-legend")).to_contain_text("±")
    # The trainer's description of a series, on hovering its legend entry.
    description = f"{M.REWARD_MEAN}: {M.METRICS[M.REWARD_MEAN].description}"
    expect(chart(page, "reward").locator(".chart-legend li").first).to_have_attribute("title", description)
    expect(page.locator(".badge-slot")).to_have_text("succeeded")
    expect(page.locator("ol.events")).to_contain_text("The job has successfully completed")
    expect(page.locator("pre.spec")).to_contain_text('"calculate_output": "0.7 * sim + 0.3 * exact"')
    expect(page.get_by_role("button", name="Cancel job")).to_be_disabled()
    screenshot(page, "job")

    # A narrow screen: one column, nothing wider than the viewport.
    page.set_viewport_size({"width": 390, "height": 844})
    expect(chart(page, "reward")).to_be_visible()
    assert_fits(page, 390)
    screenshot(page, "job-narrow", full_page=False)
    go(page, d, "jobs")
    expect(page.locator(f'tr[data-job-id="{d.short}"]')).to_be_visible()
    assert_fits(page, 390)
    screenshot(page, "jobs-narrow", full_page=False)


def test_checkpoint_download_button_gives_an_adapter_archive_that_peft_loads(
    page: Page, deployment: Deployment, random_model_dir: Path, tmp_path: Path
) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    d = deployment
    d.wait(d.short, lambda j: j["status"] == "succeeded", "the short job to succeed")
    sign_in(page, d, d.key_a)
    go(page, d, f"jobs/{d.short}")
    button = page.get_by_role("button", name=f"Download the adapter of step {SHORT_STEPS}")
    with page.expect_download() as info:
        button.click()
    download = info.value
    assert download.suggested_filename == f"{d.short}-step-{SHORT_STEPS}-adapter.tar.gz"
    archive = tmp_path / download.suggested_filename
    download.save_as(archive)

    with tarfile.open(archive, "r:gz") as tar:
        tar.extractall(tmp_path / "adapter", filter="data")
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(random_model_dir), str(tmp_path / "adapter"))
    assert any("lora_" in name for name, _ in model.named_parameters())


def test_rollouts_page_shows_each_sample_with_its_per_grader_rewards_and_advantage(
    page: Page, deployment: Deployment
) -> None:
    d = deployment
    d.wait(d.short, lambda j: j["status"] == "succeeded", "the short job to succeed")
    latest = d.api.get(f"/fine_tuning/jobs/{d.short}/rollouts").json()
    assert latest["step"] == SHORT_STEPS and latest["data"]

    sign_in(page, d, d.key_a)
    go(page, d, f"jobs/{d.short}/rollouts")
    table = page.locator("table#rollouts")
    expect(table.locator("tbody tr")).to_have_count(len(latest["data"]))
    headers = table.locator("thead th")
    expect(headers).to_contain_text(["#", "Prompt", "Completion", "Reward", "sim", "exact", "Advantage", "Tokens"])
    first = latest["data"][0]
    row = table.locator("tbody tr").first
    expect(row).to_contain_text(first["prompt"][0]["content"])
    if first["completion"]:
        expect(row.locator("td.completion")).to_have_text(first["completion"])
    expect(page.locator(".stats")).to_contain_text(f"Step {SHORT_STEPS}")
    screenshot(page, "rollouts")

    page.get_by_role("button", name="Previous step").click()
    expect(page.locator(".stats")).to_contain_text(f"Step {SHORT_STEPS - 1}")
    assert page.url.endswith(f"rollouts?step={SHORT_STEPS - 1}")
    expect(page.get_by_label("follow latest")).not_to_be_checked()


def test_compare_overlays_one_metric_of_several_jobs(page: Page, deployment: Deployment) -> None:
    d = deployment
    d.wait(d.short, lambda j: j["status"] == "succeeded", "the short job to succeed")
    d.wait(d.long, lambda j: j["current_step"] >= 1, "the long job's first step")
    sign_in(page, d, d.key_a)
    page.locator(f'tr[data-job-id="{d.short}"]').get_by_role("checkbox").check()
    page.locator(f'tr[data-job-id="{d.long}"]').get_by_role("checkbox").check()
    page.get_by_role("button", name="Compare selected (2)").click()

    overlay = chart(page, "compare")
    expect(overlay).to_have_attribute("data-series", f"{d.short} {d.long}")
    expect(overlay).to_have_attribute("data-points", str(SHORT_STEPS))  # the first series: the short job's steps
    expect(overlay.locator(".chart-legend li")).to_have_count(2)
    expect(page.get_by_label("Metric")).to_have_value(M.REWARD_MEAN)
    page.get_by_label("Metric").select_option(M.KL_MEAN)
    expect(overlay.locator(".chart-title")).to_have_text(M.KL_MEAN)
    assert "metric=kl%2Fmean" in page.url or "metric=kl/mean" in page.url
    expect(page.locator("table.compare-table tbody tr")).to_have_count(2)
    screenshot(page, "compare")


def test_a_running_jobs_chart_grows_and_cancel_on_the_page_cancels_the_job(page: Page, deployment: Deployment) -> None:
    d = deployment
    d.wait(d.long, lambda j: j["status"] == "running" and j["current_step"] >= 1, "the long job to run")
    sign_in(page, d, d.key_a)
    go(page, d, f"jobs/{d.long}")
    reward = chart(page, "reward")
    expect(reward).not_to_have_attribute("data-points", "0")
    before = int(reward.get_attribute("data-points") or 0)
    expect(reward).not_to_have_attribute("data-points", str(before), timeout=WAIT_MS)  # polled, no reload
    after = int(reward.get_attribute("data-points") or 0)
    assert after > before
    expect(page.locator(".badge-slot")).to_have_text("running")
    screenshot(page, "job-running")

    # Pause asks the running job to pause at its next checkpoint (far away here); the request shows in the log.
    page.get_by_role("button", name="Pause").click()
    expect(page.locator("ol.events")).to_contain_text("Pause requested", timeout=WAIT_MS)

    page.once("dialog", lambda dialog: dialog.accept())
    page.get_by_role("button", name="Cancel job").click()
    job = d.wait(d.long, lambda j: j["status"] == "cancelled", "the long job to be cancelled", timeout=60)
    assert job["finished_at"] is not None
    expect(page.locator(".badge-slot")).to_have_text("cancelled", timeout=WAIT_MS)
    expect(page.get_by_role("button", name="Cancel job")).to_be_disabled()
    # Running, the cancel is a request the trainer honours within a step; if the pause landed first (the trainer
    # stops after its step in progress), the paused job is cancelled at once. Both end the job cancelled.
    expect(page.locator("ol.events")).to_contain_text(re.compile("Cancellation requested|Fine-tuning job cancelled"))


def test_create_form_shows_the_api_error_next_to_its_field_then_creates_the_job(
    page: Page, deployment: Deployment
) -> None:
    d = deployment
    sign_in(page, d, d.key_a)
    page.get_by_role("link", name="New job").first.click()
    expect(page.get_by_role("heading", name="New fine-tuning job")).to_be_visible()
    expect(page.get_by_label("Base model")).to_have_value("tiny-random")

    page.get_by_label("Upload a training file").set_input_files(d.train_file)
    expect(page.locator(".upload-status").first).to_contain_text("Uploaded train.jsonl as file-")
    file_id = page.get_by_label("Training file", exact=True).input_value()
    assert file_id.startswith("file-")
    uploaded = d.api.get(f"/files/{file_id}").json()
    assert uploaded["filename"] == "train.jsonl" and uploaded["purpose"] == "fine-tune"

    page.get_by_label("Suffix").fill("from-form")
    page.get_by_label("Max steps").fill("2")
    page.get_by_label("Group size").fill("2")
    page.get_by_label("Learning rate").fill("5")  # over the schema's limit of 1
    page.get_by_role("button", name="Create job").click()

    lr = page.get_by_label("Learning rate")
    expect(lr).to_have_attribute("aria-invalid", "true")
    error = page.locator("#f-learning_rate-error")
    expect(error).to_contain_text("less than or equal to 1")
    # next to its field: in the same field block, and named by the input's aria-describedby
    assert page.locator('.field[data-param="method.{m}.hyperparameters.learning_rate"] #f-learning_rate-error').count()
    assert "f-learning_rate-error" in (lr.get_attribute("aria-describedby") or "")
    expect(lr).to_be_focused()
    expect(page.locator(".create-form > .error-box")).to_contain_text("The job was not created")
    screenshot(page, "create-error")

    lr.fill("0.01")
    page.get_by_role("button", name="Create job").click()
    expect(page).to_have_url(re.compile(r"#/jobs/ftjob-\w+$"))
    job_id = page.url.rsplit("/", 1)[1]
    expect(page.get_by_role("heading", name=job_id)).to_be_visible()
    job = d.api.get(f"/fine_tuning/jobs/{job_id}").json()
    hp = job["method"]["grpo"]["hyperparameters"]
    assert (job["suffix"], job["training_file"], hp["learning_rate"], hp["max_steps"]) == (
        "from-form",
        file_id,
        0.01,
        2,
    )
    screenshot(page, "create-done")
    d.api.post(f"/fine_tuning/jobs/{job_id}/cancel")  # keep the worker free for the other tests


def test_tenant_b_sees_none_of_tenant_a_jobs(page: Page, deployment: Deployment) -> None:
    d = deployment
    sign_in(page, d, d.key_a)
    expect(page.locator(f'tr[data-job-id="{d.short}"]')).to_be_visible()
    page.get_by_role("button", name="Sign out").click()
    expect(page.get_by_label("API key")).to_be_visible()

    sign_in(page, d, d.key_b)
    expect(page.get_by_text("No jobs yet.")).to_be_visible()
    expect(page.locator("table.jobs-table tbody tr")).to_have_count(0)
    go(page, d, f"jobs/{d.short}")
    expect(page.get_by_role("heading", name="Job not found")).to_be_visible()
    expect(page.get_by_role("alert")).to_contain_text(f"No such fine-tuning job: '{d.short}'")
    go(page, d, f"compare?jobs={d.short},{d.long}")
    expect(page.locator(".error-box")).to_contain_text(f"No such fine-tuning job: '{d.long}'")
    expect(page.locator('figure[data-chart="compare"]')).to_have_count(0)
    expect(page.locator(".picker-list input")).to_have_count(0)
    assert "short" not in page.locator("main").inner_text()


def test_every_series_the_dashboard_plans_is_in_the_trainers_vocabulary(page: Page, deployment: Deployment) -> None:
    """The chart plan as the browser loads it: every key and band is a name the trainer defines, every family one of
    its families. (An unknown name cannot even load: the plan imports its names from the generated vocabulary.)"""
    page.goto(deployment.dashboard)
    planned = page.evaluate(
        """async () => {
            const { PREFERRED } = await import("./js/metrics.js");
            return {
                keys: PREFERRED.flatMap((c) => c.series.flatMap((s) => (s.band ? [s.key, s.band] : [s.key]))),
                families: PREFERRED.filter((c) => c.family).map((c) => c.family.pattern),
            };
        }"""
    )
    assert len(planned["keys"]) >= 20
    assert [key for key in planned["keys"] if key not in M.METRICS] == []
    assert sorted(planned["families"]) == sorted(family.pattern for family in M.FAMILIES)


def test_chart_plan_puts_the_vocabulary_in_its_charts_and_any_other_numeric_series_under_other_metrics(
    page: Page, deployment: Deployment
) -> None:
    """Fed every name the trainer can emit (all methods at once), the plan draws each preferred chart with its series
    in order; the rest, and a name the dashboard has never heard of, get a chart each under "Other metrics"."""
    names = [*vocabulary_names("acc"), "custom/metric"]
    page.goto(deployment.dashboard)
    plan = page.evaluate(
        """async (names) => {
            const { planCharts } = await import("./js/metrics.js");
            const { preferred, other } = planCharts(names);
            return {
                preferred: preferred.map((c) => [c.id, c.series.map((s) => s.key)]),
                other: other.map((c) => c.id),
            };
        }""",
        names,
    )
    preferred = [
        ["reward", [M.REWARD_MEAN]],  # reward/std is its band
        ["reward-graders", [M.reward_of("acc")]],
        ["val-reward", [M.VAL_REWARD_MEAN, M.reward_of("acc", validation=True)]],
        ["overoptimisation", [M.VAL_OVEROPTIMISATION]],
        [
            "preference-accuracy",
            [M.PREFERENCE_ACCURACY, M.VAL_PREFERENCE_ACCURACY, M.VAL_PREFERENCE_ACCURACY_OF_KIND.name("acc")],
        ],
        [
            "episodes",
            [
                M.EPISODE_TOOL_CALL_RATE,
                M.VAL_EPISODE_TOOL_CALL_RATE,
                M.EPISODE_FORMAT_ERROR_FRAC,
                M.EPISODE_TRUNCATED_FRAC,
            ],
        ],
        ["episode-turns", [M.EPISODE_TURNS_MEAN, M.EPISODE_TOOL_CALLS_MEAN]],
        ["tool-calls", [M.TOOL_CALLS_OF.name("acc")]],
        ["tool-errors", [M.TOOL_ERROR_RATE, M.TOOL_ERRORS_OF.name("acc")]],
        ["tool-latency", [M.TOOL_LATENCY_MEAN, M.TOOL_LATENCY_OF.name("acc")]],
        ["non-score-reward", [M.NON_SCORE_REWARD]],
        ["kl", [M.KL_MEAN]],
        ["entropy", [M.ENTROPY_MEAN]],
        ["clip-frac", [M.CLIP_FRAC_LOW, M.CLIP_FRAC_HIGH, M.CLIP_FRAC_DUAL]],
        ["completion-len", [M.COMPLETION_LEN_MEAN, M.COMPLETION_LEN_MAX]],
        ["loss-policy", [M.LOSS_POLICY]],
        ["loss-value", [M.LOSS_VALUE]],
        ["loss", [M.LOSS_TOTAL, M.VAL_LOSS]],
        ["value", [M.VALUE_MEAN, M.RETURNS_MEAN]],
        ["value-explained-variance", [M.EXPLAINED_VARIANCE]],
        ["value-clip-frac", [M.VALUE_CLIP_FRAC]],
        ["throughput", [M.TOKENS_PER_S_GENERATION, M.TOKENS_PER_S_TRAINING]],
    ]
    assert plan["preferred"] == preferred
    charted = {key for _, keys in preferred for key in keys} | {M.REWARD_STD}
    assert plan["other"] == [f"metric:{name}" for name in sorted(set(names) - charted)]
    assert f"metric:{M.PREFERENCE_MARGIN}" in plan["other"] and "metric:custom/metric" in plan["other"]


def test_the_create_form_offers_every_grader_type_as_a_template_the_server_checks(
    page: Page, deployment: Deployment
) -> None:
    d = deployment
    sign_in(page, d, d.key_a)
    page.get_by_role("link", name="New job").first.click()
    picker = page.get_by_label("Start the grader from a template")
    offered = picker.locator("option").all_inner_texts()[1:]
    assert set(offered) == {
        "string_check",
        "text_similarity",
        "python",
        "score_model",
        "label_model",
        "endpoint",
        "multi",
        "numeric_match",
        "regex",
        "length_penalty",
    }
    grader = page.get_by_label("Grader (JSON)")
    check = page.get_by_role("button", name="Check grader")

    # Every pure template and the python one (checked in the sandbox) is valid as it stands.
    for kind in ("string_check", "text_similarity", "python", "multi", "numeric_match", "regex", "length_penalty"):
        picker.select_option(kind)
        assert json.loads(grader.input_value())["type"] == kind
        check.click()
        expect(page.locator(".ok")).to_have_text("The grader is valid.")
        page.locator(".ok").evaluate("el => { el.textContent = '' }")

    # A model grader on a deployment without a judge: the server's 400 next to the field says what is missing.
    picker.select_option("score_model")
    body = json.loads(grader.input_value())
    assert body["type"] == "score_model" and body["range"] == [0, 1]
    check.click()
    expect(page.locator("#f-grader-error")).to_contain_text("this deployment has no judge configured")
    expect(grader).to_have_attribute("aria-invalid", "true")
