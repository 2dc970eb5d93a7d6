"""`proxima inference` as a real process on tiny-arith, driven by the official `openai` client and plain HTTP.

The server's greedy answers are compared with the trainer's own greedy evaluation of the same prompts
(``trainer.generation.rollout_engine.HFRolloutEngine`` + ``trainer.loops.evaluate.decode_completions``), for the base
and for an adapter registered from an archive in a folder artifact store.
"""

from __future__ import annotations

import io
import os
import socket
import subprocess
import sys
import tarfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
import torch
from openai.types.chat import ChatCompletionMessageParam

from api.storage import LocalStore
from trainer.builtin_models.tiny_arith import prompt_text
from trainer.generation.encoding import encode_prompts
from trainer.generation.models import add_lora, load_adapter, load_base_model, load_tokenizer
from trainer.generation.rollout_engine import HFRolloutEngine, SamplingParams
from trainer.loops.checkpoint import archive_adapter
from trainer.loops.evaluate import decode_completions
from trainer.spec.data import PromptItem
from trainer.spec.lora import LoraSpec

KEY = "inference-secret"
CPU = torch.device("cpu")
PAIRS = [(23, 58), (7, 5), (40, 19), (66, 77), (3, 96), (12, 12)]
ADAPTER_KEY = "files/tenant-1/file-abc123.tar.gz"
CHECKPOINT_KEY = "jobs/ftjob-1/checkpoints/step-000002/adapter.tar.gz"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def messages(a: int, b: int) -> list[ChatCompletionMessageParam]:
    return [{"role": "user", "content": prompt_text(a, b)}]


def make_adapter(model_dir: Path, out: Path, *, seed: int, scale: float) -> Path:
    base = load_base_model(str(model_dir), CPU)
    model = add_lora(base, LoraSpec(r=4, alpha=8.0), seed=seed)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * scale)
    model.save_pretrained(str(out))
    return out


def trainer_greedy(model_dir: Path, adapter: Path | None, max_tokens: int) -> list[str]:
    """The trainer's greedy evaluation of PAIRS (fp32): what validation scores."""
    tok = load_tokenizer(str(model_dir))
    base = load_base_model(str(model_dir), CPU)
    model = load_adapter(base, adapter) if adapter is not None else base
    engine = HFRolloutEngine(model, eos_id=tok.eos_token_id, pad_id=tok.pad_token_id, device=CPU, precision="fp32")
    items = [PromptItem([{"role": "user", "content": prompt_text(a, b)}], {}, i) for i, (a, b) in enumerate(PAIRS)]
    prompts = encode_prompts(tok, items, max_prompt_tokens=64)
    gen = engine.generate(prompts, SamplingParams(max_tokens, temperature=0.0), generator=None)
    return decode_completions(tok, gen.rollout)


@dataclass
class Server:
    url: str
    root: Path
    adapter_dir: Path
    expected_base: list[str]
    expected_adapter: list[str]
    proc: subprocess.Popen[bytes]

    def client(self, key: str = KEY) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=key, max_retries=0, timeout=120)

    def post(self, path: str, body: dict[str, object], key: str = KEY) -> httpx.Response:
        return httpx.post(f"{self.url}{path}", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=120)


@pytest.fixture(scope="module")
def server(tiny_arith_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("inference")
    (root / "home" / "models").mkdir(parents=True)
    (root / "home" / "models" / "tiny-arith").symlink_to(tiny_arith_dir)
    adapter_dir = make_adapter(tiny_arith_dir, root / "adapter", seed=5, scale=0.3)
    store = LocalStore(root / "artifacts")
    archive = archive_adapter(adapter_dir, root / "adapter.tar.gz")
    store.put_file(ADAPTER_KEY, archive)
    store.put_file(CHECKPOINT_KEY, archive)
    expected_base = trainer_greedy(tiny_arith_dir, None, 8)
    expected_adapter = trainer_greedy(tiny_arith_dir, adapter_dir, 8)
    assert expected_adapter != expected_base  # the adapter changes some answers
    port = _free_port()
    env = {
        **os.environ,
        "PROXIMA_HOME": str(root / "home"),
        "PROXIMA_ARTIFACTS": str(root / "artifacts"),
        "PROXIMA_BASE_MODELS": '["tiny-arith"]',
        "PROXIMA_INFERENCE_API_KEY": KEY,
        "PROXIMA_INFERENCE_PRECISION": "fp32",
        "OMP_NUM_THREADS": "1",
    }
    log = (root / "server.log").open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "proxima.cli", "inference", "--port", str(port)], env=env, stdout=log, stderr=log
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        assert proc.poll() is None, (root / "server.log").read_text()
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    else:
        proc.kill()
        pytest.fail("the inference server did not start: " + (root / "server.log").read_text())
    try:
        yield Server(url, root, adapter_dir, expected_base, expected_adapter, proc)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def test_health_needs_no_key_and_says_ready_on_stderr(server: Server) -> None:
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
    assert "proxima inference: ready on http://127.0.0.1:" in (server.root / "server.log").read_text()


