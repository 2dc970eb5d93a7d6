"""Defaults that fit the model, over the real app and PostgreSQL: every method on every offered
model created with all its hyperparameters left at their defaults gets lengths that fit the model's context; a given
length that cannot fit is a 400 naming it; the worker's ``validating_files`` fits the defaults to the longest prompt
(recorded in the job and an event) and fails a prompt that cannot fit, naming its line.

The offered models: tiny-arith (a context of 64 tokens), a second model whose config says 2048 (built here, its
config and tiny-arith's tokenizer), and one not built on this machine (its context unknown to the API).
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from api.services.model_limits import length_fields
from tests.integration.conftest import (
    GRADER,
    MAX_UPLOAD_BYTES,
    assert_error,
    http_client,
    job_body,
    jsonl,
    make_tenant,
    prompts,
    serve,
    upload,
    validate,
)
from trainer.spec.config import METHODS, RL_METHODS

WIDE, UNBUILT = "tiny-wide", "not-built-here"
CONTEXT = {"tiny-arith": 64, WIDE: 2048}
TINY_ARITH_PROMPT = 43  # 64 split in the defaults' ratio 512 : 256
TINY_ARITH_COMPLETION = 21


def expected_lengths(method: str, context: int) -> dict[str, int]:
    if method in RL_METHODS:
        return (
            {"max_prompt_tokens": 512, "max_completion_tokens": 256}
            if context >= 768
            else {"max_prompt_tokens": TINY_ARITH_PROMPT, "max_completion_tokens": TINY_ARITH_COMPLETION}
        )
    return {"max_length": min(1024, context)}


@pytest.fixture(scope="module")
def wide_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A second model with a context of 2048: a Llama config and the tiny-arith tokenizer (no weights: neither the
    API nor the validation phase loads any)."""
    from transformers import LlamaConfig

    from trainer.builtin_models.tiny_arith import build_tokenizer

    out = tmp_path_factory.mktemp("tiny-wide")
    tok = build_tokenizer()
    tok.save_pretrained(out)
    LlamaConfig(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=CONTEXT[WIDE],
    ).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def fit_settings(
    settings: Any, tmp_path_factory: pytest.TempPathFactory, tiny_arith_dir: Path, wide_model_dir: Path
) -> Any:
    """The session's backends (its database, broker and artifact store: the session's app's jobs validate here
    too), with a model store holding tiny-arith and the second model."""
    from api.settings import Settings

    home = tmp_path_factory.mktemp("fit-home")
    (home / "models").mkdir()
    (home / "models" / "tiny-arith").symlink_to(tiny_arith_dir)
    (home / "models" / WIDE).symlink_to(wide_model_dir)
    return Settings(
        home=home,
        database_url=settings.database_url,
        broker_url=settings.broker_url,
        artifacts=settings.artifacts,
        base_models=["tiny-arith", WIDE, UNBUILT],
        max_upload_bytes=MAX_UPLOAD_BYTES,
    )


@pytest.fixture(scope="module")
def fit_api(fit_settings: Any) -> Iterator[httpx.Client]:
    from api.app import create_app

    tenant = make_tenant(fit_settings, f"fit-{secrets.token_hex(3)}")
    with serve(create_app(fit_settings)) as url, http_client(url, tenant.key) as client:
        yield client


@pytest.fixture(scope="module")
def data_file(fit_api: httpx.Client) -> str:
    """A dataset file (its lines are the worker's to check: any method's job can name it at creation)."""
    response = upload(fit_api, jsonl(prompts()))
    assert response.status_code == 200, response.text
    return str(response.json()["id"])


def method_body(method: str, hp: dict[str, Any] | None = None, *, key: str | None = None) -> dict[str, Any]:
    key = key or method
    block: dict[str, Any] = {"hyperparameters": hp or {}}
    if method in RL_METHODS:
        block["grader"] = GRADER
    return {"type": key, key: block}


def create(client: httpx.Client, model: str, training_file: str, method: dict[str, Any]) -> httpx.Response:
    return client.post("/v1/fine_tuning/jobs", json={"model": model, "training_file": training_file, "method": method})


def creation_event(client: httpx.Client, job_id: str) -> dict[str, Any]:
    events = client.get(f"/v1/fine_tuning/jobs/{job_id}/events").json()["data"]
    event: dict[str, Any] = next(e for e in events if e["message"] == "Created fine-tuning job")
    return event


def job_count(client: httpx.Client) -> int:
    return len(client.get("/v1/fine_tuning/jobs", params={"limit": 1000}).json()["data"])


