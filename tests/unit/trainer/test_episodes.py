"""Agent episodes (trainer.agents.episodes): an episode's token row, turn by turn, with scripted and real engines."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from tests.unit.trainer.test_tool_calls import chatml_tokenizer, ids
from trainer.agents.episodes import UNKNOWN_TOOL, Episode, EpisodeConfig, EpisodeRunner, turn_seed
from trainer.agents.tool_calls import HermesParser, ParsedTurn, ToolCall, environment_segment, new_call_id
from trainer.generation.encoding import prompt_text
from trainer.generation.rollout import Rollout, completion_logprobs, left_pad
from trainer.generation.rollout_engine import Generation, HFRolloutEngine, SamplingParams
from trainer.loops.agent import AgentRollouts
from trainer.spec.agent_spec import AgentSpec, EnvironmentSpec, ToolSpec
from trainer.spec.data import PromptItem

TOK = chatml_tokenizer()
EOS = TOK.eos_token_id
PAD = TOK.pad_token_id
ADD = ToolSpec(name="add", server_url="https://tools.example/add")
PARAMS = SamplingParams(max_new_tokens=999, temperature=1.0)


def result_text(*outputs: str) -> str:
    """What the Qwen-like template writes after an assistant turn's <|im_end|> for these tool results."""
    body = "".join(f"\n<tool_response>\n{o}\n</tool_response>" for o in outputs)
    return f"\n<|im_start|>user{body}<|im_end|>\n<|im_start|>assistant\n"


def call_text(name: str, arguments: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>'


def turn(text: str, *, eos: bool = True) -> list[int]:
    return ids(TOK, text) + ([EOS] if eos else [])


def fake_logprob(token: int, position: int) -> float:
    """What the scripted engine reports for a token at a position of its turn."""
    return -(token + 1) / 1000 - position / 10


class ScriptedEngine:
    """Answers each prompt with the next scripted turn of the episode whose prompt it starts with. A turn that ends
    with EOS within max_new_tokens ends there; any other is cut at max_new_tokens without EOS."""

    exact_logprobs = False

    def __init__(self, scripts: Mapping[tuple[int, ...], list[list[int]]], *, logprobs: bool = True) -> None:
        self.scripts = {k: list(v) for k, v in scripts.items()}
        self.logprobs = logprobs
        self.calls: list[tuple[list[list[int]], int]] = []  # (prompts, max_new_tokens) of each generate

    def push_weights(self, policy: torch.nn.Module, version: int) -> None:
        pass

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams, *, generator: torch.Generator | None
    ) -> Generation:
        self.calls.append(([list(p) for p in prompts], params.max_new_tokens))
        outs: list[tuple[list[int], bool]] = []
        for p in prompts:
            key = next(k for k in self.scripts if tuple(p[: len(k)]) == k)
            seq = self.scripts[key].pop(0)
            finished = seq[-1] == EOS and len(seq) <= params.max_new_tokens
            assert finished or len(seq) >= params.max_new_tokens, "a scripted turn without EOS must run past the limit"
            outs.append((seq[: params.max_new_tokens], not finished))
        width = max(len(s) for s, _ in outs)
        completion = torch.full((len(outs), width), PAD)
        logprobs = torch.zeros((len(outs), width))
        for i, (seq, _) in enumerate(outs):
            completion[i, : len(seq)] = torch.tensor(seq)
            logprobs[i, : len(seq)] = torch.tensor([fake_logprob(t, k) for k, t in enumerate(seq)])
        lengths = torch.tensor([len(s) for s, _ in outs])
        mask = (torch.arange(width).unsqueeze(0) < lengths.unsqueeze(1)).long()
        prompt_ids, prompt_mask = left_pad(prompts, PAD)
        rollout = Rollout(prompt_ids, prompt_mask, completion, mask, lengths, torch.tensor([t for _, t in outs]))
        return Generation(rollout, logprobs if self.logprobs else None, 0.0)