def test_chat_completion_is_the_trainers_greedy_answer(server: Server) -> None:
    client = server.client()
    tok = load_tokenizer(str(server.root / "home" / "models" / "tiny-arith"))
    for (a, b), expected in zip(PAIRS, server.expected_base, strict=True):
        out = client.chat.completions.create(model="tiny-arith", messages=messages(a, b), temperature=0, max_tokens=8)
        assert out.object == "chat.completion" and out.model == "tiny-arith" and out.id.startswith("chatcmpl-")
        assert out.choices[0].message.role == "assistant"
        assert out.choices[0].message.content == expected
        assert out.choices[0].finish_reason == "stop"
        n_prompt = len(tok(prompt_text(a, b), add_special_tokens=False)["input_ids"])
        answer = len(tok(expected, add_special_tokens=False)["input_ids"]) + 1  # and EOS
        assert out.usage is not None
        assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (n_prompt, answer)
        assert out.usage.total_tokens == n_prompt + answer


def test_streamed_chat_completion_chunks_add_up_to_the_answer(server: Server) -> None:
    a, b = PAIRS[0]
    stream = server.client().chat.completions.create(
        model="tiny-arith",
        messages=messages(a, b),
        temperature=0,
        max_tokens=8,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == server.expected_base[0]
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == ["stop"]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == len(content) + 1  # tiny-arith: one token per digit, then EOS


def test_completions_and_logprobs(server: Server) -> None:
    client = server.client()
    out = client.completions.create(model="tiny-arith", prompt=prompt_text(*PAIRS[0]), max_tokens=8, temperature=0)
    assert out.object == "text_completion" and out.choices[0].text == server.expected_base[0]
    streamed = list(
        client.completions.create(
            model="tiny-arith", prompt=prompt_text(*PAIRS[0]), max_tokens=8, temperature=0, stream=True
        )
    )
    assert "".join(c.choices[0].text for c in streamed) == server.expected_base[0]
    assert streamed[-1].choices[0].finish_reason == "stop"
    sampled = [
        client.chat.completions.create(
            model="tiny-arith", messages=messages(*PAIRS[1]), temperature=1.0, seed=11, n=3, max_tokens=4
        )
        for _ in range(2)
    ]
    assert [c.message.content for c in sampled[0].choices] == [c.message.content for c in sampled[1].choices]
    assert [c.index for c in sampled[0].choices] == [0, 1, 2]
    chat = client.chat.completions.create(
        model="tiny-arith", messages=messages(*PAIRS[0]), temperature=0, max_tokens=8, logprobs=True, top_logprobs=2
    )
    assert chat.choices[0].logprobs is not None and chat.choices[0].logprobs.content is not None
    entries = chat.choices[0].logprobs.content
    assert "".join(e.token for e in entries) == server.expected_base[0]
    for e in entries:  # greedy: the sampled token is the most likely one
        assert len(e.top_logprobs) == 2 and e.top_logprobs[0].token == e.token
        assert e.top_logprobs[0].logprob == pytest.approx(e.logprob) and e.logprob <= 0
        assert e.bytes == list(e.token.encode())


def test_an_adapter_from_the_store_answers_as_the_trainer_evaluates_it(server: Server) -> None:
    r = server.post(
        "/v1/load_lora_adapter", {"lora_name": "ft-one", "lora_path": ADAPTER_KEY, "base_model_name": "tiny-arith"}
    )
    assert r.status_code == 200 and r.json() == {"lora_name": "ft-one"}
    again = server.post("/v1/load_lora_adapter", {"lora_name": "ft-one", "lora_path": ADAPTER_KEY})
    assert again.status_code == 200  # the same name and path: a no-op
    r = server.post("/v1/load_lora_adapter", {"lora_name": "ckpt-2", "lora_path": CHECKPOINT_KEY})
    assert r.status_code == 200
    client = server.client()
    models = {m.id: m for m in client.models.list().data}
    assert set(models) == {"tiny-arith", "ft-one", "ckpt-2"}
    assert models["ft-one"].model_extra == {"root": "tiny-arith", "parent": "tiny-arith"}
    assert models["tiny-arith"].model_extra == {"root": "tiny-arith", "parent": None}

    def ask(model_and_pair: tuple[str, tuple[int, int]]) -> str | None:
        model, (a, b) = model_and_pair
        out = client.chat.completions.create(model=model, messages=messages(a, b), temperature=0, max_tokens=8)
        return out.choices[0].message.content

    # concurrent requests for the base and both adapters share waves; each gets its own model's answer
    jobs = [(m, p) for p in PAIRS for m in ("ft-one", "tiny-arith", "ckpt-2")]
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(ask, jobs))
    expected = {
        "ft-one": server.expected_adapter,
        "ckpt-2": server.expected_adapter,
        "tiny-arith": server.expected_base,
    }
    assert answers == [expected[m][PAIRS.index(p)] for m, p in jobs]

    r = server.post("/v1/unload_lora_adapter", {"lora_name": "ckpt-2"})
    assert r.status_code == 200
    with pytest.raises(openai.NotFoundError) as err:
        client.chat.completions.create(model="ckpt-2", messages=messages(1, 2), max_tokens=2)
    assert err.value.code == "model_not_found"
    assert server.post("/v1/unload_lora_adapter", {"lora_name": "ckpt-2"}).status_code == 404


