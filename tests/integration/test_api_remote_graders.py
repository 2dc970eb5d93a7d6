"""score_model, label_model, endpoint and cosine graders through the real API: dry-runs call
real local services (tests/remote_grader_servers.py), and validate, run and job creation refuse with a 400 naming
the field what the deployment cannot run: a judge model it does not offer, a model grader without a judge, cosine
without embeddings, an endpoint URL its policy forbids. The session's app has none of them configured; this module
serves a second app on the same database whose settings point at the local services and allow loopback."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import httpx2
import pytest
from openai import OpenAI
from pydantic import SecretStr

from tests.integration.conftest import _record_5xx, assert_error, http_client, job_body, serve
from tests.remote_grader_servers import Servers, letter_cosine

pytestmark = pytest.mark.usefixtures("fresh_remote_graders")  # conftest: each test sees only its requests


RUN = "/v1/fine_tuning/alpha/graders/run"
VALIDATE = "/v1/fine_tuning/alpha/graders/validate"
KEY = "sk-judge-api"
PROMPT = [{"role": "user", "content": "Question: {{item.question}}\nAnswer: {{sample.output_text}}"}]
ITEM = {"question": "What is 23 + 58?", "answer": "81"}
SCORE_MODEL = {"type": "score_model", "name": "judge", "model": "judge-mini", "input": PROMPT}
LABEL_MODEL = {
    "type": "label_model",
    "name": "verdict",
    "model": "judge-mini",
    "input": PROMPT,
    "labels": ["correct", "wrong"],
    "passing_labels": ["correct"],
}
COSINE = {
    "type": "text_similarity",
    "name": "close",
    "input": "{{sample.output_text}}",
    "reference": "{{item.answer}} apples",
    "evaluation_metric": "cosine",
}


def multi(**graders: dict[str, Any]) -> dict[str, Any]:
    return {"type": "multi", "name": "all", "graders": graders, "calculate_output": " + ".join(graders)}


@pytest.fixture(scope="module")
def configured(settings: Any, servers: Servers) -> Any:
    """The session's settings with the local judge and embeddings configured and loopback allowed (http too)."""
    return settings.model_copy(
        update={
            "judge_base_url": servers.judge(),
            "judge_api_key": SecretStr(KEY),
            "judge_models": {"judge-mini": "upstream-mini", "judge-big": "upstream-big"},
            "embeddings_base_url": servers.embeddings(),
            "embeddings_model": "letters-1",
            "grader_url_schemes": ["http", "https"],
            "grader_url_allow_networks": ["127.0.0.0/8"],
            "grader_http_max_retries": 1,
        }
    )


@pytest.fixture(scope="module")
def remote_base_url(configured: Any) -> Iterator[str]:
    from api.app import create_app

    with serve(create_app(configured)) as url:
        yield url


@contextmanager
def client_with_judge(configured: Any, judge_url: str, key: str) -> Iterator[httpx.Client]:
    """A client of an app whose deployment's judge is at `judge_url` (one that answers badly, say)."""
    from api.app import create_app

    app = create_app(configured.model_copy(update={"judge_base_url": judge_url}))
    with serve(app) as url, http_client(url, key) as client:
        yield client


@pytest.fixture
def remote(remote_base_url: str, tenant_a: Any) -> Iterator[httpx.Client]:
    """The tenant's client on the app whose deployment has a judge, embeddings and loopback allowed."""
    with http_client(remote_base_url, tenant_a.key) as client:
        yield client


