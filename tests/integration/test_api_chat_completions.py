"""``POST /v1/chat/completions`` and ``POST /v1/completions`` through the official ``openai`` client, against the real
app and the real inference server (``proxima inference`` on tiny-arith, its own process).

The answers are checked against the model itself: at temperature 0 the API's text is what greedy decoding of the same
tokens gives in this process (transformers' ``generate``), for the base model and, with a PEFT adapter made here (its
B matrices non-zero, so it changes answers), for a fine-tuned model and a checkpoint of tenant B. Another tenant's
model and an unknown one are OpenAI's 404 ``model_not_found``; bad parameters are 400s naming them; the inference
server down is a 503.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import httpx2
import jsonschema
import openai
import pytest
import torch
from openai import OpenAI
from pydantic import SecretStr

from tests.integration.conftest import (
    _record_5xx,
    add_checkpoint,
    assert_error,
    free_port,
    http_client,
    job_body,
    jsonl,
    prompts,
    serve,
    set_job,
    upload,
    validate,
)

INFERENCE_KEY = "sk-inference-test-key"
MODEL = "tiny-arith"
MAX_TOKENS = 4  # tiny-arith answers a sum in at most three digits and its end token
QUESTIONS = ["What is 23 + 58?", "What is 57 + 68?", "What is 4 + 5?", "What is 90 + 19?"]


# -- the inference server -------------------------------------------------------------------------------------


class InferenceServer:
    """``python -m proxima.cli inference`` on a free port, reading adapters from the test service's artifact store."""

    def __init__(self, root: Path, *, artifacts: str, model_dir: Path) -> None:
        home = root / "home"
        (home / "models").mkdir(parents=True)
        (home / "models" / MODEL).symlink_to(model_dir)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = root / "inference.log"
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("PROXIMA_")} | {
            "PROXIMA_HOME": str(home),
            "PROXIMA_ARTIFACTS": artifacts,
            "PROXIMA_BASE_MODELS": json.dumps([MODEL]),
            "PROXIMA_INFERENCE_API_KEY": INFERENCE_KEY,
            "PROXIMA_INFERENCE_PRECISION": "fp32",  # as the greedy decoding here
        }
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 180.0) -> None:
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "proxima.cli", "inference", "--port", str(self.port)],
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        deadline = time.monotonic() + timeout
        while True:
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"proxima inference did not start:\n{self.logs()}")
            time.sleep(0.3)

    def stop(self) -> None:
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=30)
        except ProcessLookupError:
            pass
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.proc = None

    def logs(self) -> str:
        return self.log_path.read_text(errors="replace")[-6000:] if self.log_path.exists() else ""


@pytest.fixture(scope="module")
def inference(
    settings: Any, tiny_arith_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[InferenceServer]:
    server = InferenceServer(
        tmp_path_factory.mktemp("inference"), artifacts=settings.artifacts_url, model_dir=tiny_arith_dir
    )
    try:
        server.start()
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def chat_base(settings: Any, inference: InferenceServer) -> Iterator[str]:
    """The app pointed at the inference server (the session's app has none: see the 503 test)."""
    from api.app import create_app

    pointed = settings.model_copy(
        update={"inference_url": inference.url, "inference_api_key": SecretStr(INFERENCE_KEY)}
    )
    with serve(create_app(pointed)) as url:
        yield url


def openai_client(base: str, key: str) -> OpenAI:
    http = httpx2.Client(event_hooks={"response": [_record_5xx]}, timeout=60)  # the client openai is built on
    return OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0, http_client=http)


@pytest.fixture
def client_a(chat_base: str, tenant_a: Any) -> Iterator[OpenAI]:
    with openai_client(chat_base, tenant_a.key) as c:
        yield c


@pytest.fixture
def client_b(chat_base: str, tenant_b: Any) -> Iterator[OpenAI]:
    with openai_client(chat_base, tenant_b.key) as c:
        yield c


# -- the model, decoded here ----------------------------------------------------------------------------------


class Greedy:
    """Greedy decoding in this process: what the API must answer at temperature 0."""

    def __init__(self, model_dir: Path) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    def prompt_ids(self, text: str) -> list[int]:
        ids = self.tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
        )
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # transformers 5 answers a BatchEncoding
            ids = ids["input_ids"]
        return list(ids)

    def answer(self, model: torch.nn.Module, text: str) -> str:
        ids = torch.tensor([self.prompt_ids(text)])
        with torch.no_grad():
            out = model.generate(  # type: ignore[operator]
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=MAX_TOKENS,
                do_sample=False,
                pad_token_id=self.tokenizer.pad_token_id,
                eos_token_id=self.tokenizer.eos_token_id,
            )
        return str(self.tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True))