@dataclass(frozen=True)
class Result:
    output: str
    error: str | None = None
    seconds: float = 0.01
    done: bool = False


class FakeExecutor:
    """Answers calls with ``answer(call)`` after ``delay`` seconds; records what it was asked and how many calls
    were in flight at once."""

    def __init__(
        self,
        answer: Callable[[ToolCall], Result] = lambda c: Result("5"),
        *,
        delay: float = 0.0,
        reset: Callable[[dict[str, Any]], list[dict[str, Any]] | None] = lambda item: None,
    ) -> None:
        self.answer, self.delay, self.reset = answer, delay, reset
        self.lock = threading.Lock()
        self.started: list[str] = []
        self.items: dict[str, dict[str, Any]] = {}  # trace id → the item it was started with
        self.finished: list[str] = []
        self.calls: list[tuple[ToolCall, ToolSpec | None, dict[str, Any], str]] = []
        self.in_flight = self.peak = 0

    def start(self, item: dict[str, Any], trace_id: str, prompt_messages: list[dict[str, str]]) -> Any:
        with self.lock:
            self.started.append(trace_id)
            self.items[trace_id] = item
        return self.reset(item)

    def call(self, call: ToolCall, tool: ToolSpec | None, *, item: dict[str, Any], trace_id: str) -> Result:
        with self.lock:
            self.calls.append((call, tool, item, trace_id))
            self.in_flight += 1
            self.peak = max(self.peak, self.in_flight)
        time.sleep(self.delay)
        with self.lock:
            self.in_flight -= 1
        return self.answer(call)

    def finish(self, trace_id: str) -> None:
        with self.lock:
            self.finished.append(trace_id)


def prompt(n: int) -> list[int]:
    """Distinct prompts, none a prefix of another."""
    return ids(TOK, prompt_text(TOK, [{"role": "user", "content": f"Question {n:02d}?"}]))


def item(n: int) -> PromptItem:
    return PromptItem(messages=[{"role": "user", "content": f"Question {n:02d}?"}], item={"n": n})


def run(
    scripts: list[list[list[int]]],
    *,
    executor: FakeExecutor | None = None,
    config: EpisodeConfig = EpisodeConfig(max_episode_steps=5, max_tokens=1000, max_turn_tokens=200),
    tools: list[ToolSpec] | None = None,
    logprobs: bool = True,
) -> tuple[Generation, list[Episode], ScriptedEngine, FakeExecutor]:
    engine = ScriptedEngine({tuple(prompt(i)): s for i, s in enumerate(scripts)}, logprobs=logprobs)
    executor = executor or FakeExecutor()
    runner = EpisodeRunner(engine, TOK, HermesParser(), executor, config)
    n = len(scripts)
    gen, episodes = runner.run(
        [prompt(i) for i in range(n)],
        [item(i) for i in range(n)],
        [tools if tools is not None else [ADD] for _ in range(n)],
        PARAMS,
        generator=None,
    )
    return gen, episodes, engine, executor


def row(gen: Generation, i: int) -> list[int]:
    return gen.rollout.completion_ids[i, : int(gen.rollout.lengths[i])].tolist()


ADD_CALL = "Let me add.\n" + call_text("add", '{"a": 2,  "b": 3}')


