"""The inference engine behind ``proxima inference``: base models loaded once, LoRA adapters applied per
request, concurrent requests for one base decoded together.

One model thread makes every torch call (no two forwards ever run at once); requests are queued from any thread
(:meth:`InferenceEngine.submit`) and their progress comes back through a callback, token by token. The thread
decodes in *waves*: it takes the oldest pending request and every pending request for the same base (up to
``max_batch`` rows, each choice of a request being a row), prefills them together (left-padded, position ids from
the mask, as ``trainer.generation.rollout.generate`` does) and decodes them with one KV cache. Batching is continuous: a
row that finishes leaves the batch (its cache rows are dropped), and a request for the same base that arrives meanwhile
is prefilled and joins the running batch at the next step (its cache left-padded to the batch's length), unless a
request for another base is waiting, which then gets the next wave.

Adapters are PEFT LoRA adapters loaded into the base under names of their own and applied per row
(``adapter_names``: PEFT's mixed-batch forward), never merged into the base, so requests for different adapters of
one base, and for the base itself, share a wave. At most ``max_adapters`` adapters are loaded (the least recently
used leaves first); an adapter or a base model unused for ``idle_unload_s`` is unloaded and loaded again on demand.

The work is split by responsibility: ``trainer.serving.inference_requests`` (what a request asks and what comes
back, the queue), ``trainer.serving.inference_models`` (bases and adapters loaded and unloaded) and
``trainer.serving.inference_waves`` (a wave's prefill and decoding); this module holds the engine that joins them.

Greedy decoding (temperature 0) of a prompt is the trainer's: the prompt through the chat template as
``trainer.generation.encoding`` renders it, the base model loaded and stored in its precision as
``trainer.loops.engine.load_policy`` does, LoRA unmerged, argmax at each step, EOS ending the completion, the text
decoded as ``trainer.loops.evaluate`` decodes it. In fp32 this is the trainer's own greedy validation up to the float
rounding of batching; in bf16 the trainer samples from a merged bf16 copy (``trainer.generation.models.MergedSampler``)
and the two agree only up to bf16 rounding.

A request may carry a grammar (``Sampling.grammar``: a response format's JSON schema, a forced tool call, banned
call tokens): each choice then samples only the tokens its own matcher allows (``trainer.generation.constrained``),
EOS only where the grammar is complete.

Sampling draws each choice's tokens from a generator of its own (``seed``: choice ``i`` of a request with seed
``s`` is seeded ``s + i``), so a seeded request gives the same tokens whatever else shares its wave, as long as its
logits do: they are computed in a batch whose padding depends on the other rows, which moves them by float rounding
only (exact when the request runs alone).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, cast

import torch
from jinja2 import TemplateError

from trainer.agents.tool_calls import ToolCallParser, parser_for
from trainer.generation.constrained import GrammarError, TokenConstraint, constraints
from trainer.generation.encoding import prompt_text
from trainer.generation.models import Precision
from trainer.serving.inference_models import EngineStats, ModelCache
from trainer.serving.inference_requests import (
    AdapterInfo,
    ChoiceDelta,
    Completion,
    EngineError,
    Event,
    Failed,
    Finished,
    FinishReason,
    Progress,
    Request,
    RequestQueue,
    Sampling,
    Ticket,
    TokenLogprob,
    TopLogprob,
    UnknownModel,
)
from trainer.serving.inference_waves import WaveDecoder

__all__ = [
    "AdapterInfo",
    "ChoiceDelta",
    "Completion",
    "EngineError",
    "EngineStats",
    "Event",
    "Failed",
    "FinishReason",
    "Finished",
    "InferenceEngine",
    "Progress",
    "Sampling",
    "Ticket",
    "TokenLogprob",
    "TopLogprob",
    "UnknownModel",
]

log = logging.getLogger("proxima.inference")


class InferenceEngine:
    """Base models by name (``models``: name → local folder or hub id), adapters registered by name, requests
    decoded in waves on one model thread. Call :meth:`start` (and :meth:`wait_ready`) before expecting answers;
    requests submitted before it wait for the first wave."""

    def __init__(
        self,
        models: Mapping[str, str],
        *,
        device: torch.device,
        precision: Precision,
        max_batch: int = 16,
        max_adapters: int = 8,
        idle_unload_s: float = 900.0,
        preload: bool = True,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.device, self.precision = device, precision
        self.max_batch, self.max_adapters, self.idle_unload_s = max_batch, max_adapters, idle_unload_s
        self.preload, self.clock = preload, clock
        self.stats = EngineStats()
        self._queue = RequestQueue(max_batch=max_batch, max_adapters=max_adapters)
        self._models = ModelCache(
            models, device=device, precision=precision, max_adapters=max_adapters, stats=self.stats, clock=clock
        )
        self._waves = WaveDecoder(self._models, self._queue, device=device, precision=precision, stats=self.stats)
        self._adapters: dict[str, AdapterInfo] = {}  # registered by name, guarded by the queue's condition
        self._keys = 0
        self._ready = threading.Event()
        self._thread: threading.Thread | None = None
        self.started = int(time.time())

    # -- life cycle --------------------------------------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="proxima-inference-model", daemon=True)
        self._thread.start()

    def wait_ready(self, timeout: float | None = None) -> bool:
        """True once the base models are loaded (or failed to load: they are tried again on use)."""
        return self._ready.wait(timeout)

    @property
    def ready(self) -> bool:
        return self._ready.is_set()

    def close(self) -> None:
        self._queue.close()
        if self._thread is not None:
            self._thread.join(timeout=30)

    # -- names -------------------------------------------------------------------------------------------------

    def base_names(self) -> list[str]:
        return list(self._models.bases)

    def adapters(self) -> list[AdapterInfo]:
        with self._queue.cond:
            return list(self._adapters.values())

    def loaded_adapters(self) -> list[str]:
        """The names of the adapters whose weights are loaded, least recently used first."""
        return self._models.loaded_adapters()

    def register_adapter(self, name: str, *, base: str, path: Path) -> bool:
        """Register (or re-register) ``name`` as the adapter in folder ``path`` on ``base``; the weights load on first
        use. Returns False when ``name`` already names that adapter (nothing changes). A replaced adapter's old
        weights are unloaded between waves."""
        if base not in self._models.bases:
            raise UnknownModel(base, param="base_model_name")
        if name in self._models.bases:
            raise EngineError(f"{name!r} is the name of a base model", param="lora_name")
        with self._queue.cond:
            old = self._adapters.get(name)
            if old is not None and old.base == base and old.path == path:
                return False
            self._keys += 1
            self._adapters[name] = AdapterInfo(name, base, path, f"adapter_{self._keys}", int(time.time()))
            self._queue.cond.notify_all()
        return True

    def unregister_adapter(self, name: str) -> None:
        with self._queue.cond:
            if self._adapters.pop(name, None) is None:
                raise UnknownModel(name, param="lora_name")
            self._queue.cond.notify_all()

    def resolve(self, model: str) -> tuple[str, AdapterInfo | None]:
        """A model name → its base model and, for a registered adapter, the adapter."""
        if model in self._models.bases:
            return model, None
        with self._queue.cond:
            info = self._adapters.get(model)
        if info is None:
            raise UnknownModel(model)
        return info.base, info

    # -- prompts -----------------------------------------------------------------------------------------------

    def encode_chat(
        self, base: str, messages: Sequence[Mapping[str, Any]], *, tools: Sequence[Mapping[str, Any]] | None = None
    ) -> list[int]:
        """The messages through the base's chat template with the generation prompt, as the trainer encodes a
        prompt (``trainer.generation.encoding.encode_prompts``), ``tools`` (OpenAI's function tools) passed to the
        template as an agent job's are. Messages may hold tool calls and tool results (OpenAI's shapes)."""
        tok, b = self._models.tokenizer(base)
        kwargs = {"tools": [dict(t) for t in tools]} if tools else None
        rows = cast(list[dict[str, str]], [dict(m) for m in messages])  # the template reads any JSON values
        with b.token_lock:
            try:
                text = prompt_text(tok, rows, kwargs)
            except TemplateError as err:  # a template that refuses a conversation (roles out of order, ...)
                raise EngineError(f"the model's chat template refuses the messages: {err}", param="messages") from None
            return list(tok(text, add_special_tokens=False)["input_ids"])

    def tool_parser(self, base: str) -> ToolCallParser:
        """The parser of the base's tool-call syntax (``trainer.agents.tool_calls.parser_for``)."""
        tok, _ = self._models.tokenizer(base)
        return parser_for(tok)

    def encode_text(self, base: str, prompt: str) -> list[int]:
        """A plain prompt (completions), with the tokenizer's special tokens as vLLM adds them."""
        tok, b = self._models.tokenizer(base)
        with b.token_lock:
            return list(tok(prompt)["input_ids"])

    def context_length(self, base: str) -> int | None:
        _, b = self._models.tokenizer(base)
        return b.context

    def fit(self, base: str, n_prompt: int, max_tokens: int | None, *, param: str) -> int:
        """The completion budget of a prompt of ``n_prompt`` tokens: ``max_tokens``, or what the context leaves when
        None. A prompt that does not fit (with ``max_tokens``) raises an :class:`EngineError` naming ``param``."""
        ctx = self.context_length(base)
        if ctx is None:
            if max_tokens is None:
                raise EngineError("max_tokens is required for this model", param="max_tokens")
            return max_tokens
        if n_prompt + (max_tokens or 1) > ctx:
            asked = n_prompt + (max_tokens or 1)
            raise EngineError(
                f"This model's maximum context length is {ctx} tokens. However, you requested {asked} tokens "
                f"({n_prompt} in the {param}, {max_tokens or 1} in the completion). Please reduce the length of "
                f"the {param} or completion.",
                param=param,
                code="context_length_exceeded",
            )
        return max_tokens if max_tokens is not None else ctx - n_prompt

    # -- requests ----------------------------------------------------------------------------------------------

    def submit(self, model: str, prompt: list[int], sampling: Sampling, on_event: Callable[[Event], None]) -> Ticket:
        """Queue a request; ``on_event`` is called on the model thread with each step's :class:`Progress`, then
        once with :class:`Finished` (or :class:`Failed`). It must not block."""
        base, adapter = self.resolve(model)
        if not prompt:
            raise EngineError("the prompt is empty", param="prompt")
        req = Request(base, adapter, list(prompt), sampling, on_event, rows_left=sampling.n)
        req.constraints = self._constraints(base, sampling)
        self._queue.put(req)
        return Ticket(req)

    def _constraints(self, base: str, sampling: Sampling) -> list[TokenConstraint] | None:
        """Each choice's constraint under the request's grammar (None without one); a grammar that does not compile
        for the base's tokenizer, or that its vocabulary cannot begin to write, is an :class:`EngineError`."""
        if sampling.grammar is None:
            return None
        tok, b = self._models.tokenizer(base)
        param = sampling.grammar_param
        try:
            with b.token_lock:
                rows = constraints(sampling.grammar, tok, sampling.n)
        except GrammarError as err:
            raise EngineError(f"{param}: {err}", param=param) from None
        if not rows[0].writable(len(tok)):
            raise EngineError(f"{param}: this model's vocabulary cannot write an answer in this format", param=param)
        return rows

    def generate(self, model: str, prompt: list[int], sampling: Sampling, *, timeout: float = 300.0) -> Completion:
        """:meth:`submit` and wait: the whole result (a blocking convenience for tests and scripts)."""
        out, on_event, done = Completion.gather(sampling.n)
        self.submit(model, prompt, sampling, on_event)
        if not done.wait(timeout):
            raise TimeoutError(f"no answer within {timeout} s")
        if out.error is not None:
            raise EngineError(out.error)
        return out

    # -- the model thread --------------------------------------------------------------------------------------

    def _loop(self) -> None:
        if self.preload:
            for b in self._models.bases.values():
                try:
                    self._models.load_base(b)
                except Exception as err:  # tried again when a request asks for it
                    b.error = str(err)
                    log.warning("inference: %s", err)
        self._ready.set()
        tick = max(0.01, min(self.idle_unload_s / 4, 5.0))
        while self._queue.wait(tick):
            try:  # before the wave: a replaced or unregistered adapter's weights never take a slot it needs
                self._housekeeping()
            except Exception:
                log.exception("inference: unloading models failed")
            wave = self._queue.take_wave()
            if wave:
                try:
                    self._waves.run(wave)
                except Exception as err:  # a bug or an out-of-memory: the wave's requests fail, the server lives
                    log.exception("inference: a wave of %d requests failed", len(wave))
                    for req in wave:
                        if req.rows_left > 0:
                            req.emit(Failed(f"internal error: {type(err).__name__}", "internal"))

    def _housekeeping(self) -> None:
        """Unload adapters no longer registered under their key, and adapters and models idle too long."""
        now = self.clock()
        with self._queue.cond:
            live = {a.key for a in self._adapters.values()}
            busy = {r.base for r in self._queue.pending}
        self._models.unload_unused(live, busy, now=now, idle_unload_s=self.idle_unload_s)