@pytest.fixture(scope="module")
def greedy(tiny_arith_dir: Path) -> Greedy:
    return Greedy(tiny_arith_dir)


# -- tenant B's fine-tuned model and checkpoint ---------------------------------------------------------------


class Tuned:
    def __init__(self, job_id: str, name: str, checkpoint_name: str, answers: dict[str, str]) -> None:
        self.job_id, self.name, self.checkpoint_name, self.answers = job_id, name, checkpoint_name, answers


@pytest.fixture(scope="module")
def tuned(
    base_url: str,
    settings: Any,
    tenant_b: Any,
    artifact_store: Any,
    greedy: Greedy,
    tmp_path_factory: pytest.TempPathFactory,
) -> Tuned:
    """A succeeded job of tenant B whose final adapter and step-2 checkpoint are a real PEFT adapter of tiny-arith
    (written here as a worker writes them: the result file ``<job>-adapter.tar.gz``, ``<checkpoint>/adapter.tar.gz``),
    and that adapter's greedy answers to QUESTIONS."""
    from api import ids
    from api.db import session_scope
    from api.orm import File
    from trainer.generation.models import add_lora
    from trainer.loops.checkpoint import archive_adapter
    from trainer.spec.lora import LoraSpec

    out = tmp_path_factory.mktemp("adapter")
    model = add_lora(greedy.base, LoraSpec(r=4, alpha=8), seed=0)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    model.save_pretrained(out / "adapter")
    answers = {q: greedy.answer(model, q) for q in QUESTIONS}
    model.unload()  # the base module again, without LoRA layers, for the other tests
    archive = archive_adapter(out / "adapter", out / "adapter.tar.gz")

    with http_client(base_url, tenant_b.key) as api_b:
        training = upload(api_b, jsonl(prompts()))
        assert training.status_code == 200, training.text
        created = api_b.post("/v1/fine_tuning/jobs", json=job_body(training.json()["id"]))
        assert created.status_code == 200, created.text
        job_id = created.json()["id"]
        assert validate(settings, job_id) == "queued"
        file_id = ids.file_id()
        key = f"files/{tenant_b.id}/{file_id}.tar.gz"
        size = artifact_store.put_file(key, archive)
        db = lambda: session_scope(settings.db_url)  # noqa: E731
        with db() as s:
            s.add(
                File(
                    id=file_id,
                    tenant_id=tenant_b.id,
                    filename=f"{job_id}-adapter.tar.gz",
                    purpose="fine-tune-results",
                    bytes=size,
                    lines=0,
                    storage_key=key,
                )
            )
        name = ids.fine_tuned_model_name(model=MODEL, tenant_id=tenant_b.id, suffix=None, job_id=job_id)
        set_job(db, job_id, status="succeeded", fine_tuned_model=name, result_files=[file_id], finished_at=0)
        add_checkpoint(db, artifact_store, job_id, step=2, archive=archive.read_bytes())
        checkpoints = api_b.get(f"/v1/fine_tuning/jobs/{job_id}/checkpoints").json()["data"]
    assert answers != {q: greedy.answer(greedy.base, q) for q in QUESTIONS}, "the adapter must change some answer"
    return Tuned(job_id, name, checkpoints[0]["fine_tuned_model_checkpoint"], answers)


def ask(client: OpenAI, model: str, question: str, **kw: Any) -> Any:
    return client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": question}], temperature=0, max_tokens=MAX_TOKENS, **kw
    )


# -- base model -----------------------------------------------------------------------------------------------