class TestRowLayout:
    def test_two_turn_episode_token_by_token(self) -> None:
        t1, seg, t2 = turn(ADD_CALL), ids(TOK, result_text("5")), turn("The sum is 5.")
        gen, [ep], engine, executor = run([[t1, t2]])
        r = gen.rollout
        assert row(gen, 0) == t1 + seg + t2
        assert int(r.lengths[0]) == len(t1 + seg + t2) == r.completion_ids.shape[1]
        assert r.completion_mask[0].tolist() == [1] * len(t1 + seg + t2)
        assert r.policy_mask[0].tolist() == [1] * len(t1) + [0] * len(seg) + [1] * len(t2)
        assert r.turn_ids[0].tolist() == [0] * len(t1) + [1] * len(seg) + [2] * len(t2)
        assert r.prompt_ids[0].tolist() == prompt(0) and not bool(r.truncated[0])
        # Turn 2 was generated from the prompt, turn 1's ids as sampled and the environment's ids.
        assert engine.calls[1][0] == [prompt(0) + t1 + seg]

        [(call, tool, called_item, trace_id)] = executor.calls
        assert (call.name, call.arguments, tool, called_item) == ("add", '{"a": 2,  "b": 3}', ADD, {"n": 0})
        assert trace_id == ep.trace_id and executor.started == executor.finished == [ep.trace_id]
        calls = [call.chat_completions()]
        assert ep.messages == [
            {"role": "assistant", "content": "Let me add.", "tool_calls": calls},
            {"role": "tool", "tool_call_id": call.id, "content": "5"},
            {"role": "assistant", "content": "The sum is 5."},
        ]
        assert (ep.output_text, ep.output_tools, ep.turns) == ("The sum is 5.", calls, 2)
        assert (ep.tool_calls_by_name, ep.tool_errors_by_name, ep.tool_latency_by_name) == (
            {"add": 1},
            {},
            {"add": [0.01]},
        )
        assert (ep.policy_tokens, ep.tool_tokens) == (len(t1) + len(t2), len(seg))
        assert not (ep.truncated or ep.format_error or ep.environment_done)

    def test_batch_runs_one_generate_per_turn_over_active_episodes(self) -> None:
        final = turn("Done.")
        scripts = [[final], [turn(ADD_CALL), final], [turn(ADD_CALL), turn(ADD_CALL), final]]
        gen, episodes, engine, _ = run(scripts)
        assert [len(prompts) for prompts, _ in engine.calls] == [3, 2, 1]
        assert [ep.turns for ep in episodes] == [1, 2, 3]
        seg = ids(TOK, result_text("5"))
        assert row(gen, 0) == final
        assert row(gen, 2) == turn(ADD_CALL) + seg + turn(ADD_CALL) + seg + final
        assert gen.rollout.turn_ids[2].tolist()[-len(final) :] == [4] * len(final)
        # Shorter rows are right-padded outside the completion mask.
        assert gen.rollout.completion_mask[0].sum() == len(final)
        assert gen.rollout.completion_ids[0, len(final) :].eq(PAD).all()
        assert gen.rollout.policy_mask[0, len(final) :].eq(0).all()

    def test_several_calls_in_one_turn_are_answered_in_order(self) -> None:
        two = call_text("add", '{"a": 1}') + "\n" + call_text("add", '{"a": 2}')
        executor = FakeExecutor(lambda c: Result("r" + c.arguments[-2]))
        gen, [ep], _, _ = run([[turn(two), turn("3")]], executor=executor)
        assert row(gen, 0) == turn(two) + ids(TOK, result_text("r1", "r2")) + turn("3")
        assert [m["content"] for m in ep.messages if m["role"] == "tool"] == ["r1", "r2"]
        assert [m["tool_call_id"] for m in ep.messages[1:3]] == [c["id"] for c in ep.output_tools]


class TestLogprobs:
    def test_engine_logprobs_sit_at_policy_positions_and_zero_elsewhere(self) -> None:
        t1, seg, t2 = turn(ADD_CALL), ids(TOK, result_text("5")), turn("8")
        gen, _, _, _ = run([[t1, t2]])
        assert gen.logprobs is not None
        expected = (
            [fake_logprob(t, k) for k, t in enumerate(t1)]
            + [0.0] * len(seg)
            + [fake_logprob(t, k) for k, t in enumerate(t2)]
        )
        assert gen.logprobs[0].tolist() == pytest.approx(expected)

    def test_engine_without_logprobs_gives_none(self) -> None:
        gen, _, _, _ = run([[turn(ADD_CALL), turn("8")]], logprobs=False)
        assert gen.logprobs is None