class TestRun:
    def test_a_score_model_scores_what_the_judge_answers_with_its_token_usage(
        self, remote: httpx.Client, servers: Servers
    ) -> None:
        r = remote.post(RUN, json={"grader": SCORE_MODEL, "model_sample": "71", "item": ITEM})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["reward"] == 0.5 and body["sub_rewards"] == {"judge": 0.5}  # one digit of 81 in "71"
        metadata = body["metadata"]
        assert (metadata["name"], metadata["type"]) == ("judge", "score_model")
        assert not any(metadata["errors"].values()) and metadata["error_messages"] == []
        assert metadata["token_usage"] == 15 and metadata["sampled_model_name"] == "judge-mini"
        usage = {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}
        assert body["model_grader_token_usage_per_model"] == {"judge-mini": usage}
        [request] = servers.state.to("/judge/sum")
        assert request.body["model"] == "upstream-mini" and request.headers["authorization"] == f"Bearer {KEY}"
        assert request.body["messages"] == [{"role": "user", "content": "Question: What is 23 + 58?\nAnswer: 71"}]

    def test_a_multi_of_every_remote_grader_and_a_string_check(self, remote: httpx.Client, servers: Servers) -> None:
        grader = multi(
            judge=SCORE_MODEL,
            verdict=LABEL_MODEL,
            ep={"type": "endpoint", "name": "ep", "url": servers.grader(), "headers": {"X-Token": "t"}},
            close=COSINE,
            exact={
                "type": "string_check",
                "name": "exact",
                "input": "{{sample.output_text}}",
                "reference": "{{item.answer}}",
                "operation": "eq",
            },
        )
        r = remote.post(RUN, json={"grader": grader, "model_sample": "81", "item": ITEM})
        assert r.status_code == 200, r.text
        body = r.json()
        close = letter_cosine("81", "81 apples")
        assert body["sub_rewards"] == pytest.approx(
            {"judge": 1.0, "verdict": 1.0, "ep": 1.0, "close": close, "exact": 1.0}
        )
        assert body["reward"] == pytest.approx(4.0 + close)
        assert not any(body["metadata"]["errors"].values())
        assert servers.state.to("/grade/sum")[0].headers["x-token"] == "t"

    @pytest.mark.parametrize(
        ("judge", "flag"),
        [("prose", "model_grader_parse_error"), ("refuse", "model_grader_refusal_error")],
    )
    def test_a_judge_answering_garbage_raises_openais_flag(
        self, configured: Any, tenant_a: Any, servers: Servers, judge: str, flag: str
    ) -> None:
        # a deployment whose judge answers badly: the flag and a reward of 0, never a 5xx
        with client_with_judge(configured, servers.judge(judge), tenant_a.key) as client:
            r = client.post(RUN, json={"grader": SCORE_MODEL, "model_sample": "81", "item": ITEM})
        assert r.status_code == 200, r.text
        errors = r.json()["metadata"]["errors"]
        assert r.json()["reward"] == 0.0 and errors[flag] is True
        assert [k for k, v in errors.items() if v is True] == [flag]

    def test_a_judge_that_is_down_is_a_server_error_flag_with_details(
        self, configured: Any, tenant_a: Any, servers: Servers
    ) -> None:
        with client_with_judge(configured, servers.judge("down"), tenant_a.key) as client:
            r = client.post(RUN, json={"grader": SCORE_MODEL, "model_sample": "81", "item": ITEM})
        assert r.status_code == 200, r.text
        errors = r.json()["metadata"]["errors"]
        assert errors["model_grader_server_error"] is True
        assert errors["model_grader_server_error_details"].startswith(
            "score_model grader 'judge': the judge did not answer (after 2 tries: HTTP 502:"
        )
        assert len(servers.state.to("/judge/down")) == 2  # the dry-run's one retry

    def test_an_endpoint_answering_garbage_is_other_error_and_a_failing_one_unresponsive(
        self, remote: httpx.Client, servers: Servers
    ) -> None:
        garbage = {"type": "endpoint", "name": "ep", "url": servers.grader("garbage")}
        r = remote.post(RUN, json={"grader": garbage, "model_sample": "81", "item": ITEM})
        assert r.status_code == 200 and r.json()["reward"] == 0.0
        assert r.json()["metadata"]["errors"]["other_error"] is True
        forbidden = {**garbage, "url": servers.grader("forbidden")}
        r = remote.post(RUN, json={"grader": forbidden, "model_sample": "81", "item": ITEM})
        assert r.status_code == 200 and r.json()["metadata"]["errors"]["unresponsive_reward_error"] is True
        assert "HTTP 403" in r.json()["metadata"]["error_messages"][0]

    def test_the_official_client_runs_a_score_model_grader(self, remote_base_url: str, tenant_a: Any) -> None:
        http = httpx2.Client(event_hooks={"response": [_record_5xx]}, timeout=30)
        with OpenAI(base_url=f"{remote_base_url}/v1", api_key=tenant_a.key, max_retries=0, http_client=http) as c:
            result = c.fine_tuning.alpha.graders.run(grader=SCORE_MODEL, model_sample="81", item=ITEM)  # type: ignore[arg-type]
        assert result.reward == 1.0 and result.metadata.type == "score_model"
        assert result.metadata.errors.api_model_grader_server_error is False  # the SDK's name for the wire's
        assert result.metadata.sampled_model_name == "judge-mini" and result.metadata.token_usage == 15
        assert result.api_model_grader_token_usage_per_model == {
            "judge-mini": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}
        }