class TestBaseModel:
    def test_chat_completion_is_greedy_decoding_at_temperature_0(self, client_a: OpenAI, greedy: Greedy) -> None:
        for question in QUESTIONS:
            completion = ask(client_a, MODEL, question)
            assert completion.object == "chat.completion" and completion.model == MODEL
            assert len(completion.choices) == 1
            choice = completion.choices[0]
            assert choice.index == 0 and choice.message.role == "assistant"
            assert choice.message.content == greedy.answer(greedy.base, question), question
            assert choice.finish_reason == "stop"  # an answer ends with the end token within MAX_TOKENS
            usage = completion.usage
            assert usage is not None
            assert usage.prompt_tokens == len(greedy.prompt_ids(question))
            # the answer's tokens and its end token
            assert (
                usage.completion_tokens
                == len(greedy.tokenizer(choice.message.content, add_special_tokens=False).input_ids) + 1
            )
            assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens

    def test_streamed_chunks_join_to_the_same_answer_with_usage_last(self, client_a: OpenAI, greedy: Greedy) -> None:
        question = QUESTIONS[0]
        chunks = list(ask(client_a, MODEL, question, stream=True, stream_options={"include_usage": True}))
        assert len(chunks) >= 3  # the role, at least one piece of text, the finish, the usage
        assert {c.object for c in chunks} == {"chat.completion.chunk"}
        assert {c.model for c in chunks} == {MODEL}
        assert len({c.id for c in chunks}) == 1
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == greedy.answer(greedy.base, question)
        finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        assert finishes == ["stop"]
        assert chunks[-1].choices == [] and chunks[-1].usage is not None
        assert chunks[-1].usage.prompt_tokens == len(greedy.prompt_ids(question))

    def test_text_completion_of_a_plain_prompt(self, client_a: OpenAI, greedy: Greedy) -> None:
        question = QUESTIONS[1]
        completion = client_a.completions.create(model=MODEL, prompt=question, temperature=0, max_tokens=MAX_TOKENS)
        assert completion.object == "text_completion" and completion.model == MODEL
        # tiny-arith's chat template adds nothing around a user turn: the plain prompt is the same tokens
        assert completion.choices[0].text == greedy.answer(greedy.base, question)
        assert completion.usage is not None and completion.usage.prompt_tokens == len(greedy.prompt_ids(question))

    def test_streamed_text_completion(self, client_a: OpenAI, greedy: Greedy) -> None:
        question = QUESTIONS[2]
        chunks = list(
            client_a.completions.create(model=MODEL, prompt=question, temperature=0, max_tokens=MAX_TOKENS, stream=True)
        )
        assert {c.model for c in chunks} == {MODEL}
        assert "".join(c.choices[0].text for c in chunks if c.choices) == greedy.answer(greedy.base, question)

    def test_n_samples_with_one_seed_are_the_same_twice(self, client_a: OpenAI) -> None:
        def sample() -> list[str]:
            completion = client_a.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": QUESTIONS[1]}],
                temperature=1.0,
                n=4,
                seed=1234,
                max_completion_tokens=MAX_TOKENS,
            )
            assert [c.index for c in completion.choices] == [0, 1, 2, 3]
            return [c.message.content or "" for c in completion.choices]

        assert sample() == sample()

    def test_max_tokens_cuts_the_answer_with_finish_reason_length(self, client_a: OpenAI, greedy: Greedy) -> None:
        completion = client_a.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": QUESTIONS[0]}], temperature=0, max_tokens=1
        )
        choice = completion.choices[0]
        assert choice.finish_reason == "length"
        assert choice.message.content == greedy.answer(greedy.base, QUESTIONS[0])[:1]
        assert completion.usage is not None and completion.usage.completion_tokens == 1

    def test_models_lists_what_chat_completions_serve(self, client_a: OpenAI) -> None:
        assert MODEL in [m.id for m in client_a.models.list()]


