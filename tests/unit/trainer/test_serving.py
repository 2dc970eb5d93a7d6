"""trainer.serving.inference: the inference engine on the random 2-layer model (fp32, CPU) and adapters made here."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from trainer.generation.models import add_lora, load_adapter, load_base_model, load_tokenizer, store_frozen_linears_in
from trainer.generation.rollout_engine import HFRolloutEngine, SamplingParams
from trainer.loops.evaluate import decode_completions
from trainer.serving.inference import (
    Completion,
    EngineError,
    Event,
    InferenceEngine,
    Progress,
    Sampling,
    Ticket,
    UnknownModel,
)
from trainer.spec.lora import LoraSpec

CPU = torch.device("cpu")
PROMPTS = ["What is 1 + 2?", "What is 33 + 48?", "What is 7 + 70?", "What is 99 + 99?", "What is 10 + 5?"]


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


def make_adapter(model_dir: Path, out: Path, seed: int) -> Path:
    """A LoRA adapter on every linear layer with random A and B (a fresh one has B = 0: the base itself)."""
    base = load_base_model(str(model_dir), CPU)
    model = add_lora(base, LoraSpec(r=4, alpha=8.0), seed=seed)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    model.save_pretrained(str(out))
    return out


@pytest.fixture(scope="module")
def adapters(random_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return {name: make_adapter(random_model_dir, root / name, seed) for name, seed in (("a", 1), ("b", 2), ("c", 3))}


def new_engine(model_dir: Path, **kw: object) -> InferenceEngine:
    opts: dict[str, object] = {"device": CPU, "precision": "fp32", "max_batch": 16, "max_adapters": 8}
    opts.update(kw)
    return InferenceEngine({"rand": str(model_dir)}, **opts)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def engine(random_model_dir: Path, adapters: dict[str, Path]) -> object:
    e = new_engine(random_model_dir)
    for name, path in adapters.items():
        e.register_adapter(name, base="rand", path=path)
    e.start()
    assert e.wait_ready(60)
    yield e
    e.close()


def chat_ids(e: InferenceEngine, text: str) -> list[int]:
    return e.encode_chat("rand", [{"role": "user", "content": text}])


def run_together(e: InferenceEngine, jobs: list[tuple[str, list[int], Sampling]]) -> list[Completion]:
    """Submit every job before the engine starts, so that they are all in its first wave."""
    gathered = []
    for model, prompt, sampling in jobs:
        out, on_event, done = Completion.gather(sampling.n)
        e.submit(model, prompt, sampling, on_event)
        gathered.append((out, done))
    e.start()
    for _, done in gathered:
        assert done.wait(60)
    return [out for out, _ in gathered]


GREEDY = Sampling(max_tokens=8, temperature=0.0)


def test_requests_batched_in_one_wave_give_what_each_gives_alone(
    engine: InferenceEngine, random_model_dir: Path, adapters: dict[str, Path]
) -> None:
    alone = [engine.generate("rand", chat_ids(engine, p), GREEDY).texts[0] for p in PROMPTS]
    e = new_engine(random_model_dir)
    try:
        together = run_together(e, [("rand", chat_ids(e, p), GREEDY) for p in PROMPTS])
        assert e.stats.waves == 1 and e.stats.max_wave_rows == len(PROMPTS)
    finally:
        e.close()
    assert [c.texts[0] for c in together] == alone
    assert all(c.finish_reasons == ["length"] or c.finish_reasons == ["stop"] for c in together)


def test_two_adapters_and_the_base_in_one_wave_each_give_what_they_give_alone(
    engine: InferenceEngine, random_model_dir: Path, adapters: dict[str, Path]
) -> None:
    prompt = chat_ids(engine, PROMPTS[1])
    alone = {m: engine.generate(m, prompt, GREEDY).texts[0] for m in ("rand", "a", "b")}
    assert alone["a"] != alone["rand"] and alone["b"] != alone["rand"] and alone["a"] != alone["b"]
    e = new_engine(random_model_dir)
    try:
        for name in ("a", "b"):
            e.register_adapter(name, base="rand", path=adapters[name])
        together = run_together(e, [(m, prompt, GREEDY) for m in ("a", "rand", "b", "a")])
        assert e.stats.waves == 1 and e.stats.max_wave_rows == 4
    finally:
        e.close()
    assert [c.texts[0] for c in together] == [alone["a"], alone["rand"], alone["b"], alone["a"]]


def test_a_request_arriving_during_a_wave_joins_it_and_gets_what_it_gets_alone(
    engine: InferenceEngine, random_model_dir: Path, adapters: dict[str, Path]
) -> None:
    long_prompt, short_prompt = chat_ids(engine, PROMPTS[2]), chat_ids(engine, PROMPTS[4])
    long_sampling = Sampling(max_tokens=20, temperature=0.0)
    alone_long = engine.generate("a", long_prompt, long_sampling).texts[0]
    alone_short = engine.generate("b", short_prompt, GREEDY).texts[0]
    e = new_engine(random_model_dir)
    for name in ("a", "b"):
        e.register_adapter(name, base="rand", path=adapters[name])
    e.start()
    try:
        joined, on_joined, joined_done = Completion.gather(1)
        first, on_first, first_done = Completion.gather(1)
        submitted: list[bool] = []

        def on_event(ev: object) -> None:
            on_first(ev)  # type: ignore[arg-type]
            if not submitted:  # at the first step of the long request: the short one arrives mid-wave
                submitted.append(True)
                e.submit("b", short_prompt, GREEDY, on_joined)

        e.submit("a", long_prompt, long_sampling, on_event)
        assert first_done.wait(60) and joined_done.wait(60)
        assert (e.stats.waves, e.stats.joins, e.stats.max_wave_rows) == (1, 1, 2)
    finally:
        e.close()
    assert (first.texts[0], joined.texts[0]) == (alone_long, alone_short)


def test_greedy_completions_are_the_trainers_greedy_evaluation(
    engine: InferenceEngine, random_model_dir: Path, adapters: dict[str, Path]
) -> None:
    """What trainer.loops.evaluate decodes from the policy (base + adapter, fp32) is what the engine answers."""
    tok = load_tokenizer(str(random_model_dir))
    policy = load_adapter(load_base_model(str(random_model_dir), CPU), adapters["a"])
    trainer_engine = HFRolloutEngine(
        policy, eos_id=tok.eos_token_id, pad_id=tok.pad_token_id, device=CPU, precision="fp32"
    )
    prompts = [chat_ids(engine, p) for p in PROMPTS]
    gen = trainer_engine.generate(prompts, SamplingParams(8, temperature=0.0), generator=None)
    expected = decode_completions(tok, gen.rollout)
    assert [engine.generate("a", p, GREEDY).texts[0] for p in prompts] == expected


def test_the_least_recently_used_adapter_is_evicted(random_model_dir: Path, adapters: dict[str, Path]) -> None:
    e = new_engine(random_model_dir, max_adapters=2)
    for name, path in adapters.items():
        e.register_adapter(name, base="rand", path=path)
    e.start()
    try:
        prompt = chat_ids(e, PROMPTS[0])
        first = e.generate("a", prompt, GREEDY).texts[0]
        e.generate("b", prompt, GREEDY)
        assert e.loaded_adapters() == ["a", "b"] and e.stats.adapter_evictions == 0
        e.generate("c", prompt, GREEDY)  # a is the least recently used
        assert e.loaded_adapters() == ["b", "c"] and e.stats.adapter_evictions == 1
        e.generate("b", prompt, GREEDY)
        assert e.generate("a", prompt, GREEDY).texts[0] == first  # reloaded, in place of c
        assert e.loaded_adapters() == ["b", "a"]
        assert (e.stats.adapter_loads, e.stats.adapter_evictions) == (4, 2)
    finally:
        e.close()


def test_idle_models_and_adapters_are_unloaded_and_come_back(random_model_dir: Path, adapters: dict[str, Path]) -> None:
    e = new_engine(random_model_dir, idle_unload_s=0.3)
    e.register_adapter("a", base="rand", path=adapters["a"])
    e.start()
    try:
        prompt = chat_ids(e, PROMPTS[0])
        before = e.generate("a", prompt, GREEDY).texts[0]
        deadline = time.monotonic() + 10
        while (e.stats.model_unloads, e.stats.adapter_unloads) != (1, 1) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert (e.stats.model_unloads, e.stats.adapter_unloads) == (1, 1) and e.loaded_adapters() == []
        assert e.generate("a", prompt, GREEDY).texts[0] == before
        assert (e.stats.model_loads, e.stats.adapter_loads) == (2, 2)
    finally:
        e.close()


def test_a_stop_string_cuts_the_text_and_ends_the_choice(engine: InferenceEngine) -> None:
    """The text streams (deltas) up to the stop string and never past it: a suffix that could begin a stop string is
    held back until the next token tells."""
    prompt = chat_ids(engine, PROMPTS[2])
    full = engine.generate("rand", prompt, Sampling(max_tokens=12, temperature=0.0))
    text = full.texts[0]
    for stop in ("4", "1114", "14"):
        assert text.find(stop) > 0, (text, stop)
        sampling = Sampling(max_tokens=12, temperature=0.0, stop=(stop, "never-there"))
        deltas: list[str] = []
        cut, on_event, done = Completion.gather(1)

        def collect(ev: Event, on_event: Callable[[Event], None] = on_event, deltas: list[str] = deltas) -> None:
            if isinstance(ev, Progress):
                deltas.extend(d.text for d in ev.deltas)
            on_event(ev)

        engine.submit("rand", prompt, sampling, collect)
        assert done.wait(60)
        assert cut.texts == [text[: text.find(stop)]] and cut.finish_reasons == ["stop"]
        assert "".join(deltas) == cut.texts[0]  # what was sent is never taken back: nothing past the stop went out
        assert cut.completion_tokens < full.completion_tokens


def test_a_seed_gives_the_same_samples_alone_and_batched(engine: InferenceEngine, random_model_dir: Path) -> None:
    prompt = chat_ids(engine, PROMPTS[3])
    seeded = Sampling(max_tokens=10, temperature=1.0, seed=7)
    alone = engine.generate("rand", prompt, seeded).texts[0]
    assert engine.generate("rand", prompt, seeded).texts[0] == alone
    assert engine.generate("rand", prompt, Sampling(max_tokens=10, temperature=1.0, seed=8)).texts[0] != alone
    two = engine.generate("rand", prompt, Sampling(max_tokens=10, temperature=1.0, seed=7, n=2))
    assert two.texts == [
        alone,
        engine.generate("rand", prompt, Sampling(max_tokens=10, temperature=1.0, seed=8)).texts[0],
    ]
    e = new_engine(random_model_dir)
    try:
        others = [("rand", chat_ids(e, p), Sampling(max_tokens=6, temperature=1.0)) for p in PROMPTS]
        together = run_together(e, [*others[:2], ("rand", prompt, seeded), *others[2:]])
    finally:
        e.close()
    assert together[2].texts[0] == alone


def test_logprobs_are_the_models_log_softmax_of_the_sampled_tokens(
    engine: InferenceEngine, random_model_dir: Path, adapters: dict[str, Path]
) -> None:
    prompt = chat_ids(engine, PROMPTS[4])
    out = engine.generate("b", prompt, Sampling(max_tokens=6, temperature=0.8, seed=3, logprobs=True, top_logprobs=3))
    entries = out.logprobs[0]
    assert len(entries) == 6 and out.finish_reasons == ["length"]
    policy = load_adapter(load_base_model(str(random_model_dir), CPU), adapters["b"])
    ids = torch.tensor([prompt + [e.token_id for e in entries]])
    with torch.no_grad():
        logits = policy(input_ids=ids).logits[0].float()
    expected = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)  # row t predicts token t + 1
    got = torch.tensor([e.logprob for e in entries])
    torch.testing.assert_close(
        got, expected.gather(-1, ids[0, len(prompt) :].unsqueeze(-1)).squeeze(-1), atol=1e-4, rtol=0
    )
    for t, e in enumerate(entries):
        top_v, top_i = expected[t].topk(3)
        assert [x.token_id for x in e.top] == top_i.tolist()
        torch.testing.assert_close(torch.tensor([x.logprob for x in e.top]), top_v, atol=1e-4, rtol=0)


def test_unknown_models_and_prompts_beyond_the_context_are_refused(engine: InferenceEngine) -> None:
    with pytest.raises(UnknownModel):
        engine.submit("nope", [1, 2], GREEDY, lambda ev: None)
    with pytest.raises(EngineError) as err:
        engine.fit("rand", 60, 10, param="messages")
    assert err.value.code == "context_length_exceeded" and err.value.param == "messages"
    assert "maximum context length is 64 tokens" in err.value.message and "60 in the messages" in err.value.message
    assert engine.fit("rand", 60, None, param="messages") == 4


def test_in_bf16_a_request_alone_is_the_trainers_bf16_policy_greedy_answer(
    random_model_dir: Path, adapters: dict[str, Path]
) -> None:
    """bf16 as the trainer stores its policy (frozen linears in bf16, LoRA fp32, autocast): the same answers."""
    tok = load_tokenizer(str(random_model_dir))
    base = load_base_model(str(random_model_dir), CPU)
    store_frozen_linears_in(base, torch.bfloat16)
    policy = load_adapter(base, adapters["c"])
    trainer_engine = HFRolloutEngine(
        policy, eos_id=tok.eos_token_id, pad_id=tok.pad_token_id, device=CPU, precision="bf16"
    )
    e = new_engine(random_model_dir, precision="bf16")
    e.register_adapter("c", base="rand", path=adapters["c"])
    e.start()
    try:
        for p in PROMPTS[:3]:
            prompt = chat_ids(e, p)
            gen = trainer_engine.generate([prompt], SamplingParams(8, temperature=0.0), generator=None)
            assert e.generate("c", prompt, GREEDY).texts == decode_completions(tok, gen.rollout)
    finally:
        e.close()


def test_a_cancelled_request_stops_and_the_engine_goes_on(engine: InferenceEngine) -> None:
    prompt = chat_ids(engine, PROMPTS[2])
    events: list[Event] = []
    tickets: list[Ticket] = []

    def on_event(ev: Event) -> None:
        events.append(ev)
        tickets[0].cancel()  # after its first step

    tickets.append(engine.submit("rand", prompt, Sampling(max_tokens=20, temperature=0.0), on_event))
    after = engine.generate("rand", prompt, Sampling(max_tokens=3, temperature=0.0))
    assert len(events) == 1 and isinstance(events[0], Progress)
    assert len(after.texts[0]) > 0 and after.finish_reasons == ["length"]


def test_unregistering_the_active_adapter_leaves_the_others_usable(
    random_model_dir: Path, adapters: dict[str, Path]
) -> None:
    e = new_engine(random_model_dir)
    for name in ("a", "b"):
        e.register_adapter(name, base="rand", path=adapters[name])
    e.start()
    try:
        prompt = chat_ids(e, PROMPTS[1])
        expected = {m: e.generate(m, prompt, GREEDY).texts[0] for m in ("a", "b")}  # b is PEFT's active adapter
        e.unregister_adapter("b")
        e.register_adapter("c", base="rand", path=adapters["c"])
        e.generate("c", prompt, GREEDY)  # b's weights were unloaded between the waves
        assert e.loaded_adapters() == ["a", "c"] and e.stats.adapter_unloads == 1
        with pytest.raises(UnknownModel):
            e.generate("b", prompt, GREEDY)
        assert e.generate("a", prompt, GREEDY).texts[0] == expected["a"]
    finally:
        e.close()
