"""Rollouts: batched sampling with a KV cache and per-token log-probs (prompts are encoded by
``trainer.generation.encoding``).

Layout of a batch: prompts left-padded to ``P`` tokens, completions right-padded to ``C`` tokens. The completion mask
covers the tokens up to and including the first EOS and is built from generation lengths, never from token values
(pad may equal EOS; rl-algorithms §4.3). Position ids are ``cumsum(mask) − 1`` so that left padding does not shift
positions (§4.2). Log-probs divide the logits by the sampling temperature (§4.13) and use an fp32 log-softmax.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol, overload

import torch
from torch import Tensor

from trainer.algorithms.core_algos import entropy_from_logits, selective_log_softmax
from trainer.generation.models import Precision, autocast


def left_pad(seqs: Sequence[Sequence[int]], pad_id: int) -> tuple[Tensor, Tensor]:
    """[N] lists → ids [N, P], mask [N, P] with the padding on the left."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        if s:
            ids[i, width - len(s) :] = torch.tensor(s, dtype=torch.long)
            mask[i, width - len(s) :] = 1
    return ids, mask


def position_ids(mask: Tensor) -> Tensor:
    """cumsum(mask) − 1, clamped at 0: left padding does not shift positions."""
    return (mask.cumsum(-1) - 1).clamp(min=0)


@dataclass
class Rollout:
    """A batch of sequences: prompt, then completion (one reply, or an episode of turns and environment output).

    ``completion_mask`` says which completion positions hold a token (attention); ``policy_mask`` which of those the
    policy produced (what is trained: losses, KL, advantages). One reply: the two are equal, a prefix of the row. An
    episode: environment tokens (tool results) are 0 in ``policy_mask``, so it need not be a prefix. ``turn_ids``
    numbers the segments (policy turns and environment outputs) of each row from 0."""

    prompt_ids: Tensor  # [N, P] left-padded
    prompt_mask: Tensor  # [N, P]
    completion_ids: Tensor  # [N, C] right-padded
    completion_mask: Tensor  # [N, C] 1 up to and including the first EOS (an episode: its last token)
    lengths: Tensor  # [N] completion lengths (EOS included)
    truncated: Tensor  # [N] bool: no EOS within max_new_tokens
    policy_mask: Tensor = None  # type: ignore[assignment]  # [N, C] the policy's tokens; default completion_mask
    turn_ids: Tensor = None  # type: ignore[assignment]  # [N, C] segment number of each token; default 0

    def __post_init__(self) -> None:
        if self.policy_mask is None:
            self.policy_mask = self.completion_mask
        if self.turn_ids is None:
            self.turn_ids = torch.zeros_like(self.completion_ids)

    def __len__(self) -> int:
        return self.prompt_ids.shape[0]

    def select(self, idx: Tensor) -> Rollout:
        return Rollout(*(t[idx] for t in self.tensors()))

    def to(self, device: torch.device | str) -> Rollout:
        return Rollout(*(t.to(device) for t in self.tensors()))

    def tensors(self) -> tuple[Tensor, ...]:
        return (
            self.prompt_ids,
            self.prompt_mask,
            self.completion_ids,
            self.completion_mask,
            self.lengths,
            self.truncated,
            self.policy_mask,
            self.turn_ids,
        )

    @staticmethod
    def concat(parts: Sequence[Rollout], pad_id: int) -> Rollout:
        """Concatenate rollouts of different prompt/completion widths (re-padding prompts left, completions right)."""
        p = max(r.prompt_ids.shape[1] for r in parts)
        c = max(r.completion_ids.shape[1] for r in parts)

        def pad(t: Tensor, width: int, value: int, left: bool) -> Tensor:
            extra = width - t.shape[1]
            if extra == 0:
                return t
            fill = torch.full((t.shape[0], extra), value, dtype=t.dtype, device=t.device)
            return torch.cat([fill, t] if left else [t, fill], dim=1)

        return Rollout(
            torch.cat([pad(r.prompt_ids, p, pad_id, True) for r in parts]),
            torch.cat([pad(r.prompt_mask, p, 0, True) for r in parts]),
            torch.cat([pad(r.completion_ids, c, pad_id, False) for r in parts]),
            torch.cat([pad(r.completion_mask, c, 0, False) for r in parts]),
            torch.cat([r.lengths for r in parts]),
            torch.cat([r.truncated for r in parts]),
            torch.cat([pad(r.policy_mask, c, 0, False) for r in parts]),
            torch.cat([pad(r.turn_ids, c, 0, False) for r in parts]),
        )