class TestCreateWithDefaults:
    @pytest.mark.parametrize("model", ["tiny-arith", WIDE])
    @pytest.mark.parametrize("method", METHODS)
    def test_every_default_left_gives_lengths_that_fit_the_models_context(
        self, fit_api: httpx.Client, data_file: str, model: str, method: str
    ) -> None:
        response = create(fit_api, model, data_file, method_body(method))
        assert response.status_code == 200, response.text
        job = response.json()
        assert job["status"] == "validating_files"
        hp = job["method"][method]["hyperparameters"]
        expected = expected_lengths(method, CONTEXT[model])
        assert {f: hp[f] for f in length_fields(method)} == expected
        # The job as read back shows the same resolved values (OpenAI's job shows what it trains with).
        assert fit_api.get(f"/v1/fine_tuning/jobs/{job['id']}").json()["method"] == job["method"]
        assert creation_event(fit_api, job["id"])["data"] == {
            "length_defaults": expected,
            "context_tokens": CONTEXT[model],
        }

    @pytest.mark.parametrize("method", ["grpo", "supervised"])
    def test_a_model_whose_config_the_api_cannot_read_keeps_its_defaults_for_the_worker_to_fit(
        self, fit_api: httpx.Client, data_file: str, method: str
    ) -> None:
        response = create(fit_api, UNBUILT, data_file, method_body(method))
        assert response.status_code == 200, response.text
        hp = response.json()["method"][method]["hyperparameters"]
        expected = expected_lengths(method, 1_000_000)
        assert {f: hp[f] for f in length_fields(method)} == expected
        assert creation_event(fit_api, response.json()["id"])["data"] == {
            "length_defaults": expected,
            "context_tokens": None,
        }

    def test_a_given_length_that_fits_is_kept_and_the_other_default_takes_what_is_left(
        self, fit_api: httpx.Client, data_file: str
    ) -> None:
        response = create(fit_api, "tiny-arith", data_file, method_body("grpo", {"max_completion_tokens": 8}))
        assert response.status_code == 200, response.text
        hp = response.json()["method"]["grpo"]["hyperparameters"]
        assert (hp["max_prompt_tokens"], hp["max_completion_tokens"]) == (56, 8)
        assert creation_event(fit_api, response.json()["id"])["data"] == {
            "length_defaults": {"max_prompt_tokens": 56},
            "context_tokens": 64,
        }


class TestCreateWithLengthsThatCannotFit:
    @pytest.mark.parametrize("model", ["tiny-arith", WIDE])
    @pytest.mark.parametrize("method", METHODS)
    def test_a_given_length_beyond_the_context_is_a_400_naming_it_and_no_job(
        self, fit_api: httpx.Client, data_file: str, model: str, method: str
    ) -> None:
        context = CONTEXT[model]
        # An RL completion of the whole context leaves no room for a prompt; max_length may be the context at most.
        field, value = ("max_completion_tokens", context) if method in RL_METHODS else ("max_length", context + 1)
        before = job_count(fit_api)
        response = create(fit_api, model, data_file, method_body(method, {field: value}))
        assert_error(
            response,
            400,
            param=f"method.{method}.hyperparameters.{field}",
            code="context_length_exceeded",
            message_contains=f"context of {context} tokens",
        )
        assert job_count(fit_api) == before

    def test_a_prompt_and_a_completion_given_that_together_exceed_the_context_name_the_completion(
        self, fit_api: httpx.Client, data_file: str
    ) -> None:
        hp = {"max_prompt_tokens": 40, "max_completion_tokens": 30}
        error = assert_error(
            create(fit_api, "tiny-arith", data_file, method_body("grpo", hp)),
            400,
            param="method.grpo.hyperparameters.max_completion_tokens",
            code="context_length_exceeded",
        )
        assert "40 + max_completion_tokens 30 = 70 tokens exceed the model's context of 64 tokens" in error["message"]

    def test_openais_reinforcement_key_is_the_one_named(self, fit_api: httpx.Client, data_file: str) -> None:
        body = method_body("grpo", {"max_completion_tokens": 100}, key="reinforcement")
        assert_error(
            create(fit_api, "tiny-arith", data_file, body),
            400,
            param="method.reinforcement.hyperparameters.max_completion_tokens",
            code="context_length_exceeded",
        )

    def test_a_min_completion_that_leaves_no_room_is_named(self, fit_api: httpx.Client, data_file: str) -> None:
        assert_error(
            create(fit_api, "tiny-arith", data_file, method_body("grpo", {"min_completion_tokens": 64})),
            400,
            param="method.grpo.hyperparameters.min_completion_tokens",
            code="context_length_exceeded",
        )


# -- the worker's validating_files ---------------------------------------------------------------------------------


def prompt_tokens(model_dir: Path, content: str) -> int:
    """A prompt's tokens as the RL loop encodes it (the trainer's encoder: the oracle here)."""
    from trainer.generation.encoding import encode_prompts
    from trainer.generation.models import load_tokenizer
    from trainer.spec.data import PromptItem

    tok = load_tokenizer(str(model_dir))
    return len(
        encode_prompts(tok, [PromptItem(messages=[{"role": "user", "content": content}])], max_prompt_tokens=10**6)[0]
    )


