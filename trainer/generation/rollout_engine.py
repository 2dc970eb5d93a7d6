"""The rollout-engine seam: what the RL loop asks of generation, and the Hugging Face engine that answers it.

The loop hands an engine tokenised prompts and sampling parameters and gets back a :class:`Generation`: a
:class:`~trainer.generation.rollout.Rollout` (token ids; which tokens the policy produced, ``policy_mask``, which need
not be a prefix once an episode interleaves tool output; the turn of every token, ``turn_ids``), the per-token sampling
log-probs, and the time it took. Before each generation the loop pushes the policy's weights
(:meth:`RolloutEngine.push_weights`); an engine whose log-probs are exactly the trainer's (:attr:`exact_logprobs`) lets
the loop use them as the behaviour policy's instead of recomputing them. Another engine (vLLM on a GPU, a multi-turn
episode runner) is another implementation of :class:`RolloutEngine`; the loop does not change.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol

import torch
from peft import PeftModel
from torch import Tensor
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from trainer.generation.constrained import Grammar, RowConstraints
from trainer.generation.models import MergedSampler, Precision, fast_bf16_available
from trainer.generation.rollout import Rollout, StaticDecoder, generate, left_pad

# How the HF engine decodes: a growing KV cache (HF's DynamicCache), a static one (fixed shapes), or a static one with
# the decode step compiled by torch.compile (StaticDecoder).
DecodeMode = Literal["dynamic", "static", "compiled"]
# ``compile_decode: auto`` compiles when a job decodes at least this many tokens per row (steps × completion
# tokens): the compiled step saved 1.8 ms of 8.3 a decode step (small bf16 benchmark model, 64 rows, AMX Xeon) for
# 11 s of compiling with a cold cache and 3 s with a warm one (BENCHMARKS.md), so it pays for itself past about
# 6,000 decode steps; the margin covers the recompile a second shape (validation's rows) costs.
COMPILE_MIN_DECODE_STEPS = 20_000


def decode_mode(
    setting: Literal["auto", "on", "off"], *, device: torch.device, bf16_sampler: bool, decode_steps: int
) -> DecodeMode:
    """How the HF engine decodes for a job's ``compile_decode``: ``auto`` compiles only where it was measured to
    pay, a merged bf16 sampler on a CPU with fast bf16 (AMX), and only for a job that decodes at least
    ``COMPILE_MIN_DECODE_STEPS`` tokens per row."""
    if setting != "auto":
        return "compiled" if setting == "on" else "dynamic"
    pays = bf16_sampler and device.type == "cpu" and fast_bf16_available(device)
    return "compiled" if pays and decode_steps >= COMPILE_MIN_DECODE_STEPS else "dynamic"


def use_compile_cache() -> Path:
    """torch's compile cache (inductor's FX graph and AOT caches) under ``PROXIMA_HOME`` (``~/.proxima``) unless the
    deployment set ``TORCHINDUCTOR_CACHE_DIR``: a later process (the next job on the worker) reuses what an earlier
    one compiled. Returns the folder."""
    home = Path(os.environ.get("PROXIMA_HOME", Path.home() / ".proxima")).expanduser()
    return Path(os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(home / "torch-compile")))


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0
    min_new_tokens: int = 0  # EOS held off before this many tokens
    top_k: int = 0  # > 0: among the k likeliest tokens only
    stop_token_ids: frozenset[int] | None = None  # the tokens that end a completion (None: EOS; empty: none)
    stop_strings: tuple[str, ...] = ()  # a completion whose text contains one of these ends (the engine decodes)
    logprobs: bool = False  # return the sampling log-probs even where they are not the trainer's own


@dataclass
class Generation:
    """One completion (or episode) per prompt, rows in the prompts' order."""

    rollout: Rollout  # on the engine's device; a row ended by a stop token or string is not ``truncated``
    logprobs: Tensor | None  # [N, C] log π_sampler of each policy token (T-scaled), 0 elsewhere; None: not given
    seconds: float  # wall-clock time of the generation


class RolloutEngine(Protocol):
    """Generation as the RL loop uses it."""

    @property
    def exact_logprobs(self) -> bool:
        """Whether :attr:`Generation.logprobs` are the trainer's own log-probs of the same weights (up to float
        rounding): then they serve as the behaviour policy's and the loop skips its no-grad policy pass."""
        ...

    def push_weights(self, policy: torch.nn.Module, version: int) -> None:
        """The policy's weights as of ``version`` (``Engine.weights_version``); a no-op when already current."""
        ...

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams, *, generator: torch.Generator | None
    ) -> Generation:
        """Sample one completion per prompt (token ids, unpadded)."""
        ...