class TestConcurrency:
    @pytest.mark.alone
    def test_tool_calls_of_all_episodes_overlap(self) -> None:
        executor = FakeExecutor(delay=0.3)
        t0 = time.perf_counter()
        _, episodes, _, _ = run([[turn(ADD_CALL), turn("5")] for _ in range(8)], executor=executor)
        elapsed = time.perf_counter() - t0
        assert executor.peak == 8
        assert elapsed < 1.0, f"8 calls of 0.3 s took {elapsed:.2f} s: they did not run concurrently"
        assert all(ep.turns == 2 and ep.tool_calls_by_name == {"add": 1} for ep in episodes)
        assert sorted(executor.finished) == sorted(ep.trace_id for ep in episodes)


class TestEndings:
    def test_max_episode_steps_truncates_and_last_turns_calls_are_not_run(self) -> None:
        config = EpisodeConfig(max_episode_steps=2, max_tokens=1000, max_turn_tokens=200)
        gen, [ep], _, executor = run([[turn(ADD_CALL), turn(ADD_CALL)]], config=config)
        assert (ep.turns, ep.truncated, len(executor.calls), len(ep.output_tools)) == (2, True, 1, 2)
        assert ep.messages[-1]["role"] == "assistant" and "tool_calls" in ep.messages[-1]
        assert row(gen, 0) == turn(ADD_CALL) + ids(TOK, result_text("5")) + turn(ADD_CALL)
        assert bool(gen.rollout.truncated[0])

    def test_turn_at_its_token_limit_without_eos_truncates(self) -> None:
        config = EpisodeConfig(max_episode_steps=5, max_tokens=1000, max_turn_tokens=6)
        gen, [ep], engine, executor = run([[turn("A long answer", eos=False)]], config=config)
        assert engine.calls[0][1] == 6
        assert row(gen, 0) == ids(TOK, "A long")
        assert (ep.truncated, ep.output_text, ep.turns, executor.calls) == (True, "A long", 1, [])

    def test_budget_limits_the_next_turn(self) -> None:
        t1, seg = turn(ADD_CALL), ids(TOK, result_text("5"))
        budget = len(t1) + len(seg) + 4
        config = EpisodeConfig(max_episode_steps=5, max_tokens=budget, max_turn_tokens=200)
        gen, [ep], engine, _ = run([[t1, turn("The sum is 5.")]], config=config)
        assert [limit for _, limit in engine.calls] == [min(200, budget), 4]
        assert row(gen, 0) == t1 + seg + ids(TOK, "The ")
        assert int(gen.rollout.lengths[0]) == budget and ep.truncated

    def test_budget_without_room_for_results_ends_before_appending_them(self) -> None:
        t1, seg = turn(ADD_CALL), ids(TOK, result_text("5"))
        config = EpisodeConfig(max_episode_steps=5, max_tokens=len(t1) + len(seg), max_turn_tokens=200)
        gen, [ep], engine, executor = run([[t1]], config=config)
        assert len(executor.calls) == 1 and len(engine.calls) == 1
        assert row(gen, 0) == t1 and ep.truncated and ep.tool_tokens == 0
        assert ep.messages[-1] == {"role": "tool", "tool_call_id": ep.output_tools[0]["id"], "content": "5"}

    def test_rows_with_different_budgets_share_one_generate_and_are_cut_to_their_own(self) -> None:
        short, long, seg = turn(call_text("add", "{}")), turn(ADD_CALL), ids(TOK, result_text("5"))
        budget = len(long) + len(seg) + 3
        config = EpisodeConfig(max_episode_steps=5, max_tokens=budget, max_turn_tokens=500)
        gen, episodes, engine, _ = run([[short, turn("Answer!")], [long, turn("Answer!")]], config=config)
        # Turn 2: row 0 may take len(long) - len(short) + 3 tokens, row 1 three; one generate for both.
        assert [limit for _, limit in engine.calls] == [budget, len(long) - len(short) + 3]
        assert row(gen, 0) == short + seg + turn("Answer!") and not episodes[0].truncated
        assert row(gen, 1) == long + seg + ids(TOK, "Ans") and episodes[1].truncated
        assert gen.logprobs is not None
        start = len(long) + len(seg)
        assert gen.logprobs[1, start : start + 3].tolist() == pytest.approx(
            [fake_logprob(t, k) for k, t in enumerate(ids(TOK, "Ans"))]
        )

    def test_call_that_does_not_parse_ends_with_a_format_error_and_is_trained(self) -> None:
        bad = turn('<tool_call>{"name": "add", "arguments": [1]}</tool_call>')
        gen, [ep], _, executor = run([[bad]])
        assert (ep.format_error, ep.truncated, ep.turns, executor.calls) == (True, False, 1, [])
        assert gen.rollout.policy_mask[0].tolist() == [1] * len(bad)
        assert ep.messages == [
            {"role": "assistant", "content": '<tool_call>{"name": "add", "arguments": [1]}</tool_call>'}
        ]

    def test_unknown_tool_is_answered_with_an_error_without_the_executor(self) -> None:
        gen, [ep], _, executor = run([[turn(call_text("mul", "{}")), turn("6")]])
        assert executor.calls == []
        message = ep.messages[1]["content"]
        assert "'mul'" in message and "add" in message
        assert (ep.tool_calls_by_name, ep.tool_errors_by_name, ep.tool_latency_s) == (
            {UNKNOWN_TOOL: 1},
            {UNKNOWN_TOOL: 1},
            [],
        )
        assert ep.output_text == "6" and row(gen, 0)[-2:] == turn("6")

    def test_failed_call_is_counted_and_the_episode_goes_on(self) -> None:
        executor = FakeExecutor(lambda c: Result('{"error": "timeout"}', error="timeout", seconds=2.5))
        _, [ep], _, _ = run([[turn(ADD_CALL), turn("?")]], executor=executor)
        assert (ep.tool_calls_by_name, ep.tool_errors_by_name, ep.tool_latency_s) == ({"add": 1}, {"add": 1}, [2.5])
        assert ep.turns == 2 and ep.output_text == "?"

    def test_environment_done_ends_the_episode_without_appending_results(self) -> None:
        executor = FakeExecutor(lambda c: Result("solved", done=True))
        gen, [ep], _, _ = run([[turn(ADD_CALL)]], executor=executor)
        assert (ep.environment_done, ep.truncated, ep.turns, ep.tool_tokens) == (True, False, 1, 0)
        assert row(gen, 0) == turn(ADD_CALL) and ep.messages[-1]["content"] == "solved"


