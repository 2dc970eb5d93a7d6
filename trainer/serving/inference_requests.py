"""The inference engine's requests (``trainer.serving.inference``): what a request asks and what comes back to it,
event by event, and the queue where requests wait for the model thread to take them in waves.

Any thread submits (:meth:`RequestQueue.put`); the model thread takes the oldest pending request and the next ones for
the same base that fit beside it (:meth:`RequestQueue.take_wave`), and, while the wave decodes, the requests for its
base that arrive meanwhile (:meth:`RequestQueue.take_joiners`). The queue's condition also guards the engine's adapter
registry, whose changes wake the model thread as a new request does.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from trainer.generation.constrained import Grammar, TokenConstraint

log = logging.getLogger("proxima.inference")

FinishReason = Literal["stop", "length"]


# -- what a request asks and what comes back -------------------------------------------------------------------


@dataclass(frozen=True)
class Sampling:
    """How to sample one request's completions. ``max_tokens`` counts every generated token, EOS included."""

    max_tokens: int
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0
    n: int = 1
    stop: tuple[str, ...] = ()  # the text is cut before the first of them, finish_reason stop
    seed: int | None = None
    logprobs: bool = False
    top_logprobs: int = 0
    grammar: Grammar | None = None  # what each choice may write (trainer.generation.constrained)
    grammar_param: str = "response_format"  # the request's parameter that asked for the grammar (its errors)
    # special tokens whose text stays in the decoded text (a tool-call parser's markers, such as Mistral's
    # [TOOL_CALLS]); every other special token is dropped from it, as trainer.loops.evaluate decodes
    keep_special: tuple[str, ...] = ()


@dataclass(frozen=True)
class TopLogprob:
    token_id: int
    token: str
    logprob: float

    @property
    def bytes(self) -> list[int]:
        return list(self.token.encode("utf-8"))


@dataclass(frozen=True)
class TokenLogprob:
    """A sampled token and its log-probability: log_softmax of the model's logits (not temperature-scaled), fp32;
    ``top``: the most likely tokens at that position, most likely first."""

    token_id: int
    token: str
    logprob: float
    top: tuple[TopLogprob, ...] = ()

    @property
    def bytes(self) -> list[int]:
        return list(self.token.encode("utf-8"))


@dataclass(frozen=True)
class ChoiceDelta:
    """What one choice produced in one decoding step: new text, the log-probs of its new tokens (EOS has none) and,
    on its last delta, why it ended."""

    index: int
    text: str
    logprobs: tuple[TokenLogprob, ...] = ()
    finish_reason: FinishReason | None = None


@dataclass(frozen=True)
class Progress:
    deltas: tuple[ChoiceDelta, ...]


@dataclass(frozen=True)
class Finished:
    """The request's last event: every choice has ended. ``completion_tokens`` counts EOS tokens too."""

    prompt_tokens: int
    completion_tokens: int


@dataclass(frozen=True)
class Failed:
    """The request could not run: its last event. ``kind``: its adapter did not load (``adapter``), its base model
    did not (``model``), the engine is closing (``shutdown``) or a bug (``internal``)."""

    message: str
    kind: Literal["adapter", "model", "shutdown", "internal"]


Event = Progress | Finished | Failed


class EngineError(ValueError):
    """A request refused before it is queued; ``code`` and ``param`` as OpenAI's error envelope has them."""

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message, self.param, self.code = message, param, code


class UnknownModel(EngineError):
    def __init__(self, model: str, *, param: str = "model") -> None:
        super().__init__(f"The model `{model}` does not exist.", param=param, code="model_not_found")


@dataclass(frozen=True)
class AdapterInfo:
    """A registered adapter: ``key`` names its weights inside the base (a fresh one at every registration)."""

    name: str
    base: str
    path: Path
    key: str
    created: int


@dataclass
class Completion:
    """A request's result gathered from its events (:meth:`InferenceEngine.generate`)."""

    texts: list[str]
    finish_reasons: list[FinishReason | None]
    logprobs: list[list[TokenLogprob]]
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error: str | None = None

    @classmethod
    def gather(cls, n: int) -> tuple[Completion, Callable[[Event], None], threading.Event]:
        """An empty result for ``n`` choices, the callback that fills it, and the flag set by the last event."""
        out = cls([""] * n, [None] * n, [[] for _ in range(n)])
        done = threading.Event()

        def on_event(ev: Event) -> None:
            if isinstance(ev, Progress):
                for d in ev.deltas:
                    out.texts[d.index] += d.text
                    out.logprobs[d.index] += d.logprobs
                    out.finish_reasons[d.index] = d.finish_reason or out.finish_reasons[d.index]
            elif isinstance(ev, Finished):
                out.prompt_tokens, out.completion_tokens = ev.prompt_tokens, ev.completion_tokens
                done.set()
            else:
                out.error = ev.message
                done.set()

        return out, on_event, done