class HFRolloutEngine:
    """Hugging Face generation with a KV cache (``trainer.generation.rollout.generate``), in the trainer's process.

    In bf16 it samples from a merged bf16 copy of the base (``trainer.generation.models.MergedSampler``: W + ΔW,
    refreshed when the weights changed), about half the generation time; its log-probs then differ from the trainer's by
    bf16 rounding and are not exact. In fp32 the policy samples itself and its log-probs are the trainer's.

    ``grammar`` (a job's ``response_format``, ``trainer.generation.constrained.response_grammar``) constrains every
    completion it samples, training and validation alike; it needs the ``tokenizer``."""

    def __init__(
        self,
        policy: torch.nn.Module,
        *,
        eos_id: int,
        pad_id: int,
        device: torch.device,
        precision: Precision,
        base_copy: PreTrainedModel | None = None,
        tokenizer: PreTrainedTokenizerBase | None = None,
        decode: DecodeMode = "dynamic",
        lockstep: Callable[[bool], bool] | None = None,
        whole_weights: Callable[[], contextlib.AbstractContextManager[None]] | None = None,
        grammar: Grammar | None = None,
    ) -> None:
        if grammar is not None and tokenizer is None:
            raise ValueError("a grammar needs the engine's tokenizer")
        self.grammar = grammar
        self.policy, self.eos_id, self.pad_id = policy, eos_id, pad_id
        self.lockstep = lockstep  # a sharded policy's ranks decode in lockstep (trainer.generation.rollout.generate)
        self.whole_weights = whole_weights  # a sharded policy gathered whole for each generation (distributed.gathered)
        self.decode = decode
        self._decoder: StaticDecoder | None = None
        self.tokenizer = tokenizer  # decodes completions for stop strings
        self.device, self.precision = device, precision
        self.merged = (
            MergedSampler(base_copy, policy, torch.bfloat16)
            if base_copy is not None and isinstance(policy, PeftModel) and MergedSampler.supported(policy)
            else None
        )
        self._version = -1

    @property
    def exact_logprobs(self) -> bool:
        return self.merged is None and self.precision == "fp32"

    @property
    def compile_s(self) -> float:
        """Seconds spent compiling the decode step so far (0 unless ``decode`` is ``compiled``)."""
        return self._decoder.compile_s if self._decoder is not None else 0.0

    @property
    def compile_error(self) -> str | None:
        """Why the decode step could not be compiled, if it could not (it then decodes uncompiled)."""
        return self._decoder.compile_error if self._decoder is not None else None

    def push_weights(self, policy: torch.nn.Module, version: int) -> None:
        if version != self._version:
            if self.merged is not None:
                self.merged.stale = True
            self._version = version

    def sampling_model(self) -> tuple[torch.nn.Module, Precision]:
        """The model to sample from and the autocast to run it under (the merged copy is already bf16)."""
        if self.merged is not None:
            return self.merged.sync(), "fp32"
        return self.policy, self.precision

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        *,
        generator: torch.Generator | None,
        row_seeds: Sequence[int] | None = None,
    ) -> Generation:
        """Sample one completion per prompt; ``row_seeds`` (one per prompt) instead of ``generator``: each row from
        its own seed's draws (``trainer.generation.rollout.generate``). In lockstep a rank with no prompts decodes a
        padding row (the other ranks' forwards need its part of the weights) and returns no rows."""
        if not prompts and self.lockstep is not None:
            pad = self.generate([[self.pad_id]], params, generator=None, row_seeds=[0])
            none = torch.zeros(0, dtype=torch.long)
            return Generation(pad.rollout.select(none), None if pad.logprobs is None else pad.logprobs[:0], pad.seconds)
        ids, mask = left_pad(prompts, self.pad_id)
        t0 = time.perf_counter()
        model, precision = self.sampling_model()
        stop_text = self._stop_text(params.stop_strings) if params.stop_strings else None
        constraint = None
        if self.grammar is not None:
            assert self.tokenizer is not None  # checked at construction
            constraint = RowConstraints(self.grammar, self.tokenizer, len(prompts))
        if self.decode != "dynamic" and (self._decoder is None or self._decoder.model is not model):
            self._decoder = StaticDecoder(model, compiled=self.decode == "compiled")
        with self.whole_weights() if self.whole_weights is not None else contextlib.nullcontext():
            out = generate(
                model,
                ids.to(self.device),
                mask.to(self.device),
                max_new_tokens=params.max_new_tokens,
                eos_id=self.eos_id,
                pad_id=self.pad_id,
                temperature=params.temperature,
                top_p=params.top_p,
                min_new_tokens=params.min_new_tokens,
                top_k=params.top_k,
                stop_ids=None if params.stop_token_ids is None else sorted(params.stop_token_ids),
                stop_text=stop_text,
                generator=generator,
                row_seeds=row_seeds,
                precision=precision,
                # greedy decoding (validation) needs none unless asked for
                with_logprobs=(self.exact_logprobs and params.temperature > 0) or params.logprobs,
                decoder=self._decoder if self.decode != "dynamic" else None,
                lockstep=self.lockstep,
                share_prompts=True,
                constraint=constraint,
            )
        rollout, logp = out if isinstance(out, tuple) else (out, None)
        return Generation(rollout, logp, time.perf_counter() - t0)

    def _stop_text(self, strings: tuple[str, ...]) -> Callable[[list[int]], bool]:
        """Whether a completion's text contains a stop string (special tokens decoded as text, so that a stop string
        such as ``<|im_end|>`` is seen)."""
        if self.tokenizer is None:
            raise ValueError("stop strings need the engine's tokenizer")
        tokenizer = self.tokenizer

        def stopped(ids: list[int]) -> bool:
            text = tokenizer.decode(ids, skip_special_tokens=False)
            return any(s in text for s in strings)

        return stopped