def long_prompt(model_dir: Path, *, at_least: int) -> tuple[str, int]:
    """An addition of enough terms to be at least ``at_least`` tokens, and its length."""
    content = "What is 1 + 1?"
    while (n := prompt_tokens(model_dir, content)) < at_least:
        content = content[:-1] + " + 1?"
    return content, n


def dataset_with(content: str) -> bytes:
    rows = prompts(4)
    rows.insert(2, {"messages": [{"role": "user", "content": content}], "answer": "0"})  # line 3
    return jsonl(rows)


def job_events(client: httpx.Client, job_id: str) -> list[dict[str, Any]]:
    return list(client.get(f"/v1/fine_tuning/jobs/{job_id}/events").json()["data"])


class TestValidationFitsTheDefaultsToTheData:
    def test_a_prompt_longer_than_the_default_budget_grows_it_and_shrinks_the_default_completion(
        self, fit_api: httpx.Client, fit_settings: Any, tiny_arith_dir: Path
    ) -> None:
        content, n = long_prompt(tiny_arith_dir, at_least=TINY_ARITH_PROMPT + 1)
        assert n < 63, "the test needs a prompt that leaves room for a completion"
        file_id = upload(fit_api, dataset_with(content)).json()["id"]
        job = create(fit_api, "tiny-arith", file_id, method_body("grpo")).json()
        assert validate(fit_settings, job["id"]) == "queued"
        after = fit_api.get(f"/v1/fine_tuning/jobs/{job['id']}").json()
        assert after["status"] == "queued"
        hp = after["method"]["grpo"]["hyperparameters"]
        assert (hp["max_prompt_tokens"], hp["max_completion_tokens"]) == (n, 64 - n)
        fitted = next(e for e in job_events(fit_api, job["id"]) if e["message"].startswith("Length defaults fitted"))
        assert fitted["data"] == {"max_prompt_tokens": n, "max_completion_tokens": 64 - n}
        assert f"longest prompt ({n} tokens, training file {file_id}, line 3)" in fitted["message"]
        assert f"max_completion_tokens {TINY_ARITH_COMPLETION} → {64 - n}" in fitted["message"]

    def test_short_prompts_change_nothing(self, fit_api: httpx.Client, fit_settings: Any, data_file: str) -> None:
        job = create(fit_api, "tiny-arith", data_file, method_body("grpo")).json()
        assert validate(fit_settings, job["id"]) == "queued"
        after = fit_api.get(f"/v1/fine_tuning/jobs/{job['id']}").json()
        assert after["method"] == job["method"]
        assert not [e for e in job_events(fit_api, job["id"]) if e["message"].startswith("Length defaults fitted")]

    def test_a_prompt_too_long_for_a_given_completion_fails_the_job_naming_the_line(
        self, fit_api: httpx.Client, fit_settings: Any, tiny_arith_dir: Path
    ) -> None:
        content, n = long_prompt(tiny_arith_dir, at_least=50)
        file_id = upload(fit_api, dataset_with(content)).json()["id"]
        job = create(fit_api, "tiny-arith", file_id, method_body("grpo", {"max_completion_tokens": 20})).json()
        assert job["method"]["grpo"]["hyperparameters"]["max_prompt_tokens"] == 44
        assert validate(fit_settings, job["id"]) == "failed"
        error = fit_api.get(f"/v1/fine_tuning/jobs/{job['id']}").json()["error"]
        assert error["code"] == "invalid_file" and error["param"] == "training_file"
        assert error["message"].startswith(f"training file {file_id}, line 3: the prompt is {n} tokens: with ")
        assert "max_completion_tokens 20 that exceeds the model's context of 64 tokens" in error["message"]

    def test_a_prompt_that_fills_the_context_fails_the_job_naming_the_line(
        self, fit_api: httpx.Client, fit_settings: Any, tiny_arith_dir: Path
    ) -> None:
        content, n = long_prompt(tiny_arith_dir, at_least=64)
        file_id = upload(fit_api, dataset_with(content)).json()["id"]
        job = create(fit_api, "tiny-arith", file_id, method_body("grpo")).json()
        assert validate(fit_settings, job["id"]) == "failed"
        error = fit_api.get(f"/v1/fine_tuning/jobs/{job['id']}").json()["error"]
        assert error["code"] == "invalid_file"
        assert error["message"].startswith(f"training file {file_id}, line 3: the prompt is {n} tokens: the model's ")