MIN_TEMPERATURE = 1e-4
"""Temperatures below this sample as this: the scaled logits stay finite in float32 (|z| < 1e4 · 3.4e34)."""


def _sample_next(
    logits: Tensor,
    *,
    temperature: float,
    top_p: float,
    generator: torch.Generator | None,
    uniform: Tensor | None = None,
) -> Tensor:
    """One token per row from logits [N, V]: greedy at temperature 0, else softmax(z/T) restricted to the top-p
    nucleus. ``uniform`` [N] (one U(0, 1) draw per row) samples each row by inverting its distribution's CDF instead
    of drawing from ``generator``: a row's token then depends on its own draw alone, not on the batch it is in."""
    if temperature == 0.0:
        return logits.argmax(-1)
    # A temperature so small that z/T overflows float32 would make softmax NaN: below MIN_TEMPERATURE the
    # distribution is one-hot to float precision anyway.
    probs = torch.softmax(logits.float() / max(temperature, MIN_TEMPERATURE), dim=-1)
    if top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        outside = sorted_p.cumsum(-1) - sorted_p >= top_p  # keep the smallest prefix whose mass reaches top_p
        outside[..., 0] = False  # the most likely token always stays (a top_p that rounds to 0 in float32 keeps it)
        sorted_p = sorted_p.masked_fill(outside, 0.0)
        choice = _draw(sorted_p, generator, uniform)
        return order.gather(-1, choice.unsqueeze(-1)).squeeze(-1)
    return _draw(probs, generator, uniform)


def _draw(weights: Tensor, generator: torch.Generator | None, uniform: Tensor | None) -> Tensor:
    """An index per row of ``weights`` [N, V] (non-negative, unnormalised) in proportion to them: the row's CDF
    inverted at one U(0, 1) draw (``uniform`` [N], else drawn from ``generator``). One draw a row, where
    ``torch.multinomial`` draws an exponential per vocabulary entry (about 10 % of a small model's decode step)."""
    if uniform is None:
        uniform = torch.rand(weights.shape[0], generator=generator, device=weights.device, dtype=torch.float64)
    cdf = weights.float().cumsum(-1)  # float32: a CDF error of ~1e-7, far below any sampling noise
    target = uniform.to(cdf.dtype).unsqueeze(-1) * cdf[:, -1:]
    idx = torch.searchsorted(cdf, target, right=True).squeeze(-1)  # the first entry whose CDF passes the draw
    # A draw that rounds up to the total passes no entry: it takes the last entry of positive weight.
    last = weights.shape[-1] - 1 - (weights > 0).flip(-1).int().argmax(-1)
    return torch.minimum(idx, last)


class Constraint(Protocol):
    """What each row may sample next (``trainer.generation.constrained.RowConstraints``: a response format's
    grammar): the logits with forbidden tokens at −inf, and each running row's sampled token fed back."""

    def mask(self, logits: Tensor, done: Tensor) -> Tensor:
        """logits [N, V], done [N] → the logits to sample from, [N, V]."""
        ...

    def advance(self, tokens: Tensor, done: Tensor) -> None:
        """tokens [N] sampled at this step; done [N] the rows that had ended before it."""
        ...

    def dead(self) -> Tensor:
        """[N] bool on the CPU: the rows whose grammar the vocabulary could not continue, so that they could only
        end (EOS) with an answer that is not whole."""
        ...


def row_uniforms(seeds: Sequence[int], steps: int, device: torch.device) -> Tensor:
    """[N, steps] U(0, 1) draws, row i's from its own generator seeded with ``seeds[i]``."""
    rows = [torch.rand(steps, generator=torch.Generator().manual_seed(int(s)), dtype=torch.float64) for s in seeds]
    return torch.stack(rows).to(device) if rows else torch.zeros((0, steps), dtype=torch.float64, device=device)


def top_k_logits(logits: Tensor, k: int) -> Tensor:
    """Logits [N, V] with all but the k largest of each row set to −inf (k ≤ 0 or k ≥ V: unchanged)."""
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth, float("-inf"))


CACHE_BUCKET = 64  # a static cache's length is the prompt plus the new tokens rounded up to this: few shapes


