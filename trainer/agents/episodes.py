"""Agent episodes: a policy's turns interleaved with the results of the tools it calls, as one RL row.

:class:`EpisodeRunner` drives any :class:`~trainer.generation.rollout_engine.RolloutEngine` turn by turn. Each turn is
one batched ``generate`` over the episodes still running (prompt = the episode's prompt and its completion so far);
every turn that ended with EOS is parsed in the model's own tool-call syntax (``trainer.agents.tool_calls``); the calls
of all episodes run at once on a thread pool (tools are I/O-bound: their waits overlap); their results become tool
messages, whose tokens — the chat template's text between the end of the assistant turn and the next generated content,
tokenised alone (:func:`~trainer.agents.tool_calls.environment_segment`) — are appended to the row. The transcript is
never re-tokenised: a row's completion is exactly the generated ids followed by the environment's ids, turn after turn.

An episode ends with a turn that makes no call (its final answer); or truncated, when a turn reaches its token limit
without EOS, when ``max_episode_steps`` turns have been taken and the last one still calls tools (those calls are not
run: no turn would read their results), or when the tokens budget ``max_tokens`` (policy and environment tokens)
leaves no room for the tool results and one more token; or with a format error, a call that does not parse (the turn
stays in the row and is trained: the policy learns not to write it); or when the environment says it is done.

A call of a tool the episode does not offer is answered with an error message without asking the executor (counted
under :data:`UNKNOWN_TOOL` as a call and an error); when the episode offers no tools at all, every call goes to the
executor with ``tool=None`` (an environment answers any call).

The row (``trainer.generation.rollout.Rollout``): ``completion_mask`` covers every token of the episode, ``policy_mask``
only the policy's (environment tokens are 0: no loss, KL or entropy on them), ``turn_ids`` numbers the segments (policy
turn 0, its tool results 1, policy turn 2, ...), ``lengths`` counts all tokens and ``truncated`` is
:attr:`Episode.truncated`.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import uuid
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from transformers import PreTrainedTokenizerBase

from trainer.agents.tool_calls import ToolCall, ToolCallFormatError, ToolCallParser, environment_segment
from trainer.generation.encoding import prompt_text
from trainer.generation.rollout import Rollout, left_pad
from trainer.generation.rollout_engine import Generation, HFRolloutEngine, RolloutEngine, SamplingParams
from trainer.spec.agent_spec import ToolSpec
from trainer.spec.data import PromptItem

log = logging.getLogger(__name__)

UNKNOWN_TOOL = "(unknown)"
"""The key under which calls to a tool the episode does not offer are counted (not a valid tool name, so it cannot
collide with one; the name the model wrote is unbounded, so it is not a metric key)."""


@dataclass(frozen=True)
class EpisodeConfig:
    """How long an episode may run."""

    max_episode_steps: int  # model turns (OpenAI's agent RFT counts steps as turns)
    max_tokens: int  # the completion budget of an episode: policy and environment tokens together
    max_turn_tokens: int  # the most tokens of one turn (a turn gets min(this, the budget left))

    def __post_init__(self) -> None:
        for name in ("max_episode_steps", "max_tokens", "max_turn_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")


@dataclass
class Episode:
    """One row's episode, as graders, metrics and the rollouts browser see it.

    ``messages`` is the transcript after the prompt in chat-completions shape: assistant messages (with
    ``tool_calls`` ``[{"id", "type": "function", "function": {"name", "arguments"}}]`` when the turn called tools)
    and tool messages ``{"role": "tool", "tool_call_id", "content"}``. ``output_text`` is the last assistant turn's
    content (the final answer, or the text of the turn that ended the episode otherwise), ``output_tools`` every
    call in that shape (OpenAI's ``sample.output_tools``)."""

    trace_id: str
    prompt_messages: list[dict[str, Any]] | None = None  # the environment's reset() messages when they replaced it
    messages: list[dict[str, Any]] = field(default_factory=list)
    output_text: str = ""
    output_tools: list[dict[str, Any]] = field(default_factory=list)
    turns: int = 0
    tool_calls_by_name: dict[str, int] = field(default_factory=dict)
    tool_errors_by_name: dict[str, int] = field(default_factory=dict)
    tool_latency_s: list[float] = field(default_factory=list)  # every executed call, in order
    tool_latency_by_name: dict[str, list[float]] = field(default_factory=dict)
    format_error: bool = False
    truncated: bool = False  # the budget, a turn's token limit or max_episode_steps ended it before a final answer
    environment_done: bool = False  # the environment ended it (ToolResult.done)
    policy_tokens: int = 0
    tool_tokens: int = 0


class ToolOutcome(Protocol):
    """What a tool call returns (``trainer.agents.tools.ToolResult``)."""

    @property
    def output(self) -> str: ...  # what the model sees as the tool message

    @property
    def error(self) -> str | None: ...  # the failure kind, None on success

    @property
    def seconds(self) -> float: ...

    @property
    def done(self) -> bool: ...  # the environment ends the episode


class ToolExecutor(Protocol):
    """Runs an episode's tool calls (``trainer.agents.tools``: HTTP tool servers, or a sandboxed Python environment)."""

    def start(
        self, item: dict[str, Any], trace_id: str, prompt_messages: list[dict[str, str]]
    ) -> Sequence[Mapping[str, Any]] | None:
        """Opens an episode; an environment returns its reset() messages (None: keep the prompt)."""
        ...

    def call(self, call: ToolCall, tool: ToolSpec | None, *, item: dict[str, Any], trace_id: str) -> ToolOutcome:
        """One call, blocking and bounded by timeouts; thread-safe. Never raises for a failing tool."""
        ...

    def finish(self, trace_id: str) -> None:
        """Closes an episode (an environment's sandbox)."""
        ...


def turn_seed(row_seed: int, turn: int) -> int:
    """The sampling seed of a row's turn ``turn`` (1, 2, ...): distinct for every row and turn of a batch whose rows'
    seeds are consecutive (``base + i``, as a data parallel draw gives them), fewer than 2³² rows."""
    return (row_seed + turn * 2**32) % 2**64


@dataclass(frozen=True)
class _Unknown:
    """The answer to a call of a tool the episode does not offer (the executor is not asked)."""

    output: str
    error: str | None = "unknown_tool"
    seconds: float = 0.0
    done: bool = False


@dataclass
class _Row:
    """One episode in progress: its token row and its record."""

    item: PromptItem
    tools: dict[str, ToolSpec]
    prompt: list[int]
    episode: Episode
    ids: list[int] = field(default_factory=list)
    policy: list[int] = field(default_factory=list)
    segments: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finished: bool = False
    seed: int | None = None  # the row's own sampling seed (data parallel runs); its turn t samples from turn_seed

    def append(self, ids: Sequence[int], *, policy: bool, logprobs: Sequence[float] | None = None) -> None:
        segment = self.segments[-1] + 1 if self.segments else 0
        self.ids.extend(ids)
        self.policy.extend([int(policy)] * len(ids))
        self.segments.extend([segment] * len(ids))
        self.logprobs.extend(logprobs if logprobs is not None else [0.0] * len(ids))
        if policy:
            self.episode.policy_tokens += len(ids)
        else:
            self.episode.tool_tokens += len(ids)

    def say(self, message: dict[str, Any]) -> None:
        self.episode.messages.append(message)
        if message["role"] == "assistant":
            self.episode.output_text = message["content"]

    def end(self, *, truncated: bool = False, format_error: bool = False, environment_done: bool = False) -> None:
        self.finished = True
        self.episode.truncated = truncated
        self.episode.format_error = format_error
        self.episode.environment_done = environment_done


class EpisodeRunner:
    """Runs a batch of episodes to their end, returned as one :class:`~trainer.generation.rollout_engine.Generation`."""

    def __init__(
        self,
        engine: RolloutEngine,
        tokenizer: PreTrainedTokenizerBase,
        parser: ToolCallParser,
        executor: ToolExecutor,
        config: EpisodeConfig,
        *,
        template_kwargs: Mapping[str, Any] | None = None,
        max_concurrent_calls: int = 64,
    ) -> None:
        self.engine, self.tokenizer, self.parser, self.executor = engine, tokenizer, parser, executor
        self.config = config
        self.template_kwargs = dict(template_kwargs or {})
        self.max_concurrent_calls = max_concurrent_calls
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.pad_id = int(pad) if pad is not None else 0

    def run(
        self,
        prompts: list[list[int]],
        items: list[PromptItem],
        tools: list[list[ToolSpec]],
        params: SamplingParams,
        *,
        generator: torch.Generator | None,
        row_seeds: Sequence[int] | None = None,
    ) -> tuple[Generation, list[Episode]]:
        """One episode per prompt (already encoded with its tools by the chat template), rows in the prompts' order.
        ``params.max_new_tokens`` is ignored: each turn gets ``min(max_turn_tokens, budget left)``; the rest of
        ``params`` applies to every turn. Generation.logprobs holds the engine's log-probs at policy positions (0
        elsewhere) when it gave them for every turn, else None. ``row_seeds`` (one per prompt, the built-in engine
        only) instead of ``generator``: each row's turn t samples from its own seed :func:`turn_seed`, so a row's
        episode does not depend on the rows beside it (data parallel runs split a batch across ranks)."""
        if not (len(prompts) == len(items) == len(tools)) or not prompts:
            raise ValueError(f"run() needs as many items and tool lists as prompts, at least one ({len(prompts)})")
        if row_seeds is not None and len(row_seeds) != len(prompts):
            raise ValueError(f"run() needs one row seed a prompt ({len(row_seeds)} for {len(prompts)})")
        if row_seeds is not None and not isinstance(self.engine, HFRolloutEngine):
            raise ValueError("row seeds need the built-in rollout engine")
        t0 = time.perf_counter()
        seeds: Sequence[int | None] = row_seeds if row_seeds is not None else [None] * len(prompts)
        rows = [
            _Row(
                item,
                {t.name: t for t in offered},
                list(prompt),
                Episode(trace_id="trace_" + uuid.uuid4().hex),
                seed=seed,
            )
            for prompt, item, offered, seed in zip(prompts, items, tools, seeds, strict=True)
        ]
        with ThreadPoolExecutor(self.max_concurrent_calls, thread_name_prefix="episode-tools") as pool:
            started = self._start(pool, rows)
            try:
                for row, messages in started:
                    if messages:  # the environment's reset() replaces the prompt: encoded with the row's tools
                        row.episode.prompt_messages = [dict(m) for m in messages]
                        row.prompt = self._encode(row.episode.prompt_messages, list(row.tools.values()))
                device: torch.device | None = None
                with_logprobs = True
                for step in range(1, self.config.max_episode_steps + 1):
                    active = [r for r in rows if not r.finished]
                    if not active:
                        break
                    device, has_logprobs = self._turn(pool, active, step, params, generator)
                    with_logprobs = with_logprobs and has_logprobs
            finally:
                # Every opened episode is closed, also when a turn failed.
                for done in [pool.submit(self.executor.finish, r.episode.trace_id) for r, _ in started]:
                    done.result()
        assert device is not None  # at least one turn ran: every row starts unfinished
        return self._generation(rows, device, with_logprobs, time.perf_counter() - t0), [r.episode for r in rows]

    def _start(
        self, pool: ThreadPoolExecutor, rows: list[_Row]
    ) -> list[tuple[_Row, Sequence[Mapping[str, Any]] | None]]:
        """Opens every episode concurrently (an environment's reset may start a sandbox): each row with the messages
        its environment returned. When one fails to open, closes the others and raises its error."""
        futures = [pool.submit(self.executor.start, r.item.item, r.episode.trace_id, r.item.messages) for r in rows]
        started: list[tuple[_Row, Sequence[Mapping[str, Any]] | None]] = []
        failure: Exception | None = None
        for row, future in zip(rows, futures, strict=True):
            try:
                started.append((row, future.result()))
            except Exception as err:  # the others are closed first
                failure = failure or err
        if failure is not None:
            for row, _ in started:
                self.executor.finish(row.episode.trace_id)
            raise failure
        return started

    def _encode(self, messages: list[dict[str, Any]], tools: list[ToolSpec]) -> list[int]:
        kwargs = self.template_kwargs | ({"tools": [t.function() for t in tools]} if tools else {})
        text = prompt_text(self.tokenizer, messages, kwargs)
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _turn(
        self,
        pool: ThreadPoolExecutor,
        active: list[_Row],
        step: int,
        params: SamplingParams,
        generator: torch.Generator | None,
    ) -> tuple[torch.device, bool]:
        """One turn of every active episode: one batched generation, then all their tool calls at once. Returns the
        engine's device and whether it gave log-probs."""
        cfg = self.config
        limits = [min(cfg.max_turn_tokens, cfg.max_tokens - len(r.ids)) for r in active]
        out, logprobs = self._sample(active, limits, step, params, generator)
        ids, lengths, no_eos = out.completion_ids.cpu(), out.lengths.tolist(), out.truncated.tolist()

        pending: list[tuple[_Row, list[tuple[ToolCall, Future[ToolOutcome]]]]] = []
        for j, row in enumerate(active):
            n = min(int(lengths[j]), limits[j])
            turn = ids[j, :n].tolist()
            row.append(turn, policy=True, logprobs=logprobs[j, :n].tolist() if logprobs is not None else None)
            row.episode.turns += 1
            calls = self._reply(row, turn, step, cut=no_eos[j] or int(lengths[j]) > limits[j])
            if calls:
                pending.append((row, [(c, pool.submit(self._call, row, c)) for c in calls]))

        # Every call of every episode was submitted before the first wait: their latencies overlap.
        for row, submitted in pending:
            self._answer(row, [(call, future.result()) for call, future in submitted])
        return out.completion_ids.device, logprobs is not None

    def _sample(
        self,
        active: list[_Row],
        limits: list[int],
        step: int,
        params: SamplingParams,
        generator: torch.Generator | None,
    ) -> tuple[Rollout, torch.Tensor | None]:
        """The turn's replies of every active episode, each row at most its ``limits`` tokens, in one generation: its
        rollout and the tokens' log-probs [N, C] on the CPU (None when the engine gives none)."""
        # One generate for the batch; a row with a smaller limit than the batch's is cut to it afterwards, which
        # is exactly what sampling with its own limit would have produced (tokens are drawn left to right).
        width = max(limits)
        turn_params = dataclasses.replace(
            params, max_new_tokens=width, min_new_tokens=min(params.min_new_tokens, width)
        )
        rows = [r.prompt + r.ids for r in active]
        if active[0].seed is not None:  # every row has one (run() gives all or none)
            assert isinstance(self.engine, HFRolloutEngine)
            seeds = [turn_seed(r.seed, step) for r in active if r.seed is not None]
            gen = self.engine.generate(rows, turn_params, generator=None, row_seeds=seeds)
        else:
            gen = self.engine.generate(rows, turn_params, generator=generator)
        return gen.rollout, gen.logprobs.float().cpu() if gen.logprobs is not None else None

    def _reply(self, row: _Row, turn: list[int], step: int, *, cut: bool) -> list[ToolCall]:
        """Read one episode's reply of this turn (``turn`` its tokens; ``cut`` when it ran out of tokens before its
        EOS) into its messages: the tool calls to run, none when the reply ends the episode."""
        if cut:
            row.say({"role": "assistant", "content": self._decode(turn)})
            row.end(truncated=True)
            return []
        text = self._decode(turn[:-1])  # without the EOS that ended the turn
        try:
            parsed = self.parser.parse(text)
        except ToolCallFormatError as err:
            log.debug("episode %s: format error in turn %d: %s", row.episode.trace_id, step, err)
            row.say({"role": "assistant", "content": text})
            row.end(format_error=True)
            return []
        message: dict[str, Any] = {"role": "assistant", "content": parsed.content}
        if parsed.calls:
            message["tool_calls"] = [c.chat_completions() for c in parsed.calls]
            row.episode.output_tools.extend(message["tool_calls"])
        row.say(message)
        if not parsed.calls:
            row.end()
            return []
        if step == self.config.max_episode_steps:
            row.end(truncated=True)  # no turn follows to read the results: the calls are not run
            return []
        return parsed.calls

    def _call(self, row: _Row, call: ToolCall) -> ToolOutcome:
        """One call: the executor for a tool the episode offers (or for any name when it offers none: an
        environment answers every call), an error message for any other name."""
        tool = row.tools.get(call.name)
        if tool is None and row.tools:
            offered = ", ".join(sorted(row.tools))
            return _Unknown(f"Error: there is no tool named {call.name!r}. The tools are: {offered}.")
        return self.executor.call(call, tool, item=row.item.item, trace_id=row.episode.trace_id)

    def _answer(self, row: _Row, answered: list[tuple[ToolCall, ToolOutcome]]) -> None:
        """Records a turn's tool results and appends their tokens, or ends the episode when the environment is done
        or the budget has no room for them and one more policy token."""
        ep = row.episode
        rendered: list[dict[str, Any]] = []
        for call, result in answered:
            known = not isinstance(result, _Unknown)
            key = call.name if known else UNKNOWN_TOOL
            ep.tool_calls_by_name[key] = ep.tool_calls_by_name.get(key, 0) + 1
            if result.error is not None:
                ep.tool_errors_by_name[key] = ep.tool_errors_by_name.get(key, 0) + 1
            if known:
                ep.tool_latency_s.append(result.seconds)
                ep.tool_latency_by_name.setdefault(key, []).append(result.seconds)
            message = {"role": "tool", "tool_call_id": call.id, "content": result.output}
            row.say(message)
            rendered.append(message | {"name": call.name})  # some templates label a tool message with its tool
        if any(result.done for _, result in answered):
            row.end(environment_done=True)
            return
        segment = environment_segment(
            self.tokenizer, rendered, template_kwargs=self.template_kwargs, turn_end=self._decode(row.ids[-1:])
        )
        if len(row.ids) + len(segment) + 1 > self.config.max_tokens:
            row.end(truncated=True)
            return
        row.append(segment, policy=False)

    def _decode(self, ids: Sequence[int]) -> str:
        # Special tokens kept: tool-call markers are special tokens in some vocabularies (Mistral's [TOOL_CALLS]).
        text = self.tokenizer.decode(list(ids), skip_special_tokens=False)
        assert isinstance(text, str)
        return text

    def _generation(self, rows: list[_Row], device: torch.device, with_logprobs: bool, seconds: float) -> Generation:
        n, width = len(rows), max(len(r.ids) for r in rows)
        prompt_ids, prompt_mask = left_pad([r.prompt for r in rows], self.pad_id)
        completion = torch.full((n, width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((n, width), dtype=torch.long)
        policy = torch.zeros((n, width), dtype=torch.long)
        turn_ids = torch.zeros((n, width), dtype=torch.long)
        logprobs = torch.zeros((n, width), dtype=torch.float32)
        for i, r in enumerate(rows):
            k = len(r.ids)
            completion[i, :k] = torch.tensor(r.ids, dtype=torch.long)
            mask[i, :k] = 1
            policy[i, :k] = torch.tensor(r.policy, dtype=torch.long)
            turn_ids[i, :k] = torch.tensor(r.segments, dtype=torch.long)
            logprobs[i, :k] = torch.tensor(r.logprobs, dtype=torch.float32)
        rollout = Rollout(
            prompt_ids,
            prompt_mask,
            completion,
            mask,
            torch.tensor([len(r.ids) for r in rows], dtype=torch.long),
            torch.tensor([r.episode.truncated for r in rows], dtype=torch.bool),
            policy,
            turn_ids,
        ).to(device)
        return Generation(rollout, logprobs.to(device) if with_logprobs else None, seconds)