class TestStructuredOutputs:
    def test_a_strict_json_schema_holds_on_200_samples_at_temperature_1(self, client_a: OpenAI) -> None:
        fmt = {"type": "json_schema", "json_schema": {"name": "sum", "schema": ANSWER_SCHEMA, "strict": True}}
        choices = []
        for seed in (1, 2):  # OpenAI's n is at most 128
            completion = client_a.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": QUESTIONS[1]}],
                temperature=1.0,
                n=100,
                seed=seed,
                max_tokens=5,
                response_format=fmt,  # type: ignore[arg-type]
            )
            choices += completion.choices
        assert [c.finish_reason for c in choices] == ["stop"] * 200  # every answer ended: the grammar let EOS in
        for c in choices:
            jsonschema.validate(json.loads(c.message.content or ""), ANSWER_SCHEMA)

    def test_json_cut_short_by_max_tokens_is_length(self, client_a: OpenAI) -> None:
        fmt = {"type": "json_schema", "json_schema": {"name": "sum", "schema": ANSWER_SCHEMA}}
        completion = client_a.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": QUESTIONS[0]}],
            temperature=0,
            max_tokens=1,
            response_format=fmt,  # type: ignore[arg-type]
        )
        assert completion.choices[0].finish_reason == "length"

    def test_a_format_the_models_vocabulary_cannot_write_is_400(self, client_a: OpenAI) -> None:
        with pytest.raises(openai.BadRequestError) as err:  # tiny-arith has no "{" token
            ask(client_a, MODEL, QUESTIONS[0], response_format={"type": "json_object"})
        assert err.value.param == "response_format" and "vocabulary" in err.value.message

    def test_tools_and_tool_results_are_forwarded_to_the_template(self, client_a: OpenAI, greedy: Greedy) -> None:
        # tiny-arith's template renders the contents alone: a tool result after a call is answered as a prompt
        messages: list[Any] = [
            {"role": "user", "content": "What is "},
            {"role": "assistant", "content": None, "tool_calls": [CALL]},
            {"role": "tool", "tool_call_id": "call_1", "content": "4 + 5?"},
        ]
        completion = client_a.chat.completions.create(
            model=MODEL,
            messages=messages,
            tools=[TOOL],
            temperature=0,
            max_tokens=MAX_TOKENS,  # type: ignore[list-item]
        )
        choice = completion.choices[0]
        assert choice.message.content == greedy.answer(greedy.base, QUESTIONS[2]) and choice.finish_reason == "stop"
        assert choice.message.tool_calls is None


# -- fine-tuned models and checkpoints ------------------------------------------------------------------------


class TestFineTunedModels:
    def test_the_tenants_fine_tuned_model_answers_with_its_adapter(self, client_b: OpenAI, tuned: Tuned) -> None:
        for question, expected in tuned.answers.items():
            completion = ask(client_b, tuned.name, question)
            assert completion.model == tuned.name
            assert completion.choices[0].message.content == expected, question

    def test_a_checkpoint_answers_under_its_checkpoint_name(self, client_b: OpenAI, tuned: Tuned) -> None:
        assert tuned.checkpoint_name == f"{tuned.name}:ckpt-step-2"
        question = QUESTIONS[0]
        completion = ask(client_b, tuned.checkpoint_name, question)
        assert completion.model == tuned.checkpoint_name
        assert completion.choices[0].message.content == tuned.answers[question]
        chunks = list(ask(client_b, tuned.checkpoint_name, question, stream=True))
        assert {c.model for c in chunks} == {tuned.checkpoint_name}
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == tuned.answers[question]

    def test_another_tenants_models_are_not_found(self, client_a: OpenAI, tuned: Tuned) -> None:
        for model in (tuned.name, tuned.checkpoint_name):
            with pytest.raises(openai.NotFoundError) as err:
                ask(client_a, model, QUESTIONS[0])
            assert err.value.code == "model_not_found"
            body: Any = err.value.body
            assert body["message"] == f"The model `{model}` does not exist or you do not have access to it."
            with pytest.raises(openai.NotFoundError):
                client_a.completions.create(model=model, prompt=QUESTIONS[0], max_tokens=2)

    @pytest.mark.parametrize(
        "model",
        [
            "gpt-4o-mini",
            "ft:tiny-arith:org-x::nope",
            "{name}:ckpt-step-3",  # no checkpoint at that step
            "{name}x",  # another job id
            "{name}:ckpt-step-99999999999",
            "ft:tiny-arith:{tenant}:other-suffix:{job}",  # the job's id under another name
        ],
    )
    def test_unknown_models_are_not_found(self, client_b: OpenAI, tuned: Tuned, tenant_b: Any, model: str) -> None:
        model = model.format(name=tuned.name, tenant=tenant_b.id, job=tuned.job_id.removeprefix("ftjob-"))
        with pytest.raises(openai.NotFoundError) as err:
            ask(client_b, model, QUESTIONS[0])
        assert err.value.code == "model_not_found" and model in err.value.message

    def test_the_adapter_is_registered_again_after_the_inference_server_restarts(
        self, client_b: OpenAI, tuned: Tuned, inference: InferenceServer
    ) -> None:
        question = QUESTIONS[3]
        assert ask(client_b, tuned.name, question).choices[0].message.content == tuned.answers[question]
        inference.stop()
        inference.start()  # the same port; it knows no adapter now
        assert ask(client_b, tuned.name, question).choices[0].message.content == tuned.answers[question]


