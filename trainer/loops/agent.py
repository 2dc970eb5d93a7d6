"""Agent episodes in the online RL loop: the job's tools or environment, the episode runner over the rollout
engine, grading an episode as OpenAI grades one (its final answer as ``output_text``, its calls as ``output_tools``)
and the episode metrics.

The loop (``trainer.loops.rl``) asks :class:`AgentRollouts` for a batch of episodes where it would ask the rollout
engine for completions; what comes back is the same :class:`~trainer.generation.rollout_engine.Generation` (a rollout
whose ``policy_mask`` leaves out tool output), so scoring, advantages and the update do not change: only the policy's
tokens are trained.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from trainer.agents.episodes import Episode, EpisodeConfig, EpisodeRunner
from trainer.agents.tool_calls import parser_for
from trainer.agents.tools import HttpToolExecutor, PythonEnvironmentExecutor, ToolExecutor
from trainer.generation.rollout import Rollout
from trainer.generation.rollout_engine import Generation, RolloutEngine, SamplingParams
from trainer.grading.remote_graders import RemoteConfig
from trainer.grading.sandbox import configured_sandbox
from trainer.loops.engine import cat_padded
from trainer.loops.evaluate import EvalResult, Scores, grade_batch
from trainer.spec import graders
from trainer.spec import metrics as M
from trainer.spec.agent_spec import AgentSpec, ToolSpec
from trainer.spec.data import PromptItem


@dataclass
class EpisodeBatch:
    """One episode per prompt, in the prompts' order, with what grading needs."""

    generation: Generation
    episodes: list[Episode]

    @property
    def texts(self) -> list[str]:
        return [e.output_text for e in self.episodes]

    @property
    def output_tools(self) -> list[list[dict[str, Any]]]:
        return [list(e.output_tools) for e in self.episodes]

    @property
    def trace_ids(self) -> list[str]:
        return [e.trace_id for e in self.episodes]

    @property
    def finish_reasons(self) -> list[graders.FinishReason]:
        return ["length" if e.truncated else "stop" for e in self.episodes]

    def grade(self, grader: graders.Grader, items: Sequence[PromptItem]) -> Scores:
        return grade_batch(
            grader,
            self.texts,
            items,
            self.finish_reasons,
            output_tools=self.output_tools,
            trace_ids=self.trace_ids,
        )