def test_an_adapter_folder_given_by_absolute_path_loads(server: Server) -> None:
    r = server.post("/v1/load_lora_adapter", {"lora_name": "local", "lora_path": str(server.adapter_dir)})
    assert r.status_code == 200
    out = server.client().chat.completions.create(
        model="local", messages=messages(*PAIRS[3]), temperature=0, max_tokens=8
    )
    assert out.choices[0].message.content == server.expected_adapter[3]


def test_bad_adapter_paths_and_bases_are_refused(server: Server) -> None:
    r = server.post("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "files/tenant-1/missing.tar.gz"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path"
    r = server.post("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "../etc/passwd"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path"
    r = server.post("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": str(server.root)})
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path"
    r = server.post("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": ADAPTER_KEY, "base_model_name": "gpt-9"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    # an archive whose member climbs out of the extraction folder is refused and writes nothing outside it
    data = io.BytesIO()
    with tarfile.open(fileobj=data, mode="w:gz") as tar:
        info = tarfile.TarInfo("../../escaped.txt")
        info.size = 3
        tar.addfile(info, io.BytesIO(b"bad"))
    LocalStore(server.root / "artifacts").put_bytes("files/tenant-1/evil.tar.gz", data.getvalue())
    r = server.post("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "files/tenant-1/evil.tar.gz"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path"
    assert not list(server.root.rglob("escaped.txt"))


def test_unknown_model_is_a_404_in_openais_envelope(server: Server) -> None:
    with pytest.raises(openai.NotFoundError) as err:
        server.client().chat.completions.create(model="gpt-9", messages=messages(1, 2))
    assert err.value.code == "model_not_found" and err.value.param == "model"


def test_a_prompt_beyond_the_context_is_a_400_naming_the_messages(server: Server) -> None:
    long: list[ChatCompletionMessageParam] = [{"role": "user", "content": "What is 1 + 2? " * 30}]
    with pytest.raises(openai.BadRequestError) as err:
        server.client().chat.completions.create(model="tiny-arith", messages=long, max_tokens=4)
    assert err.value.code == "context_length_exceeded" and err.value.param == "messages"
    assert "maximum context length is 64 tokens" in err.value.message
    with pytest.raises(openai.BadRequestError) as err:
        server.client().completions.create(model="tiny-arith", prompt="What is 1 + 2?", max_tokens=60)
    assert err.value.code == "context_length_exceeded" and err.value.param == "prompt"


def test_unknown_and_out_of_range_parameters_are_400s_naming_them(server: Server) -> None:
    client = server.client()
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny-arith", messages=messages(1, 2), extra_body={"foo": 1})
    assert err.value.body == {
        "message": "Unrecognized request argument supplied: foo",
        "type": "invalid_request_error",
        "param": None,
        "code": None,
    }
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny-arith", messages=messages(1, 2), temperature=3)
    assert err.value.param == "temperature"
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny-arith", messages=messages(1, 2), top_logprobs=30, logprobs=True)
    assert err.value.param == "top_logprobs"
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny-arith", messages=messages(1, 2), stop=["a", "b", "c", "d", "e"])
    assert err.value.param == "stop"


def test_a_wrong_or_missing_key_is_a_401(server: Server) -> None:
    with pytest.raises(openai.AuthenticationError):
        server.client("wrong").chat.completions.create(model="tiny-arith", messages=messages(1, 2))
    r = httpx.get(f"{server.url}/v1/models")
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