# -- errors ---------------------------------------------------------------------------------------------------


CALL = {"id": "call_1", "type": "function", "function": {"name": "calculator", "arguments": "{}"}}
TOOL = {"type": "function", "function": {"name": "calculator", "parameters": {"type": "object"}}}
ANSWER_SCHEMA = {"type": "integer", "minimum": 0, "maximum": 198}  # tiny-arith's vocabulary writes numbers only


def chat_body(**overrides: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": QUESTIONS[0]}], **overrides}


class TestErrors:
    def test_no_key_is_401(self, chat_base: str) -> None:
        with http_client(chat_base) as anon:
            assert_error(anon.post("/v1/chat/completions", json=chat_body()), 401, code="missing_api_key")
            assert_error(anon.post("/v1/completions", json={"model": MODEL, "prompt": "x"}), 401)
        with http_client(chat_base, "sk-wrong") as wrong:
            assert_error(wrong.post("/v1/chat/completions", json=chat_body()), 401, code="invalid_api_key")

    def test_an_unknown_parameter_is_400_naming_it(self, client_a: OpenAI) -> None:
        with pytest.raises(openai.BadRequestError) as err:
            ask(client_a, MODEL, QUESTIONS[0], extra_body={"frobnicate": True})
        assert err.value.param == "frobnicate" and "frobnicate" in err.value.message

    @pytest.mark.parametrize(
        ("overrides", "param"),
        [
            ({"temperature": 2.5}, "temperature"),
            ({"top_p": 1.5}, "top_p"),
            ({"n": 0}, "n"),
            ({"max_tokens": 0}, "max_tokens"),
            ({"max_completion_tokens": "many"}, "max_completion_tokens"),
            ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
            ({"stop": 7}, "stop"),
            ({"seed": 2**64}, "seed"),
            ({"top_logprobs": 3}, "top_logprobs"),  # without logprobs: true
            ({"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
            ({"stream_options": {"include_usage": True}}, "stream_options"),  # without stream: true
            ({"messages": []}, "messages"),
            ({"messages": [{"role": "function", "content": "x"}]}, "messages.0.role"),
            ({"messages": [{"role": "tool", "content": "x"}]}, "messages.0.tool_call_id"),
            ({"messages": [{"role": "tool", "content": "x", "tool_call_id": "call_1"}]}, "messages.0.tool_call_id"),
            ({"messages": [{"role": "user", "content": None}]}, "messages.0.content"),
            ({"messages": [{"role": "user", "content": "x", "tool_calls": [CALL]}]}, "messages.0.tool_calls"),
            ({"tool_choice": "auto"}, "tool_choice"),  # without tools
            ({"parallel_tool_calls": True}, "parallel_tool_calls"),  # without tools
            ({"tools": [TOOL], "tool_choice": "sometimes"}, "tool_choice"),
            (
                {"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "other"}}},
                "tool_choice.function.name",
            ),
            ({"tools": [TOOL, TOOL]}, "tools.1.function.name"),
            ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools.0.function.name"),
            ({"tools": [{"type": "custom", "function": {"name": "f"}}]}, "tools.0.type"),
            (
                {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "thing"}}}]},
                "tools.0.function.parameters",
            ),
            ({"response_format": {"type": "yaml"}}, "response_format"),
            ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
            (
                {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "thing"}}}},
                "response_format.json_schema.schema",
            ),
            (
                {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"not": {}}}}},
                "response_format.json_schema.schema",
            ),
            (
                {
                    "response_format": {
                        "type": "json_schema",
                        "json_schema": {"name": "x", "schema": {"$ref": "https://x.io/s.json"}},
                    }
                },
                "response_format.json_schema.schema",
            ),
            (
                {"response_format": {"type": "json_schema", "json_schema": {"name": "x/y", "schema": {}}}},
                "response_format.json_schema.name",
            ),
            (
                {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
                "messages.0.content.0.type",
            ),
            ({"messages": [{"role": "user", "content": "a\u0000b"}]}, "messages.0.content"),
            ({"model": 3}, "model"),
        ],
    )
    def test_bad_values_are_400_naming_the_parameter(
        self, chat_base: str, tenant_a: Any, overrides: dict[str, Any], param: str
    ) -> None:
        with http_client(chat_base, tenant_a.key) as api:
            assert_error(api.post("/v1/chat/completions", json=chat_body(**overrides)), 400, param=param)

    def test_completions_take_a_string_prompt_and_int_logprobs(self, chat_base: str, tenant_a: Any) -> None:
        with http_client(chat_base, tenant_a.key) as api:
            body: dict[str, Any] = {"model": MODEL, "prompt": ["a", "b"]}
            assert_error(api.post("/v1/completions", json=body), 400, param="prompt")
            body = {"model": MODEL, "prompt": "a", "logprobs": 6}
            assert_error(api.post("/v1/completions", json=body), 400, param="logprobs")
            assert_error(api.post("/v1/completions", json={"model": MODEL, "messages": []}), 400, param="prompt")

    def test_a_prompt_beyond_the_context_is_400_naming_it(self, client_a: OpenAI) -> None:
        long = " ".join(QUESTIONS * 20)  # tiny-arith's context is 64 tokens
        with pytest.raises(openai.BadRequestError) as err:
            ask(client_a, MODEL, long)
        assert err.value.param == "messages" and err.value.code == "context_length_exceeded"
        with pytest.raises(openai.BadRequestError) as err:
            client_a.completions.create(model=MODEL, prompt=long, max_tokens=4)
        assert err.value.param == "prompt" and err.value.code == "context_length_exceeded"

    def test_logprobs_come_back(self, client_a: OpenAI) -> None:
        completion = ask(client_a, MODEL, QUESTIONS[0], logprobs=True, top_logprobs=2)
        logprobs = completion.choices[0].logprobs
        assert logprobs is not None and logprobs.content is not None
        content = logprobs.content
        assert len(content) >= 1
        assert all(t.logprob <= 0 and len(t.top_logprobs) == 2 for t in content)

    @pytest.mark.expected_5xx(503)
    def test_the_inference_server_down_is_503(self, settings: Any, tenant_a: Any) -> None:
        from api.app import create_app

        nowhere = settings.model_copy(update={"inference_url": f"http://127.0.0.1:{free_port()}"})
        with serve(create_app(nowhere)) as url, http_client(url, tenant_a.key) as api:
            for path, body in (
                ("/v1/chat/completions", chat_body()),
                ("/v1/chat/completions", chat_body(stream=True)),
                ("/v1/completions", {"model": MODEL, "prompt": "x"}),
            ):
                response = api.post(path, json=body)
                assert_error(response, 503, code="inference_unavailable", message_contains="inference server")
                assert response.headers["retry-after"] == "2"
            # a model the caller may not use is still a 404: tenancy is checked before the server is asked
            assert_error(api.post("/v1/chat/completions", json=chat_body(model="ft:x:y::z")), 404)

    @pytest.mark.expected_5xx(503)
    def test_an_inference_server_refusing_the_apis_key_is_503_not_the_callers_401(
        self, settings: Any, tenant_a: Any, inference: InferenceServer
    ) -> None:
        from api.app import create_app

        wrong = settings.model_copy(
            update={"inference_url": inference.url, "inference_api_key": SecretStr("sk-not-the-inference-key")}
        )
        with serve(create_app(wrong)) as url, http_client(url, tenant_a.key) as api:
            error = assert_error(api.post("/v1/chat/completions", json=chat_body()), 503, code="inference_unavailable")
            assert "credentials" in error["message"]

    @pytest.mark.expected_5xx(503)
    def test_without_an_inference_server_configured_it_is_503(self, api: httpx.Client) -> None:
        error = assert_error(api.post("/v1/chat/completions", json=chat_body()), 503, code="inference_unavailable")
        assert "PROXIMA_INFERENCE_URL" in error["message"]