class StaticDecoder:
    """A sampling model's decode steps on a static KV cache (HF's ``StaticCache``) with fixed shapes: the cache is
    the prompt plus the new tokens rounded up to ``CACHE_BUCKET``, and the attention mask is that long from the
    start, so every decode step of a generation, and of every later generation of the same rows and bucket, has
    the same shapes. With ``compiled`` the step is ``torch.compile``'d once for the decoder's life (a second shape
    makes torch compile a dynamic-shape graph that serves the rest); torch's FX graph cache keeps the compiled code on
    disk (``TORCHINDUCTOR_CACHE_DIR``), so a later process compiles faster. Uncompiled it is the same computation
    eagerly (what the tests compare the dynamic cache with). ``compile_s`` sums the calls that compiled. A compile
    that fails (``compile_error`` says why) leaves the decoder uncompiled: the generation goes on, eagerly."""

    def __init__(self, model: torch.nn.Module, *, compiled: bool) -> None:
        self.model, self.compiled = model, compiled
        self._step = torch.compile(self._forward) if compiled else self._forward
        self._shapes: set[tuple[int, int]] = set()
        self.compile_s = 0.0
        self.compile_error: str | None = None  # why compiling failed, when it did: the step then runs uncompiled

    def _forward(self, ids: Tensor, mask: Tensor, pos: Tensor, cache_position: Tensor, cache: Any) -> Tensor:
        out = self.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=pos,
            cache_position=cache_position,
            past_key_values=cache,
            use_cache=True,
        )
        return out.logits[:, -1]

    def cache(self, rows: int, prompt: int, new_tokens: int) -> tuple[Any, int]:
        """A fresh static cache for ``rows`` rows of ``prompt`` + ``new_tokens`` tokens, and its length."""
        from transformers import StaticCache

        length = -(-(prompt + new_tokens) // CACHE_BUCKET) * CACHE_BUCKET
        return StaticCache(config=self.model.config, max_cache_len=length), length

    def step(self, ids: Tensor, mask: Tensor, pos: Tensor, cache_position: Tensor, cache: Any) -> Tensor:
        """The next logits [N, V] after ``ids`` [N, 1] at ``pos`` [N, 1], written at ``cache_position`` [1]."""
        shape = (ids.shape[0], mask.shape[1])
        if not self.compiled or shape in self._shapes:
            return self._step(ids, mask, pos, cache_position, cache)
        t0 = time.perf_counter()
        try:
            out = self._step(ids, mask, pos, cache_position, cache)
        except Exception as err:  # a machine that cannot compile (no C++ compiler for inductor's CPU code, ...)
            self.compile_error = f"{type(err).__name__}: {err}"[:500]
            self.compiled, self._step = False, self._forward
            return self._forward(ids, mask, pos, cache_position, cache)  # rewrites the same cache positions
        self._shapes.add(shape)
        self.compile_s += time.perf_counter() - t0
        return out


@overload
def generate(
    model: torch.nn.Module,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    *,
    max_new_tokens: int,
    eos_id: int,
    pad_id: int,
    temperature: float,
    top_p: float = 1.0,
    min_new_tokens: int = 0,
    top_k: int = 0,
    stop_ids: Sequence[int] | None = None,
    stop_text: Callable[[list[int]], bool] | None = None,
    generator: torch.Generator | None = None,
    row_seeds: Sequence[int] | None = None,
    precision: Precision = "fp32",
    with_logprobs: Literal[False] = False,
    decoder: StaticDecoder | None = None,
    lockstep: Callable[[bool], bool] | None = None,
    constraint: Constraint | None = None,
) -> Rollout: ...


@overload
def generate(
    model: torch.nn.Module,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    *,
    max_new_tokens: int,
    eos_id: int,
    pad_id: int,
    temperature: float,
    top_p: float = 1.0,
    min_new_tokens: int = 0,
    top_k: int = 0,
    stop_ids: Sequence[int] | None = None,
    stop_text: Callable[[list[int]], bool] | None = None,
    generator: torch.Generator | None = None,
    row_seeds: Sequence[int] | None = None,
    precision: Precision = "fp32",
    with_logprobs: Literal[True],
    decoder: StaticDecoder | None = None,
    lockstep: Callable[[bool], bool] | None = None,
    constraint: Constraint | None = None,
) -> tuple[Rollout, Tensor]: ...


@overload
def generate(
    model: torch.nn.Module,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    *,
    max_new_tokens: int,
    eos_id: int,
    pad_id: int,
    temperature: float,
    top_p: float = 1.0,
    min_new_tokens: int = 0,
    top_k: int = 0,
    stop_ids: Sequence[int] | None = None,
    stop_text: Callable[[list[int]], bool] | None = None,
    generator: torch.Generator | None = None,
    row_seeds: Sequence[int] | None = None,
    precision: Precision = "fp32",
    with_logprobs: bool,
    decoder: StaticDecoder | None = None,
    lockstep: Callable[[bool], bool] | None = None,
    constraint: Constraint | None = None,
    share_prompts: bool = False,
) -> Rollout | tuple[Rollout, Tensor]: ...


@torch.no_grad()  # not inference_mode: the rollout's tensors must be usable in autograd afterwards
def generate(
    model: torch.nn.Module,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    *,
    max_new_tokens: int,
    eos_id: int,
    pad_id: int,
    temperature: float,
    top_p: float = 1.0,
    min_new_tokens: int = 0,
    top_k: int = 0,
    stop_ids: Sequence[int] | None = None,
    stop_text: Callable[[list[int]], bool] | None = None,
    generator: torch.Generator | None = None,
    row_seeds: Sequence[int] | None = None,
    precision: Precision = "fp32",
    with_logprobs: bool = False,
    decoder: StaticDecoder | None = None,
    lockstep: Callable[[bool], bool] | None = None,
    constraint: Constraint | None = None,
    share_prompts: bool = False,
) -> Rollout | tuple[Rollout, Tensor]:
    """Sample one completion per prompt row with a KV cache. prompt_ids, prompt_mask [N, P] → :class:`Rollout`.

    Rows that emitted EOS keep emitting pad and stop attending; the loop ends when every row is done.
    ``min_new_tokens`` holds EOS off (its logit −inf) for that many tokens. ``stop_ids`` (default: EOS alone; ``[]``:
    none) are the tokens that end a row, included in its completion; ``stop_text`` is asked after each token of a
    running row whether the row's tokens so far end it (stop strings). ``top_k`` > 0 samples among the k likeliest
    tokens only (applied before top-p). A row that ended is not ``truncated``; one that ran to
    ``max_new_tokens`` is. ``row_seeds`` (one per row) replace ``generator``: each row samples from draws of its own
    seed (:func:`row_uniforms`), so that it samples the same tokens in any batch (a data parallel run's shards).

    ``with_logprobs`` also returns log π(o_t | q, o_<t) of each sampled token, [N, C] fp32 (0 past a row's end):
    the model's T-scaled log-softmax at sampling time, before EOS is held off and before the top-p cut, i.e. what
    :func:`completion_logprobs` computes with a full forward. Equal to it up to float rounding (KV-cache decoding vs
    one pass) when the sampler is the policy itself in fp32; not with a bf16 sampler copy (test_rollout).

    ``decoder`` decodes on its static cache (:class:`StaticDecoder`, compiled or not) instead of a growing one.

    ``lockstep(running)`` (a sharded model's ranks, ``trainer.generation.distributed``) says whether any rank still has
    a running row: the loop goes on, its rows all done, until no rank has one, so that every rank runs the same
    forwards.

    ``share_prompts``: rows with the same prompt (a group's samples) share its prefill (:func:`distinct_prompts`):
    each distinct prompt is run once and its keys and values copied to its rows (on either cache).

    ``constraint`` (a response format's grammar, :class:`Constraint`) restricts what each row samples; the log-probs
    stay the model's own (what :func:`completion_logprobs` recomputes for the loss), taken before the mask; a row whose
    grammar went dead ends on EOS, but incomplete: ``truncated``, as serving reports it (``length``).
    """
    forwards = _Forwards(model, prompt_ids, prompt_mask, max_new_tokens, decoder, precision)
    logits = forwards.prefill(prompt_ids, prompt_mask, share_prompts)
    rows = _Completions.empty(
        len(prompt_ids), max_new_tokens, prompt_ids.device, pad_id, eos_id, stop_ids, stop_text, with_logprobs
    )
    uniforms = None if row_seeds is None else row_uniforms(row_seeds, max_new_tokens, prompt_ids.device)
    sampler = _Sampler(eos_id, temperature, top_p, top_k, min_new_tokens, generator, uniforms)
    _decode(forwards, rows, sampler, logits, max_new_tokens, lockstep, constraint)
    return rows.result(prompt_ids, prompt_mask, None if constraint is None else constraint.dead().to(rows.done.device))


@dataclass
class _Sampler:
    """How :func:`generate` picks each row's next token: EOS held off (its logit −inf) for the first
    ``min_new_tokens``, then the top-k and top-p cuts at ``temperature``, drawn from ``generator`` or, with row seeds,
    from each row's own ``uniforms``."""

    eos_id: int
    temperature: float
    top_p: float
    top_k: int
    min_new_tokens: int
    generator: torch.Generator | None
    uniforms: Tensor | None  # [N, max_new_tokens] each row's own U(0, 1) draws (row_seeds), else None

    def next_token(self, logits: Tensor, t: int) -> Tensor:
        """Token t of each row, [N], from the logits [N, V] that predict it."""
        if t < self.min_new_tokens:
            logits = logits.clone()
            logits[:, self.eos_id] = float("-inf")
        return _sample_next(
            top_k_logits(logits, self.top_k),
            temperature=self.temperature,
            top_p=self.top_p,
            generator=self.generator,
            uniform=None if self.uniforms is None else self.uniforms[:, t],
        )

    def logprob(self, logits: Tensor, tok: Tensor) -> Tensor:
        """log π(tok) [N] fp32: the T-scaled log-softmax of the model's logits [N, V], before EOS is held off and
        before the top-k and top-p cuts (what a full forward gives :func:`completion_logprobs`)."""
        z = logits.float() / (max(self.temperature, MIN_TEMPERATURE) if self.temperature > 0 else 1.0)
        return z.gather(-1, tok.unsqueeze(-1)).squeeze(-1) - z.logsumexp(-1)


@dataclass
class _Completions:
    """The completions of :func:`generate` as they are sampled: each row's tokens (pad once it ended), whether and
    where it ended, and its tokens' log-probs when asked for (0 past its end)."""

    tokens: Tensor  # [N, max_new_tokens], pad_id where nothing was sampled
    done: Tensor  # [N] bool: the row ended (a stop token, or its stop text)
    lengths: Tensor  # [N] the tokens up to and including the one that ended the row; max_new_tokens while it runs
    logps: Tensor | None  # [N, max_new_tokens] fp32; None: not asked for
    pad_id: int
    eos_id: int
    stops: Tensor | None  # the ids that end a row; None: EOS alone
    stop_text: Callable[[list[int]], bool] | None

    @classmethod
    def empty(
        cls,
        n: int,
        max_new_tokens: int,
        device: torch.device,
        pad_id: int,
        eos_id: int,
        stop_ids: Sequence[int] | None,
        stop_text: Callable[[list[int]], bool] | None,
        with_logprobs: bool,
    ) -> _Completions:
        return cls(
            tokens=torch.full((n, max_new_tokens), pad_id, dtype=torch.long, device=device),
            done=torch.zeros(n, dtype=torch.bool, device=device),
            lengths=torch.full((n,), max_new_tokens, dtype=torch.long, device=device),
            logps=torch.zeros((n, max_new_tokens), dtype=torch.float32, device=device) if with_logprobs else None,
            pad_id=pad_id,
            eos_id=eos_id,
            stops=None if stop_ids is None else torch.tensor(sorted(set(stop_ids)), dtype=torch.long, device=device),
            stop_text=stop_text,
        )

    def add(self, t: int, tok: Tensor, logits: Tensor, sampler: _Sampler) -> Tensor:
        """Token t of each row, [N] (pad where the row had ended), its log-prob under the ``logits`` that predicted it
        and the rows it ends; the tokens as kept."""
        tok = torch.where(self.done, torch.full_like(tok, self.pad_id), tok)
        self.tokens[:, t] = tok
        if self.logps is not None:
            lp = sampler.logprob(logits, tok)
            self.logps[:, t] = torch.where(self.done, torch.zeros_like(lp), lp)
        hit = tok == self.eos_id if self.stops is None else torch.isin(tok, self.stops)
        if self.stop_text is not None:
            ends = self.stop_text
            texts = [
                i for i in range(len(tok)) if not self.done[i] and not hit[i] and ends(self.tokens[i, : t + 1].tolist())
            ]
            hit[texts] = True
        newly = (~self.done) & hit
        self.lengths = torch.where(newly, torch.full_like(self.lengths, t + 1), self.lengths)
        self.done = self.done | newly
        return tok

    def result(
        self, prompt_ids: Tensor, prompt_mask: Tensor, cut: Tensor | None = None
    ) -> Rollout | tuple[Rollout, Tensor]:
        """The rollout, its completions as wide as the longest (and the log-probs [N, C] when asked for); ``cut``
        [N] bool: rows truncated although they ended (a dead grammar's EOS)."""
        width = int(self.lengths.max())
        cmask = (torch.arange(width, device=self.lengths.device).unsqueeze(0) < self.lengths.unsqueeze(-1)).long()
        truncated = ~self.done if cut is None else ~self.done | cut
        rollout = Rollout(prompt_ids, prompt_mask, self.tokens[:, :width], cmask, self.lengths, truncated)
        if self.logps is not None:
            return rollout, self.logps[:, :width]
        return rollout


class _Forwards:
    """The model's forwards for one :func:`generate`: the prompts' prefill, then one token of each row a step, on the
    model's growing KV cache or on ``decoder``'s static one (whose attention mask is whole from the start)."""

    def __init__(
        self,
        model: torch.nn.Module,
        prompt_ids: Tensor,
        prompt_mask: Tensor,
        max_new_tokens: int,
        decoder: StaticDecoder | None,
        precision: Precision,
    ) -> None:
        self.model, self.decoder, self.precision = model, decoder, precision
        self.device = prompt_ids.device
        n, self.p = prompt_ids.shape
        self.mask = prompt_mask.clone()
        self.static: Any = None
        if decoder is not None:  # the whole mask from the start: the prompt's, then a 0 for every position to come
            self.static, length = decoder.cache(n, self.p, max_new_tokens)
            self.mask = torch.cat([self.mask, self.mask.new_zeros((n, length - self.p))], dim=1)
        self.past: Any = self.static
        self.pos = position_ids(prompt_mask)[:, -1:]  # [N, 1] the position of each row's last token

    def prefill(self, prompt_ids: Tensor, prompt_mask: Tensor, share_prompts: bool) -> Tensor:
        """Run the prompts into the cache: the logits [N, V] that predict each row's first token."""
        from transformers.cache_utils import StaticLayer

        shared = distinct_prompts(self.model, prompt_ids, prompt_mask) if share_prompts else None
        static = self.static
        if shared is not None and static is not None and any(type(layer) is not StaticLayer for layer in static.layers):
            shared = None
        with autocast(self.precision, self.device):
            if shared is not None:
                return self._prefill_shared(prompt_ids[shared[0]], prompt_mask[shared[0]], shared[1], shared[2])
            step = self.model(
                input_ids=prompt_ids,
                attention_mask=self.mask,
                position_ids=position_ids(prompt_mask),
                use_cache=True,
                logits_to_keep=1,
                **(
                    {}
                    if static is None
                    else {"past_key_values": static, "cache_position": torch.arange(self.p, device=self.device)}
                ),
            )
        self.past = step.past_key_values
        return step.logits[:, -1]

    def _prefill_shared(self, first_ids: Tensor, first_mask: Tensor, inverse: Tensor, past: Any) -> Tensor:
        """The prefill of each distinct prompt once (``first_ids`` [D, P]), its keys and values then copied to the
        rows that have it (``inverse`` [N])."""
        step = prompts_forward(self.model, first_ids, first_mask, past)
        if self.static is None:
            past.reorder_cache(inverse)
            self.past = past
        else:  # each row's prompt written into the static cache, as a prefill of all rows would have written it
            for mine, theirs in zip(self.static.layers, past.layers, strict=True):
                mine.update(theirs.keys[inverse], theirs.values[inverse])
        return step.logits[inverse, -1]

    def step(self, tok: Tensor, running: Tensor, t: int) -> Tensor:
        """Run token t of each row (``tok`` [N]; ``running`` [N] the rows still attending): the logits [N, V] that
        predict token t + 1."""
        self.pos = self.pos + 1
        if self.decoder is not None:
            self.mask[:, self.p + t] = running.long()
            with autocast(self.precision, self.device):
                at = torch.tensor([self.p + t], device=self.device)
                return self.decoder.step(tok.unsqueeze(-1), self.mask, self.pos, at, self.past)
        self.mask = torch.cat([self.mask, running.long().unsqueeze(-1)], dim=-1)
        with autocast(self.precision, self.device):
            step = self.model(
                input_ids=tok.unsqueeze(-1),
                attention_mask=self.mask,
                position_ids=self.pos,
                past_key_values=self.past,
                use_cache=True,
            )
        self.past = step.past_key_values
        return step.logits[:, -1]


def _decode(
    forwards: _Forwards,
    rows: _Completions,
    sampler: _Sampler,
    logits: Tensor,
    max_new_tokens: int,
    lockstep: Callable[[bool], bool] | None,
    constraint: Constraint | None = None,
) -> None:
    """Sample token after token into ``rows`` until every row has ended (on every rank, with ``lockstep``) or
    ``max_new_tokens`` were sampled; the last token is not run through the model. Under a ``constraint`` each row
    samples from its masked logits, and its log-prob is the unmasked one's."""
    for t in range(max_new_tokens):
        if constraint is None:
            tok = rows.add(t, sampler.next_token(logits, t), logits, sampler)
        else:
            ended = rows.done.clone()
            tok = rows.add(t, sampler.next_token(constraint.mask(logits, ended), t), logits, sampler)
            constraint.advance(tok, ended)
        finished = bool(rows.done.all())
        if lockstep is not None and t < max_new_tokens - 1:
            finished = not lockstep(not finished)
        if finished or t == max_new_tokens - 1:
            return
        logits = forwards.step(tok, ~rows.done, t)


@overload
def completion_logprobs(
    model: torch.nn.Module,
    batch: Rollout,
    *,
    temperature: float,
    precision: Precision,
    with_entropy: bool = False,
    with_hidden: Literal[False] = False,
    share_prompts: bool = False,
) -> tuple[Tensor, Tensor | None]: ...


@overload
def completion_logprobs(
    model: torch.nn.Module,
    batch: Rollout,
    *,
    temperature: float,
    precision: Precision,
    with_entropy: bool = False,
    with_hidden: Literal[True],
    share_prompts: bool = False,
) -> tuple[Tensor, Tensor | None, Tensor]: ...


def completion_logprobs(
    model: torch.nn.Module,
    batch: Rollout,
    *,
    temperature: float,
    precision: Precision,
    with_entropy: bool = False,
    with_hidden: bool = False,
    share_prompts: bool = False,
) -> tuple[Tensor, Tensor | None] | tuple[Tensor, Tensor | None, Tensor]:
    """log π(o_t | q, o_<t) / T-scaled, fp32, for every completion position: [B, C], and the entropy [B, C]
    (no gradient) when asked. Differentiable when called with grad enabled.

    ``with_hidden`` also returns the last hidden state that predicts each completion token, [B, C, H] in the
    forward's dtype: position ``t − 1``, the state before token ``t`` is chosen (what a value head on the policy's
    trunk reads; ``trainer.loops.critic``).

    ``share_prompts``: rows with the same prompt (a GRPO group's samples) share one forward of it (see
    :func:`shared_prompt_forward`), which makes the number of forwards depend on the rows: a caller whose forwards
    run in lockstep with other ranks' (a sharded base) leaves it off."""
    c = batch.completion_ids.shape[1]
    out = shared_prompt_forward(model, batch, precision=precision, with_hidden=with_hidden) if share_prompts else None
    if out is not None:
        logits, hidden = out
    else:
        ids = torch.cat([batch.prompt_ids, batch.completion_ids], dim=1)
        mask = torch.cat([batch.prompt_mask, batch.completion_mask], dim=1)
        with autocast(precision, ids.device):
            whole = model(
                input_ids=ids,
                attention_mask=mask,
                position_ids=position_ids(mask),
                use_cache=False,
                logits_to_keep=c + 1,
                output_hidden_states=with_hidden,
            )
        # logits[:, t] predicts token t + 1: the last one predicts nothing we kept
        logits = whole.logits[:, :-1]
        hidden = whole.hidden_states[-1][:, -c - 1 : -1] if with_hidden else None  # the final norm's output
    logp, entropy = completion_logprobs_from_logits(
        logits, batch.completion_ids, temperature=temperature, with_entropy=with_entropy
    )
    if with_hidden:
        assert hidden is not None
        return logp, entropy, hidden
    return logp, entropy


def shared_prompt_forward(
    model: torch.nn.Module, batch: Rollout, *, precision: Precision, with_hidden: bool
) -> tuple[Tensor, Tensor | None] | None:
    """The logits [B, C, V] that predict the completion tokens (and the final norm's output there, [B, C, H], when
    ``with_hidden``) with each distinct prompt of the batch run once: a forward of the distinct prompts fills a KV
    cache, each row takes its prompt's entries, and a forward of the completions attends to them. Causal attention
    makes the prompt's keys and values independent of what follows, so this is the whole rows' forward with the
    prompt's FLOPs divided by the rows that share it (a GRPO group: by its size); with the graph, the cache's rows
    are an index of the prompts' and backward sums their gradients. None (nothing run) when every row has its own
    prompt, when LoRA's dropout is on (a shared prompt would share its dropout mask across the rows), or when the
    model's cache is not a full-attention ``DynamicCache`` on every layer (sliding windows, linear attention)."""
    if model.training:
        return None
    shared = distinct_prompts(model, batch.prompt_ids, batch.prompt_mask)
    if shared is None:
        return None
    first, inverse, cache = shared
    pids, pmask = batch.prompt_ids, batch.prompt_mask
    mask = torch.cat([pmask, batch.completion_mask[:, :-1]], dim=1)
    with autocast(precision, pids.device):
        head = prompts_forward(model, pids[first], pmask[first], cache, with_hidden=with_hidden)
        logits, hidden = head.logits[inverse], head.hidden_states[-1][inverse, -1:] if with_hidden else None
        if batch.completion_ids.shape[1] > 1:  # the last completion token predicts nothing: not run
            cache.reorder_cache(inverse)
            tail = model(
                input_ids=batch.completion_ids[:, :-1],
                attention_mask=mask,
                position_ids=position_ids(mask)[:, pids.shape[1] :],
                past_key_values=cache,
                use_cache=True,
                output_hidden_states=with_hidden,
            )
            logits = torch.cat([logits, tail.logits], dim=1)
            if hidden is not None:
                hidden = torch.cat([hidden, tail.hidden_states[-1]], dim=1)
    return logits, hidden


def distinct_prompts(
    model: torch.nn.Module, prompt_ids: Tensor, prompt_mask: Tensor
) -> tuple[Tensor, Tensor, Any] | None:
    """The rows of a batch that share a prompt: ``(first, inverse, cache)``, ``first`` [D] a row of each of the D
    distinct prompts, ``inverse`` [N] each row's prompt among them, ``cache`` an empty ``DynamicCache`` for the
    prompts' forward (``reorder_cache(inverse)`` then gives each row its prompt's keys and values). None when every
    row has its own prompt, or when the model's cache is not full attention on every layer (a sliding window or
    linear attention keeps other state)."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    n = prompt_ids.shape[0]
    if n < 2:
        return None
    distinct, inverse = torch.unique(prompt_ids.masked_fill(prompt_mask == 0, -1), dim=0, return_inverse=True)
    config = getattr(model, "config", None)
    if len(distinct) == n or config is None or getattr(config, "is_encoder_decoder", False):
        return None
    cache = DynamicCache(config=config)
    if any(type(layer) is not DynamicLayer for layer in cache.layers):
        return None
    first = torch.empty(len(distinct), dtype=torch.long, device=prompt_ids.device)
    first.scatter_(0, inverse, torch.arange(n, device=prompt_ids.device))  # equal prompts: any of their rows
    return first, inverse, cache


def prompts_forward(model: torch.nn.Module, ids: Tensor, mask: Tensor, cache: Any, *, with_hidden: bool = False) -> Any:
    """The forward of left-padded prompts ``ids`` [D, P] into ``cache``: the model's output, logits of the last
    position only (what predicts the first new token)."""
    return model(
        input_ids=ids,
        attention_mask=mask,
        position_ids=position_ids(mask),
        past_key_values=cache,
        use_cache=True,
        logits_to_keep=1,
        output_hidden_states=with_hidden,
    )


def completion_logprobs_from_logits(
    logits: Tensor, completion_ids: Tensor, *, temperature: float, with_entropy: bool = False
) -> tuple[Tensor, Tensor | None]:
    """The completion tokens' T-scaled log-probs [B, C] (fp32) from the logits that predict them, [B, C, V]: the
    position before each token; and their entropy (no graph) when asked."""
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    logp = selective_log_softmax(logits, completion_ids)
    entropy = None
    if with_entropy:
        with torch.no_grad():
            entropy = entropy_from_logits(logits.detach())
    return logp, entropy


def micro_slices(n: int, size: int | None) -> list[slice]:
    """Consecutive slices of at most ``size`` rows covering 0..n (one slice when size is None)."""
    size = size or n
    return [slice(s, min(s + size, n)) for s in range(0, n, size)]