class TestEnvironmentReset:
    def test_reset_messages_replace_the_prompt_encoded_with_the_tools(self) -> None:
        reset = [{"role": "user", "content": "Reset question"}]
        new_prompt = ids(TOK, prompt_text(TOK, reset, {"tools": [ADD.function()]}))
        engine = ScriptedEngine({tuple(new_prompt): [turn("Fine.")]})
        executor = FakeExecutor(reset=lambda item: reset)
        runner = EpisodeRunner(engine, TOK, HermesParser(), executor, EpisodeConfig(3, 100, 20))
        gen, [ep] = runner.run([prompt(0)], [item(0)], [[ADD]], PARAMS, generator=None)
        assert engine.calls[0][0] == [new_prompt]
        assert gen.rollout.prompt_ids[0].tolist() == new_prompt
        assert ep.prompt_messages == reset and ep.output_text == "Fine."

    def test_failed_start_closes_the_episodes_that_started(self) -> None:
        def reset(it: dict[str, Any]) -> None:
            if it["n"] == 1:
                raise RuntimeError("sandbox failed")

        executor = FakeExecutor(reset=reset)
        runner = EpisodeRunner(ScriptedEngine({}), TOK, HermesParser(), executor, EpisodeConfig(3, 100, 20))
        with pytest.raises(RuntimeError, match="sandbox failed"):
            runner.run([prompt(0), prompt(1)], [item(0), item(1)], [[ADD], [ADD]], PARAMS, generator=None)
        assert len(executor.started) == 2
        assert executor.finished == [t for t in executor.started if executor.items[t]["n"] == 0]