class TestValidationChecksPairsAndConversations:
    @pytest.mark.parametrize("method", ["supervised", "dpo"])
    def test_an_example_longer_than_max_length_fails_the_job_naming_the_line(
        self, fit_api: httpx.Client, fit_settings: Any, tiny_arith_dir: Path, method: str
    ) -> None:
        content, _ = long_prompt(tiny_arith_dir, at_least=64)  # beyond max_length, which defaults to the context
        if method == "supervised":
            rows: list[dict[str, Any]] = [
                {"messages": [{"role": "user", "content": f"What is {i} + 1?"}, {"role": "assistant", "content": "1"}]}
                for i in range(3)
            ]
            rows.insert(1, {"messages": [{"role": "user", "content": content}, {"role": "assistant", "content": "9"}]})
        else:
            pair = {"preferred_output": [{"role": "assistant", "content": "2"}]}
            pair["non_preferred_output"] = [{"role": "assistant", "content": "3"}]
            rows = [{"input": {"messages": [{"role": "user", "content": "What is 1 + 1?"}]}, **pair} for _ in range(3)]
            rows.insert(1, {"input": {"messages": [{"role": "user", "content": content}]}, **pair})
        file_id = upload(fit_api, jsonl(rows)).json()["id"]
        job = create(fit_api, "tiny-arith", file_id, method_body(method)).json()
        assert job["method"][method]["hyperparameters"]["max_length"] == 64
        assert validate(fit_settings, job["id"]) == "failed"
        error = fit_api.get(f"/v1/fine_tuning/jobs/{job['id']}").json()["error"]
        assert error["code"] == "invalid_file" and error["param"] == "training_file"
        assert error["message"].startswith(f"training file {file_id}, line 2: ")
        assert "more than max_length = 64; shorten it or raise max_length" in error["message"]

    @pytest.mark.parametrize("method", ["supervised", "dpo"])
    def test_examples_within_max_length_are_queued(self, fit_api: httpx.Client, fit_settings: Any, method: str) -> None:
        if method == "supervised":
            rows: list[dict[str, Any]] = [
                {"messages": [{"role": "user", "content": f"What is {i} + 1?"}, {"role": "assistant", "content": "1"}]}
                for i in range(3)
            ]
        else:
            rows = [
                {
                    "input": {"messages": [{"role": "user", "content": "What is 1 + 1?"}]},
                    "preferred_output": [{"role": "assistant", "content": "2"}],
                    "non_preferred_output": [{"role": "assistant", "content": "3"}],
                }
            ]
        file_id = upload(fit_api, jsonl(rows)).json()["id"]
        job = create(fit_api, "tiny-arith", file_id, method_body(method)).json()
        assert validate(fit_settings, job["id"]) == "queued"


class TestValidationFitsWhatTheApiCouldNot:
    """The session's app (tests/integration/conftest.py) has no model store: the context is unknown at creation, and
    the worker, which has the model, fits the defaults (and checks the lengths given) in ``validating_files``."""

    def test_the_worker_resolves_the_defaults_against_the_context(
        self, api: httpx.Client, training_file: str, fit_settings: Any
    ) -> None:
        job = api.post("/v1/fine_tuning/jobs", json=job_body(training_file)).json()
        assert creation_event(api, job["id"])["data"] == {
            "length_defaults": {"max_prompt_tokens": 512, "max_completion_tokens": 256},
            "context_tokens": None,
        }
        assert validate(fit_settings, job["id"]) == "queued"
        hp = api.get(f"/v1/fine_tuning/jobs/{job['id']}").json()["method"]["grpo"]["hyperparameters"]
        assert (hp["max_prompt_tokens"], hp["max_completion_tokens"]) == (TINY_ARITH_PROMPT, TINY_ARITH_COMPLETION)
        fitted = next(e for e in job_events(api, job["id"]) if e["message"].startswith("Length defaults fitted"))
        assert fitted["message"].startswith("Length defaults fitted to tiny-arith's context of 64 tokens and its ")
        assert fitted["message"].endswith(": max_completion_tokens 256 → 21, max_prompt_tokens 512 → 43")

    def test_a_given_length_that_cannot_fit_fails_the_job_naming_it(
        self, api: httpx.Client, training_file: str, fit_settings: Any
    ) -> None:
        body = job_body(training_file)
        body["method"]["grpo"]["hyperparameters"]["max_completion_tokens"] = 64
        job = api.post("/v1/fine_tuning/jobs", json=body).json()
        assert validate(fit_settings, job["id"]) == "failed"
        error = api.get(f"/v1/fine_tuning/jobs/{job['id']}").json()["error"]
        assert error == {
            "code": "invalid_hyperparameters",
            "message": "max_completion_tokens 64 leaves no room for a prompt in the model's context of 64 tokens "
            "(tiny-arith)",
            "param": "method.grpo.hyperparameters.max_completion_tokens",
        }