class TestValidate:
    def test_a_score_model_is_returned_as_it_will_run(self, remote: httpx.Client) -> None:
        r = remote.post(VALIDATE, json={"grader": SCORE_MODEL})
        assert r.status_code == 200, r.text
        assert r.json()["grader"] == {**SCORE_MODEL, "range": [0.0, 1.0]}

    def test_a_judge_model_the_deployment_does_not_offer_is_a_400_naming_model(self, remote: httpx.Client) -> None:
        r = remote.post(VALIDATE, json={"grader": {**SCORE_MODEL, "model": "gpt-4o"}})
        assert_error(
            r,
            400,
            param="grader.model",
            code="model_not_available",
            message_contains="judge model 'gpt-4o' is not offered by this deployment; offered: judge-big, judge-mini",
        )

    def test_inside_a_multi_the_400_names_the_leaf(self, remote: httpx.Client) -> None:
        r = remote.post(VALIDATE, json={"grader": multi(ok=SCORE_MODEL, bad={**LABEL_MODEL, "model": "x"})})
        assert_error(r, 400, param="grader.graders.bad.model", code="model_not_available")

    def test_without_a_judge_a_model_grader_is_a_400_saying_so(self, api: httpx.Client) -> None:
        for path, body in ((VALIDATE, {}), (RUN, {"model_sample": "1"})):
            r = api.post(path, json={"grader": LABEL_MODEL, **body})
            assert_error(
                r,
                400,
                param="grader.model",
                code="judge_unavailable",
                message_contains="label_model graders need a judge model, and this deployment has no judge configured",
            )

    def test_without_embeddings_cosine_is_a_400_naming_the_metric(self, api: httpx.Client) -> None:
        r = api.post(RUN, json={"grader": multi(close=COSINE), "model_sample": "1"})
        assert_error(r, 400, param="grader.graders.close.evaluation_metric", code="embeddings_unavailable")
        assert "cosine needs an embeddings endpoint" in r.json()["error"]["message"]

    def test_the_default_policy_refuses_an_endpoint_on_loopback_private_or_metadata_addresses(
        self, api: httpx.Client, servers: Servers
    ) -> None:
        for url, why in [
            ("https://127.0.0.1/grade", "127.0.0.1 is a loopback address"),
            ("https://10.0.0.8/grade", "10.0.0.8 is a private address"),
            ("https://169.254.169.254/latest/meta-data/", "169.254.169.254 is a link-local address"),
            ("https://[::ffff:127.0.0.1]/grade", "::ffff:7f00:1 (127.0.0.1) is a loopback address"),
            ("https://localhost/grade", "resolves to"),
            (servers.grader(), "the URL must start with https://"),  # http is not allowed by default
        ]:
            r = api.post(VALIDATE, json={"grader": {"type": "endpoint", "name": "ep", "url": url}})
            assert_error(r, 400, param="grader.url", code="url_not_allowed", message_contains=why)
        assert servers.state.to("/grade") == []

    def test_an_endpoint_whose_host_does_not_resolve_is_a_400(self, remote: httpx.Client) -> None:
        r = remote.post(
            VALIDATE, json={"grader": {"type": "endpoint", "name": "ep", "url": "https://nowhere.invalid/"}}
        )
        assert_error(r, 400, param="grader.url", code="url_not_allowed", message_contains="does not resolve")

    def test_a_malformed_endpoint_is_a_400_naming_the_field(self, remote: httpx.Client) -> None:
        r = remote.post(
            VALIDATE, json={"grader": {"type": "endpoint", "name": "ep", "url": "https://a/", "rate_limit": -1}}
        )
        assert_error(r, 400, param="grader.rate_limit", code="invalid_grader")
        r = remote.post(VALIDATE, json={"grader": {"type": "endpoint", "name": "ep", "url": "https://u:p@a/"}})
        assert_error(r, 400, param="grader.url", code="invalid_grader", message_contains="user name or password")

    def test_an_endpoint_the_policy_allows_is_returned_as_given(self, remote: httpx.Client, servers: Servers) -> None:
        grader = {"type": "endpoint", "name": "ep", "url": servers.grader(), "rate_limit": 10, "pass_threshold": 0.5}
        r = remote.post(VALIDATE, json={"grader": grader})
        assert r.status_code == 200, r.text
        assert r.json()["grader"] == grader
        assert servers.state.to("/grade") == []  # validating calls nothing


class TestJobCreate:
    def test_a_job_with_a_multi_of_remote_graders_is_created(
        self, remote: httpx.Client, training_file: str, servers: Servers
    ) -> None:
        grader = multi(judge=SCORE_MODEL, ep={"type": "endpoint", "name": "ep", "url": servers.grader()})
        body = job_body(training_file)
        body["method"]["grpo"]["grader"] = grader
        r = remote.post("/v1/fine_tuning/jobs", json=body)
        assert r.status_code == 200, r.text
        assert r.json()["method"]["grpo"]["grader"]["graders"]["judge"]["range"] == [0.0, 1.0]

    @pytest.mark.parametrize(
        ("leaf", "param", "code"),
        [
            ({**SCORE_MODEL, "model": "gpt-5"}, "method.grpo.grader.graders.g.model", "model_not_available"),
            (
                {"type": "endpoint", "name": "e", "url": "https://10.1.1.1/"},
                "method.grpo.grader.graders.g.url",
                "url_not_allowed",
            ),
        ],
    )
    def test_a_leaf_the_deployment_cannot_run_is_refused_naming_it(
        self, remote: httpx.Client, training_file: str, leaf: dict[str, Any], param: str, code: str
    ) -> None:
        body = job_body(training_file)
        body["method"]["grpo"]["grader"] = multi(g=leaf)
        assert_error(remote.post("/v1/fine_tuning/jobs", json=body), 400, param=param, code=code)

    def test_without_a_judge_or_embeddings_a_job_is_refused(self, api: httpx.Client, training_file: str) -> None:
        for grader, param, code in [
            (SCORE_MODEL, "method.grpo.grader.model", "judge_unavailable"),
            (COSINE, "method.grpo.grader.evaluation_metric", "embeddings_unavailable"),
        ]:
            body = job_body(training_file)
            body["method"]["grpo"]["grader"] = grader
            assert_error(api.post("/v1/fine_tuning/jobs", json=body), 400, param=param, code=code)