def test_config_rejects_zero_limits() -> None:
    with pytest.raises(ValueError, match="max_tokens"):
        EpisodeConfig(max_episode_steps=1, max_tokens=0, max_turn_tokens=1)


# --- end to end with the Hugging Face engine -------------------------------------------------------------------


class EosBias(torch.nn.Module):
    """A random model that ends its turns after a few tokens: +3 on the EOS logit."""

    def __init__(self, model: LlamaForCausalLM, eos: int) -> None:
        super().__init__()
        self.model = model
        self.bias = torch.zeros(model.config.vocab_size)
        self.bias[eos] = 3.0

    def forward(self, **kwargs: Any) -> Any:
        out = self.model(**kwargs)
        out.logits = out.logits + self.bias
        return out


class CallEveryTurn:
    """A parser for a model that knows no syntax: every turn calls ``echo``."""

    def parse(self, text: str) -> ParsedTurn:
        return ParsedTurn(text, [ToolCall(new_call_id(), "echo", "{}")])


def eos_biased_policy() -> EosBias:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(TOK),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        pad_token_id=PAD,
        eos_token_id=EOS,
        tie_word_embeddings=False,
    )
    return EosBias(LlamaForCausalLM(config).eval(), EOS)


def test_hf_engine_episodes_keep_sampled_tokens_and_logprobs() -> None:
    tok = TOK
    policy = eos_biased_policy()
    engine = HFRolloutEngine(policy, eos_id=EOS, pad_id=PAD, device=torch.device("cpu"), precision="fp32")
    echo = ToolSpec(name="echo", server_url="https://tools.example/echo")
    executor = FakeExecutor(lambda c: Result("ok"))
    runner = EpisodeRunner(engine, tok, CallEveryTurn(), executor, EpisodeConfig(3, 100, 10))
    prompts = [ids(tok, prompt_text(tok, [{"role": "user", "content": "q" * (i + 1)}])) for i in range(4)]
    gen, episodes = runner.run(
        prompts, [item(i) for i in range(4)], [[echo]] * 4, PARAMS, generator=torch.Generator().manual_seed(1)
    )
    r = gen.rollout
    seg = environment_segment(tok, [{"role": "tool", "tool_call_id": "x", "content": "ok"}])
    assert sum(ep.tool_tokens for ep in episodes) >= 2 * len(seg), "the seed should give multi-turn episodes"
    for i, ep in enumerate(episodes):
        n = int(r.lengths[i])
        turns, policy_mask = r.turn_ids[i, :n].tolist(), r.policy_mask[i, :n].tolist()
        assert turns[0] == 0 and all(b - a in (0, 1) for a, b in itertools.pairwise(turns))
        for s in range(max(turns) + 1):
            tokens = [t for t, k in zip(row(gen, i), turns, strict=True) if k == s]
            if s % 2:  # an environment segment: exactly the template's tokens, not trained
                assert tokens == seg
                assert all(m == 0 for m, k in zip(policy_mask, turns, strict=True) if k == s)
            else:
                assert all(m == 1 for m, k in zip(policy_mask, turns, strict=True) if k == s)
        assert ep.turns == (max(turns) + 2) // 2 and ep.policy_tokens + ep.tool_tokens == n
        assert ep.truncated  # every turn calls: each episode ends at max_episode_steps, a limit or the budget
    # The sampler's log-probs are the trainer's own for the whole interleaved row (fp32, the same weights).
    assert gen.logprobs is not None
    logp, _ = completion_logprobs(policy, r, temperature=1.0, precision="fp32")
    on_policy = r.policy_mask.bool()
    torch.testing.assert_close(gen.logprobs[on_policy], logp[on_policy], atol=1e-4, rtol=0)
    assert gen.logprobs[~on_policy].eq(0).all()