@dataclass(eq=False)  # compared and hashed by identity
class Request:
    """A queued request: its base, its adapter (None: the base itself), its prompt's tokens and how to sample it;
    ``rows_left`` counts its choices still decoding."""

    base: str
    adapter: AdapterInfo | None
    prompt: list[int]
    sampling: Sampling
    on_event: Callable[[Event], None]
    cancelled: bool = False
    rows_left: int = 0
    completion_tokens: int = 0
    constraints: list[TokenConstraint] | None = None  # one per choice, with a grammar

    def emit(self, event: Event) -> None:
        """Hand ``event`` to the request's callback (on the model thread)."""
        try:
            self.on_event(event)
        except Exception:  # a caller's callback must not stop the model thread
            log.exception("inference: an event callback failed")


class Ticket:
    """A queued request: :meth:`cancel` ends it (its rows leave the batch at the next step; no more events)."""

    def __init__(self, request: Request) -> None:
        self._request = request

    def cancel(self) -> None:
        self._request.cancelled = True


class RequestQueue:
    """The requests waiting for the model thread, oldest first, taken in waves of at most ``max_batch`` rows (each
    choice of a request a row) and ``max_adapters`` distinct adapters. ``cond`` guards the queue (and the engine's
    adapter registry) and wakes the model thread."""

    def __init__(self, *, max_batch: int, max_adapters: int) -> None:
        self.max_batch, self.max_adapters = max_batch, max_adapters
        self.cond = threading.Condition()
        self.pending: list[Request] = []
        self.closed = False

    def put(self, req: Request) -> None:
        with self.cond:
            if self.closed:
                raise EngineError("the inference server is shutting down")
            self.pending.append(req)
            self.cond.notify_all()

    def close(self) -> None:
        """Refuse new requests; each pending one gets :class:`Failed` (``shutdown``), and the model thread wakes."""
        with self.cond:
            self.closed = True
            for req in self.pending:
                req.emit(Failed("the inference server is shutting down", "shutdown"))
            self.pending.clear()
            self.cond.notify_all()

    def wait(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for a request (none while one is pending); False once the queue is closed."""
        with self.cond:
            if not self.pending and not self.closed:
                self.cond.wait(timeout=timeout)
            return not self.closed

    def take_wave(self) -> list[Request]:
        """The oldest pending request and the next ones for the same base, within max_batch rows (a request with
        more choices than that runs alone) and max_adapters distinct adapters."""
        with self.cond:
            self.pending = [r for r in self.pending if not r.cancelled]
            if not self.pending:
                return []
            return self._take_fitting(self.pending[0].base, rows=0, keys=set(), first_always=True)

    def take_joiners(self, base: str, *, rows: int, keys: set[str]) -> list[Request]:
        """Pending requests for ``base`` that fit beside a running wave of ``rows`` rows using the adapters ``keys``,
        to join it; none while a request for another base waits (it would wait for as long as they come)."""
        with self.cond:
            self.pending = [r for r in self.pending if not r.cancelled]
            if not self.pending or any(r.base != base for r in self.pending):
                return []
            return self._take_fitting(base, rows=rows, keys=keys, first_always=False)

    def _take_fitting(self, base: str, *, rows: int, keys: set[str], first_always: bool) -> list[Request]:
        """The pending requests for ``base``, oldest first, that fit beside ``rows`` rows using the adapters ``keys``
        (max_batch rows, max_adapters adapters), taken off the queue; with ``first_always`` the first is taken
        whatever its size. Called with the lock held."""
        taken: list[Request] = []
        for req in self.pending:
            if req.base != base:
                continue
            new_keys = keys | ({req.adapter.key} if req.adapter else set())
            fits = rows + req.sampling.n <= self.max_batch and len(new_keys) <= self.max_adapters
            if fits or (first_always and not taken):
                taken.append(req)
                rows += req.sampling.n
                keys = new_keys
        chosen = set(map(id, taken))
        self.pending = [r for r in self.pending if id(r) not in chosen]
        return taken