class AgentRollouts:
    """The job's episodes: its executor (the tool servers over HTTP, or the sandboxed environment), the tool-call
    parser of the model's chat template, and the runner over the rollout engine."""

    def __init__(
        self,
        agent: AgentSpec,
        engine: RolloutEngine,
        tokenizer: PreTrainedTokenizerBase,
        *,
        max_tokens: int,
        template_kwargs: Mapping[str, Any] | None = None,
        remote: RemoteConfig | None = None,
        ranks_on_host: int = 1,
    ) -> None:
        self.agent = agent
        self.pad_id = tokenizer.pad_token_id
        # An environment's episode holds a sandbox (one of the host's uid slots) from reset to its end, and a batch's
        # episodes advance turn by turn together: more at once than there are slots would wait for slots the others
        # hold until the batch ends. The batch runs in chunks of at most that many episodes instead; the ranks of a
        # data parallel job on this host share the slots, so each takes its share.
        slots = configured_sandbox().uid_slots
        self.chunk_size = max(1, slots // max(1, ranks_on_host)) if agent.environment is not None else None
        self.executor: ToolExecutor = (
            PythonEnvironmentExecutor(agent.environment)
            if agent.environment is not None
            else HttpToolExecutor(remote or RemoteConfig())
        )
        self.runner = EpisodeRunner(
            engine,
            tokenizer,
            parser_for(tokenizer),
            self.executor,
            EpisodeConfig(max_episode_steps=agent.max_episode_steps, max_tokens=max_tokens, max_turn_tokens=max_tokens),
            template_kwargs=dict(template_kwargs or {}),
        )

    def tools_of(self, item: PromptItem) -> list[ToolSpec]:
        """The tools offered for an item: its line's ``tools``, else every tool of the job."""
        return item.tools if item.tools is not None else list(self.agent.tools)

    def run(
        self,
        prompts: Sequence[list[int]],
        items: Sequence[PromptItem],
        params: SamplingParams,
        *,
        generator: torch.Generator | None,
        row_seeds: Sequence[int] | None = None,
    ) -> EpisodeBatch:
        chunk = self.chunk_size or len(prompts)
        parts: list[tuple[Generation, list[Episode]]] = []
        for start in range(0, len(prompts), max(chunk, 1)):
            rows = slice(start, start + chunk)
            its = list(items[rows])
            tools = [self.tools_of(it) for it in its]
            seeds = list(row_seeds[rows]) if row_seeds is not None else None
            parts.append(self.runner.run(list(prompts[rows]), its, tools, params, generator=generator, row_seeds=seeds))
        if len(parts) == 1:
            return EpisodeBatch(*parts[0])
        gens = [g for g, _ in parts]
        rollout = Rollout.concat([g.rollout for g in gens], self.pad_id)
        logps = [g.logprobs for g in gens]
        width = rollout.completion_ids.shape[1]
        logprobs = (
            cat_padded([lp for lp in logps if lp is not None], width) if all(lp is not None for lp in logps) else None
        )
        generation = Generation(rollout, logprobs, sum(g.seconds for g in gens))
        return EpisodeBatch(generation, [e for _, eps in parts for e in eps])

    def evaluate(
        self,
        prompts: Sequence[list[int]],
        items: Sequence[PromptItem],
        grader: graders.Grader,
        params: SamplingParams,
        *,
        generator: torch.Generator | None,
        batch_size: int = 64,
    ) -> tuple[EvalResult, list[Episode]]:
        """Mean reward of one episode per prompt (greedy at temperature 0), and the episodes. Sampled validation
        draws from ``generator`` (the validation's own, :func:`~trainer.loops.evaluate.validation_generator`): torch's
        global RNG also drives training (LoRA dropout, ...), which validating must not move."""
        episodes: list[Episode] = []
        texts: list[str] = []
        scores: list[Scores] = []
        for start in range(0, len(prompts), batch_size):
            chunk = items[start : start + batch_size]
            batch = self.run(prompts[start : start + batch_size], chunk, params, generator=generator)
            scores.append(batch.grade(grader, chunk))
            episodes += batch.episodes
            texts += batch.texts
        rewards = torch.cat([s.rewards for s in scores])
        names = scores[0].sub.keys() if scores else ()
        sub = {n: float(torch.cat([s.sub[n] for s in scores]).mean()) for n in names}
        return EvalResult(mean_reward=float(rewards.mean()), n=len(texts), sub_means=sub, texts=texts), episodes

    def close(self) -> None:
        self.executor.close()


def episode_metrics(episodes: Sequence[Episode]) -> dict[str, float]:
    """The step's episode metrics (trainer.spec.metrics' agent section and its per-tool families)."""
    n = len(episodes)
    if not n:
        return {}
    calls: Counter[str] = Counter()
    errors: Counter[str] = Counter()
    latency: dict[str, list[float]] = {}
    for e in episodes:
        calls.update(e.tool_calls_by_name)
        errors.update(e.tool_errors_by_name)
        for name, seconds in e.tool_latency_by_name.items():
            latency.setdefault(name, []).extend(seconds)
    total_calls = sum(calls.values())
    all_latency = [s for values in latency.values() for s in values]
    m = {
        M.EPISODE_TURNS_MEAN: sum(e.turns for e in episodes) / n,
        M.EPISODE_TOOL_CALLS_MEAN: total_calls / n,
        M.EPISODE_TOOL_CALL_RATE: sum(1 for e in episodes if e.tool_calls_by_name) / n,
        M.EPISODE_FORMAT_ERROR_FRAC: sum(1 for e in episodes if e.format_error) / n,
        M.EPISODE_TRUNCATED_FRAC: sum(1 for e in episodes if e.truncated) / n,
        M.EPISODE_POLICY_TOKENS_MEAN: sum(e.policy_tokens for e in episodes) / n,
        M.EPISODE_TOOL_TOKENS_MEAN: sum(e.tool_tokens for e in episodes) / n,
        M.TOOL_ERROR_RATE: sum(errors.values()) / total_calls if total_calls else 0.0,
    }
    if all_latency:
        m[M.TOOL_LATENCY_MEAN] = sum(all_latency) / len(all_latency)
    for name in sorted(set(calls) | set(errors)):
        m[M.TOOL_CALLS_OF.name(name)] = calls[name] / n
        m[M.TOOL_ERRORS_OF.name(name)] = float(errors[name])
        if latency.get(name):
            m[M.TOOL_LATENCY_OF.name(name)] = sum(latency[name]) / len(latency[name])
    return m


def episode_record(episode: Episode) -> dict[str, Any]:
    """What the rollouts API keeps of an episode besides its final answer: the transcript after the prompt (assistant
    turns with their tool calls, tool results), and its counts."""
    return {
        "messages": list(episode.messages),
        "turns": episode.turns,
        "tool_calls": sum(episode.tool_calls_by_name.values()),
        "tool_errors": sum(episode.tool_errors_by_name.values()),
        "format_error": episode.format_error,
        "truncated": episode.truncated,
    }