def test_row_seeded_episodes_do_not_depend_on_the_rows_beside_them() -> None:
    """With row seeds each row's turns sample from its own seeds (turn_seed): rows 2 and 3 run alone are the episodes
    they are in a batch of four (a data parallel rank runs a block of the batch)."""
    engine = HFRolloutEngine(eos_biased_policy(), eos_id=EOS, pad_id=PAD, device=torch.device("cpu"), precision="fp32")
    echo = ToolSpec(name="echo", server_url="https://tools.example/echo")
    runner = EpisodeRunner(
        engine, TOK, CallEveryTurn(), FakeExecutor(lambda c: Result("ok")), EpisodeConfig(3, 100, 10)
    )
    prompts = [ids(TOK, prompt_text(TOK, [{"role": "user", "content": "q" * (i + 1)}])) for i in range(4)]
    seeds = [1000 + i for i in range(4)]
    whole, _ = runner.run(prompts, [item(i) for i in range(4)], [[echo]] * 4, PARAMS, generator=None, row_seeds=seeds)
    part, episodes = runner.run(
        prompts[2:], [item(i) for i in (2, 3)], [[echo]] * 2, PARAMS, generator=None, row_seeds=seeds[2:]
    )
    assert [row(part, i) for i in (0, 1)] == [row(whole, i) for i in (2, 3)]
    assert all(ep.turns >= 2 for ep in episodes)  # several turns, each from its own seed
    assert len({turn_seed(s, t) for s in range(1000, 1064) for t in range(1, 20)}) == 64 * 19
    other, _ = runner.run(
        prompts[2:], [item(i) for i in (2, 3)], [[echo]] * 2, PARAMS, generator=None, row_seeds=[7, 8]
    )
    assert [row(other, i) for i in (0, 1)] != [row(part, i) for i in (0, 1)]


def test_row_seeds_need_one_a_prompt_and_the_built_in_engine() -> None:
    with pytest.raises(ValueError, match="one row seed a prompt"):
        EpisodeRunner(scripted_engine(), TOK, HermesParser(), FakeExecutor(), EpisodeConfig(3, 100, 10)).run(
            [prompt(0)], [item(0)], [[ADD]], PARAMS, generator=None, row_seeds=[1, 2]
        )
    with pytest.raises(ValueError, match="built-in rollout engine"):
        EpisodeRunner(scripted_engine(), TOK, HermesParser(), FakeExecutor(), EpisodeConfig(3, 100, 10)).run(
            [prompt(0)], [item(0)], [[ADD]], PARAMS, generator=None, row_seeds=[1]
        )


def scripted_engine() -> ScriptedEngine:
    return ScriptedEngine({tuple(prompt(0)): [turn("0")]})


def test_environment_episodes_run_in_chunks_of_the_ranks_share_of_the_sandbox_slots() -> None:
    """The ranks of a data parallel job on one host share its sandbox uid slots (16 by default): chunks of all 16
    on each of two ranks would each wait for slots the other holds until its batch ends."""
    env = AgentSpec(environment=EnvironmentSpec(type="python", source="def reset(item):\n    return None\n"))
    tools = AgentSpec(tools=[ToolSpec(name="echo", server_url="https://tools.example/echo")])
    engine = scripted_engine()
    assert AgentRollouts(env, engine, TOK, max_tokens=10).chunk_size == 16
    assert AgentRollouts(env, engine, TOK, max_tokens=10, ranks_on_host=2).chunk_size == 8
    assert AgentRollouts(env, engine, TOK, max_tokens=10, ranks_on_host=64).chunk_size == 1
    assert AgentRollouts(tools, engine, TOK, max_tokens=10, ranks_on_host=2).chunk_size is None  # no sandbox