SCHEMATHESIS_CONFIG = """\
[checks.positive_data_acceptance]
expected-statuses = ["2xx", "400", "401", "404"]

[warnings]
fail-on = ["missing_auth", "base_url_mismatch", "unresolvable_reference", "missing_deserializer"]

[dictionaries.models]
values = ["tiny-arith"]

[parameters]
"body.model" = { dictionary = "models", probability = 0.8 }
"""


def test_schemathesis_finds_no_server_error_in_the_completions_against_the_document(
    chat_base: str, tenant_a: Any, tmp_path: Path
) -> None:
    """The two operations fuzzed as tests/integration/test_openapi_contract.py fuzzes the others, but against the
    app pointed at a real inference server, the model mostly one it serves: every answer, generated completions
    included, is what the document says, and none is a 5xx."""
    (tmp_path / "schemathesis.toml").write_text(SCHEMATHESIS_CONFIG)
    command = [
        sys.executable,
        "-m",
        "schemathesis.cli",
        "--config-file",
        str(tmp_path / "schemathesis.toml"),
        "run",
        f"{chat_base}/openapi.json",
        "--include-path-regex",
        "^/v1/(chat/)?completions$",
        "--checks",
        "all",
        "--phases",
        "examples,coverage,fuzzing",
        "--generation-allow-x00",
        "true",
        "--max-examples",
        "10",
        "--seed",
        "14",
        "--generation-database",
        "none",
        "--header",
        f"Authorization: Bearer {tenant_a.key}",
        "--request-timeout",
        "60",
        "--no-color",
    ]
    result = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-20000:]
    assert "Tested: 2" in output, output[-3000:]
    for phase in ("Coverage", "Fuzzing"):
        assert f"✅ {phase}" in output, output[-3000:]


def test_events_are_relayed_as_they_arrive_not_after_the_stream_ends(settings: Any, tenant_a: Any) -> None:
    """An upstream that sends one chunk and then holds the rest until the client has read that chunk: the client
    reads it through the API (which would wait forever if it buffered the stream), with ``model`` renamed."""
    import asyncio
    import threading

    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import StreamingResponse
    from starlette.routing import Route

    from api.app import create_app

    released, timed_out = threading.Event(), threading.Event()

    def chunk(content: str, finish: str | None = None) -> bytes:
        delta = {"content": content} if content else {"role": "assistant", "content": ""}
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        body = {
            "id": "chatcmpl-1",
            "object": "chat.completion.chunk",
            "created": 1,
            "model": MODEL,
            "choices": [choice],
        }
        return b"data: " + json.dumps(body).encode() + b"\n\n"

    async def completions(request: Request) -> StreamingResponse:
        async def events() -> Any:
            yield chunk("")
            for _ in range(1000):  # at most 10 s: then the test fails below
                if released.is_set():
                    break
                await asyncio.sleep(0.01)
            else:
                timed_out.set()
            yield chunk("4", "stop")
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    upstream = Starlette(routes=[Route("/v1/chat/completions", completions, methods=["POST"])])
    with serve(upstream) as upstream_url:
        app = create_app(settings.model_copy(update={"inference_url": upstream_url}))
        with serve(app) as url, openai_client(url, tenant_a.key) as client:
            stream = ask(client, MODEL, QUESTIONS[2], stream=True)
            first = next(iter(stream))
            assert first.choices[0].delta.role == "assistant" and first.model == MODEL
            released.set()
            rest = list(stream)
    assert not timed_out.is_set(), "the first chunk came only after the upstream gave up waiting: it was buffered"
    assert [c.choices[0].delta.content for c in rest] == ["4"] and rest[0].choices[0].finish_reason == "stop"


def test_an_upstream_that_breaks_off_mid_stream_ends_the_stream_with_an_error_event(
    settings: Any, tenant_a: Any
) -> None:
    """The inference server's connection drops after one chunk: the caller's stream ends with an error event,
    which the official client raises as an APIError (not a silently truncated answer)."""
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import StreamingResponse
    from starlette.routing import Route

    from api.app import create_app

    async def completions(request: Request) -> StreamingResponse:
        async def events() -> Any:
            choice = {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
            body = {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": MODEL, "choices": [choice]}
            yield b"data: " + json.dumps(body).encode() + b"\n\n"
            raise RuntimeError("the model process died")  # uvicorn drops the connection mid-body

        return StreamingResponse(events(), media_type="text/event-stream")

    upstream = Starlette(routes=[Route("/v1/chat/completions", completions, methods=["POST"])])
    with serve(upstream) as upstream_url:
        app = create_app(settings.model_copy(update={"inference_url": upstream_url}))
        with serve(app) as url, openai_client(url, tenant_a.key) as client:
            stream = ask(client, MODEL, QUESTIONS[2], stream=True)
            with pytest.raises(openai.APIError) as err:
                list(stream)
    assert "stopped answering during the stream" in err.value.message
