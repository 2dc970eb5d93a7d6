"""The inference engine behind ``proxima inference`` (issue 14): base models loaded once, LoRA adapters applied per
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

Greedy decoding (temperature 0) of a prompt is the trainer's: the prompt through the chat template as
``trainer.generation.encoding`` renders it, the base model loaded and stored in its precision as
``trainer.loops.engine.load_policy`` does, LoRA unmerged, argmax at each step, EOS ending the completion, the text
decoded as ``trainer.loops.evaluate`` decodes it. In fp32 this is the trainer's own greedy validation up to the float
rounding of batching; in bf16 the trainer samples from a merged bf16 copy (``trainer.generation.models.MergedSampler``)
and the two agree only up to bf16 rounding.

Sampling draws each choice's tokens from a generator of its own (``seed``: choice ``i`` of a request with seed
``s`` is seeded ``s + i``), so a seeded request gives the same tokens whatever else shares its wave, as long as its
logits do: they are computed in a batch whose padding depends on the other rows, which moves them by float rounding
only (exact when the request runs alone).
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from peft import PeftModel
from torch import Tensor
from transformers import AutoConfig, PreTrainedTokenizerBase
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer

from trainer.generation.encoding import prompt_text
from trainer.generation.models import (
    ModelError,
    Precision,
    autocast,
    load_base_model,
    load_tokenizer,
    store_frozen_linears_in,
)
from trainer.generation.rollout import _sample_next, left_pad, position_ids

log = logging.getLogger("proxima.inference")

NO_ADAPTER = "__base__"  # PEFT's name, in adapter_names, for a row that runs the base alone
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
class EngineStats:
    model_loads: int = 0
    model_unloads: int = 0
    adapter_loads: int = 0
    adapter_unloads: int = 0  # every unload: evictions and idle unloads
    adapter_evictions: int = 0  # unloads to make room (the LRU bound)
    waves: int = 0
    joins: int = 0  # requests that joined a running wave
    rows: int = 0
    max_wave_rows: int = 0


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


# -- internal state --------------------------------------------------------------------------------------------


@dataclass
class _Base:
    name: str
    source: str  # a local folder or a hub id
    tokenizer: PreTrainedTokenizerBase | None = None
    context: int | None = None  # max_position_embeddings
    model: torch.nn.Module | None = None  # the base, or a PeftModel around it once an adapter is loaded
    loaded: list[str] = field(default_factory=list)  # adapter keys loaded into it
    last_used: float = 0.0
    error: str | None = None  # why the last load failed
    token_lock: threading.Lock = field(default_factory=threading.Lock)


@dataclass(eq=False)  # compared and hashed by identity
class _Request:
    base: str
    adapter: AdapterInfo | None
    prompt: list[int]
    sampling: Sampling
    on_event: Callable[[Event], None]
    cancelled: bool = False
    rows_left: int = 0
    completion_tokens: int = 0


class Ticket:
    """A queued request: :meth:`cancel` ends it (its rows leave the batch at the next step; no more events)."""

    def __init__(self, request: _Request) -> None:
        self._request = request

    def cancel(self) -> None:
        self._request.cancelled = True


@dataclass(eq=False)
class _Row:
    """One choice being decoded."""

    req: _Request
    index: int
    generator: torch.Generator | None
    ids: list[int] = field(default_factory=list)  # generated tokens, EOS excluded
    n_tokens: int = 0  # generated tokens, EOS included
    text: str = ""  # the decoded text, cut at a stop string
    sent: int = 0  # characters of text already sent
    finish: FinishReason | None = None


def _held_back(text: str, stops: Sequence[str]) -> int:
    """How many trailing characters of ``text`` may not be sent yet: the longest suffix that begins a stop string,
    and a trailing replacement character (a UTF-8 sequence the next token may complete)."""
    hold = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), hold, -1):
            if text.endswith(s[:k]):
                hold = k
                break
    if text.endswith("\ufffd"):
        hold = max(hold, len(text) - len(text.rstrip("\ufffd")))
    return hold


def _first_stop(text: str, stops: Sequence[str]) -> int:
    """Index where the earliest stop string starts in ``text``, or -1."""
    found = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(found) if found else -1


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
        self._bases = {name: _Base(name, source) for name, source in models.items()}
        self._adapters: dict[str, AdapterInfo] = {}
        self._lru: OrderedDict[str, tuple[str, AdapterInfo]] = OrderedDict()  # adapter key → (base, info): loaded
        self._adapter_used: dict[str, float] = {}  # adapter key → when a wave last used it
        self._pending: list[_Request] = []
        self._cond = threading.Condition()
        self._closed = False
        self._ready = threading.Event()
        self._thread: threading.Thread | None = None
        self._keys = 0
        self.stats = EngineStats()
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
        with self._cond:
            self._closed = True
            for req in self._pending:
                self._emit(req, Failed("the inference server is shutting down", "shutdown"))
            self._pending.clear()
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=30)

    # -- names -------------------------------------------------------------------------------------------------

    def base_names(self) -> list[str]:
        return list(self._bases)

    def adapters(self) -> list[AdapterInfo]:
        with self._cond:
            return list(self._adapters.values())

    def loaded_adapters(self) -> list[str]:
        """The names of the adapters whose weights are loaded, least recently used first."""
        return [info.name for _, info in list(self._lru.values())]

    def register_adapter(self, name: str, *, base: str, path: Path) -> bool:
        """Register (or re-register) ``name`` as the adapter in folder ``path`` on ``base``; the weights load on first
        use. Returns False when ``name`` already names that adapter (nothing changes). A replaced adapter's old
        weights are unloaded between waves."""
        if base not in self._bases:
            raise UnknownModel(base, param="base_model_name")
        if name in self._bases:
            raise EngineError(f"{name!r} is the name of a base model", param="lora_name")
        with self._cond:
            old = self._adapters.get(name)
            if old is not None and old.base == base and old.path == path:
                return False
            self._keys += 1
            self._adapters[name] = AdapterInfo(name, base, path, f"adapter_{self._keys}", int(time.time()))
            self._cond.notify_all()
        return True

    def unregister_adapter(self, name: str) -> None:
        with self._cond:
            if self._adapters.pop(name, None) is None:
                raise UnknownModel(name, param="lora_name")
            self._cond.notify_all()

    def resolve(self, model: str) -> tuple[str, AdapterInfo | None]:
        """A model name → its base model and, for a registered adapter, the adapter."""
        if model in self._bases:
            return model, None
        with self._cond:
            info = self._adapters.get(model)
        if info is None:
            raise UnknownModel(model)
        return info.base, info

    # -- prompts -----------------------------------------------------------------------------------------------

    def _tokenizer(self, base: str) -> tuple[PreTrainedTokenizerBase, _Base]:
        b = self._bases[base]
        with b.token_lock:
            if b.tokenizer is None:
                tokenizer = load_tokenizer(b.source)
                try:
                    config = AutoConfig.from_pretrained(b.source)
                except (OSError, ValueError) as err:
                    raise ModelError(f"cannot load model {b.source!r}: {err}") from None
                b.tokenizer, b.context = tokenizer, getattr(config, "max_position_embeddings", None)
            return b.tokenizer, b

    def encode_chat(self, base: str, messages: list[dict[str, str]]) -> list[int]:
        """The messages through the base's chat template with the generation prompt, as the trainer encodes a
        prompt (``trainer.generation.encoding.encode_prompts``)."""
        tok, b = self._tokenizer(base)
        with b.token_lock:
            return list(tok(prompt_text(tok, messages), add_special_tokens=False)["input_ids"])

    def encode_text(self, base: str, prompt: str) -> list[int]:
        """A plain prompt (completions), with the tokenizer's special tokens as vLLM adds them."""
        tok, b = self._tokenizer(base)
        with b.token_lock:
            return list(tok(prompt)["input_ids"])

    def context_length(self, base: str) -> int | None:
        _, b = self._tokenizer(base)
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
        req = _Request(base, adapter, list(prompt), sampling, on_event, rows_left=sampling.n)
        with self._cond:
            if self._closed:
                raise EngineError("the inference server is shutting down")
            self._pending.append(req)
            self._cond.notify_all()
        return Ticket(req)

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

    def _emit(self, req: _Request, event: Event) -> None:
        try:
            req.on_event(event)
        except Exception:  # a caller's callback must not stop the model thread
            log.exception("inference: an event callback failed")

    def _loop(self) -> None:
        if self.preload:
            for b in self._bases.values():
                try:
                    self._load_base(b)
                except Exception as err:  # tried again when a request asks for it
                    b.error = str(err)
                    log.warning("inference: %s", err)
        self._ready.set()
        tick = max(0.01, min(self.idle_unload_s / 4, 5.0))
        while True:
            with self._cond:
                if not self._pending and not self._closed:
                    self._cond.wait(timeout=tick)
                if self._closed:
                    return
            try:  # before the wave: a replaced or unregistered adapter's weights never take a slot it needs
                self._housekeeping()
            except Exception:
                log.exception("inference: unloading models failed")
            with self._cond:
                wave = self._take_wave()
            if wave:
                try:
                    self._run_wave(wave)
                except Exception as err:  # a bug or an out-of-memory: the wave's requests fail, the server lives
                    log.exception("inference: a wave of %d requests failed", len(wave))
                    for req in wave:
                        if req.rows_left > 0:
                            self._emit(req, Failed(f"internal error: {type(err).__name__}", "internal"))

    def _take_wave(self) -> list[_Request]:
        """The oldest pending request and the next ones for the same base, within max_batch rows (a request with
        more choices than that runs alone) and max_adapters distinct adapters. Called with the lock held."""
        self._pending = [r for r in self._pending if not r.cancelled]
        if not self._pending:
            return []
        return self._take_fitting(self._pending[0].base, rows=0, keys=set(), first_always=True)

    def _take_fitting(self, base: str, *, rows: int, keys: set[str], first_always: bool) -> list[_Request]:
        """The pending requests for ``base``, oldest first, that fit beside ``rows`` rows using the adapters ``keys``
        (max_batch rows, max_adapters adapters), taken off the queue; with ``first_always`` the first is taken
        whatever its size. Called with the lock held."""
        taken: list[_Request] = []
        for req in self._pending:
            if req.base != base:
                continue
            new_keys = keys | ({req.adapter.key} if req.adapter else set())
            fits = rows + req.sampling.n <= self.max_batch and len(new_keys) <= self.max_adapters
            if fits or (first_always and not taken):
                taken.append(req)
                rows += req.sampling.n
                keys = new_keys
        chosen = set(map(id, taken))
        self._pending = [r for r in self._pending if id(r) not in chosen]
        return taken

    def _load_base(self, b: _Base) -> torch.nn.Module:
        if b.model is None:
            try:
                self._tokenizer(b.name)
                model = load_base_model(b.source, self.device)
            except (ModelError, OSError, ValueError) as err:
                b.error = str(err)
                raise
            if self.precision == "bf16":
                store_frozen_linears_in(model, torch.bfloat16)  # as trainer.loops.engine.load_policy stores the policy
            b.model, b.loaded, b.error = model, [], None
            self.stats.model_loads += 1
            log.info("inference: loaded %s", b.name)
        b.last_used = self.clock()
        return b.model

    def _unload_base(self, b: _Base) -> None:
        for key in list(b.loaded):
            self._lru.pop(key, None)
            self._adapter_used.pop(key, None)
        b.model, b.loaded = None, []
        self.stats.model_unloads += 1
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        log.info("inference: unloaded %s", b.name)

    def _load_adapter(self, b: _Base, info: AdapterInfo, keep: set[str]) -> None:
        """Load ``info``'s weights into ``b`` (evicting the least recently used adapters not in ``keep``)."""
        if info.key in self._lru:
            self._lru.move_to_end(info.key)
            return
        while len(self._lru) >= self.max_adapters:
            victim = next((k for k in self._lru if k not in keep), None)
            if victim is None:
                break
            self._unload_adapter(victim)
            self.stats.adapter_evictions += 1
        model = b.model if b.model is not None else self._load_base(b)  # (dropped if an unload failed)
        if isinstance(model, PeftModel):
            model.load_adapter(str(info.path), adapter_name=info.key, is_trainable=False)
        else:
            model = PeftModel.from_pretrained(model, str(info.path), adapter_name=info.key, is_trainable=False)
        model.eval()
        b.model = model
        b.loaded.append(info.key)
        self._lru[info.key] = (b.name, info)
        self.stats.adapter_loads += 1
        log.info("inference: loaded adapter %s on %s", info.name, b.name)

    def _unload_adapter(self, key: str) -> None:
        base_name, info = self._lru.pop(key)
        self._adapter_used.pop(key, None)
        b = self._bases[base_name]
        model = b.model
        b.loaded.remove(key)
        self.stats.adapter_unloads += 1
        if isinstance(model, PeftModel):
            try:
                if b.loaded:
                    model.delete_adapter(key)
                    # which adapter is active is PEFT's bookkeeping at three levels: set it explicitly
                    model.set_adapter(b.loaded[-1], inference_mode=True)
                else:  # the last one: take the LoRA layers out, the plain base is left
                    b.model = model.unload()
            except Exception:  # PEFT's state is in doubt: drop the model, it loads again (with its adapters) on use
                log.exception("inference: unloading adapter %s of %s failed; unloading the model", info.name, b.name)
                self._unload_base(b)
                return
        log.info("inference: unloaded adapter %s of %s", info.name, base_name)

    def _housekeeping(self) -> None:
        """Unload adapters no longer registered under their key, and adapters and models idle too long."""
        now = self.clock()
        with self._cond:
            live = {a.key for a in self._adapters.values()}
            busy = {r.base for r in self._pending}
        for key in list(self._lru):
            if key not in live or now - self._adapter_used.get(key, 0.0) > self.idle_unload_s:
                self._unload_adapter(key)
        for b in self._bases.values():
            if b.model is not None and b.name not in busy and now - b.last_used > self.idle_unload_s:
                self._unload_base(b)

    def _run_wave(self, wave: list[_Request]) -> None:
        b = self._bases[wave[0].base]
        try:
            self._load_base(b)
        except (ModelError, OSError, ValueError) as err:
            for req in wave:
                self._emit(req, Failed(str(err), "model"))
            return
        ready = self._admit(b, wave, set())
        if ready:
            self.stats.waves += 1
            with torch.inference_mode():
                self._decode(b, ready)
        b.last_used = self.clock()

    def _admit(self, b: _Base, requests: list[_Request], busy: set[str]) -> list[_Request]:
        """Load the requests' adapters (never evicting those in ``busy`` or theirs); the requests that can run (the
        others get :class:`Failed`)."""
        keep = busy | {r.adapter.key for r in requests if r.adapter is not None}
        ready: list[_Request] = []
        for req in requests:
            if req.adapter is not None:
                try:
                    self._load_adapter(b, req.adapter, keep)
                    self._adapter_used[req.adapter.key] = self.clock()
                except Exception as err:  # PEFT raises many kinds: a missing file, a shape or module mismatch
                    log.warning("inference: adapter %s did not load: %s", req.adapter.name, err, exc_info=True)
                    self._emit(req, Failed(f"adapter {req.adapter.name!r} cannot be loaded: {err}", "adapter"))
                    continue
            ready.append(req)
        return ready

    def _take_joiners(self, base: str, rows: list[_Row]) -> list[_Request]:
        """Pending requests for ``base`` that fit beside ``rows`` (max_batch rows, max_adapters adapters), to join
        the running wave; none while a request for another base waits (it would wait for as long as they come)."""
        with self._cond:
            self._pending = [r for r in self._pending if not r.cancelled]
            if not self._pending or any(r.base != base for r in self._pending):
                return []
            keys = {r.req.adapter.key for r in rows if r.req.adapter is not None}
            return self._take_fitting(base, rows=len(rows), keys=keys, first_always=False)

    def _sample(self, rows: list[_Row], logits: torch.Tensor) -> list[int]:
        """One token per row from logits [N, V]: greedy rows by argmax, the others by ``_sample_next`` (the
        trainer's sampler: softmax(z/T) within the top-p nucleus) with the row's own generator."""
        greedy = logits.argmax(-1)
        out = greedy.tolist()
        for k, row in enumerate(rows):
            s = row.req.sampling
            if s.temperature > 0:
                tok = _sample_next(logits[k : k + 1], temperature=s.temperature, top_p=s.top_p, generator=row.generator)
                out[k] = int(tok.item())
        return out

    def _logprobs(self, rows: list[_Row], logits: torch.Tensor, toks: list[int]) -> list[TokenLogprob | None]:
        """The sampled token's log-probability (and the top ones) for the rows that asked."""
        want = [k for k, r in enumerate(rows) if r.req.sampling.logprobs]
        out: list[TokenLogprob | None] = [None] * len(rows)
        if not want:
            return out
        lp = torch.log_softmax(logits[want].float(), dim=-1)  # [W, V]
        widest = max(rows[k].req.sampling.top_logprobs for k in want)
        top_v, top_i = lp.topk(widest, dim=-1) if widest else (lp[:, :0], lp[:, :0].long())
        chosen = lp.gather(-1, torch.tensor([toks[k] for k in want], device=lp.device).unsqueeze(-1)).squeeze(-1)
        chosen_l, top_vl, top_il = chosen.tolist(), top_v.tolist(), top_i.tolist()
        b = self._bases[rows[0].req.base]
        tok = b.tokenizer
        assert tok is not None
        with b.token_lock:
            for j, k in enumerate(want):
                n_top = rows[k].req.sampling.top_logprobs
                top = tuple(
                    TopLogprob(i, tok.decode([i]), v) for i, v in zip(top_il[j][:n_top], top_vl[j][:n_top], strict=True)
                )
                out[k] = TokenLogprob(toks[k], tok.decode([toks[k]]), chosen_l[j], top)
        return out

    def _accept(
        self, row: _Row, tok: int, lp: TokenLogprob | None, eos: int, tokenizer: Any, lock: threading.Lock
    ) -> ChoiceDelta | None:
        """Add the row's new token: its text, a stop string or EOS, the length limit. The delta to send, if any."""
        row.n_tokens += 1
        row.req.completion_tokens += 1
        s = row.req.sampling
        logprobs: tuple[TokenLogprob, ...] = ()
        if tok == eos:
            row.finish = "stop"
        else:
            row.ids.append(tok)
            with lock:
                row.text = tokenizer.decode(row.ids, skip_special_tokens=True)  # as trainer.loops.evaluate decodes
            logprobs = (lp,) if lp is not None else ()
            cut = _first_stop(row.text, s.stop) if s.stop else -1
            if cut >= 0:
                row.text, row.finish = row.text[: max(cut, row.sent)], "stop"
            elif row.n_tokens >= s.max_tokens:
                row.finish = "length"
        end = len(row.text) if row.finish else len(row.text) - _held_back(row.text, s.stop)
        text = row.text[row.sent : end] if end > row.sent else ""
        row.sent = max(row.sent, end)
        if not text and not logprobs and row.finish is None:
            return None
        return ChoiceDelta(row.index, text, logprobs, row.finish)

    def _rows(self, requests: list[_Request]) -> list[_Row]:
        rows: list[_Row] = []
        for req in requests:
            for i in range(req.sampling.n):
                gen = None
                if req.sampling.temperature > 0:
                    seed = req.sampling.seed if req.sampling.seed is not None else secrets.randbits(62)
                    gen = torch.Generator(self.device).manual_seed((seed + i) % 2**63)
                rows.append(_Row(req, i, gen))
        self.stats.rows += len(rows)
        return rows

    def _forward(self, model: torch.nn.Module, rows: list[_Row], **inputs: Any) -> Any:
        """One forward of ``rows``, each with its own adapter when the model holds adapters: rows that all use one
        adapter run it as the active adapter (PEFT's plain forward, the trainer's), mixed rows through PEFT's
        mixed-batch forward (each adapter on its rows' sub-batch; no adapter on the base's rows)."""
        if isinstance(model, PeftModel):
            names = [r.req.adapter.key if r.req.adapter else NO_ADAPTER for r in rows]
            if len(set(names)) == 1 and names[0] != NO_ADAPTER:
                if model.active_adapter != names[0]:
                    model.set_adapter(names[0], inference_mode=True)
            else:
                inputs["adapter_names"] = names
        with autocast(self.precision, self.device):
            return model(use_cache=True, **inputs)

    def _prefill(self, model: torch.nn.Module, rows: list[_Row], pad: int) -> tuple[Cache, Tensor, Tensor, Tensor]:
        """The rows' prompts, left-padded, through the model: (cache, mask [N, P], last positions [N, 1], next-token
        logits [N, V]), as ``trainer.generation.rollout.generate`` starts."""
        ids, mask = left_pad([r.req.prompt for r in rows], pad)
        ids, mask = ids.to(self.device), mask.to(self.device)
        pos = position_ids(mask)
        out = self._forward(model, rows, input_ids=ids, attention_mask=mask, position_ids=pos, logits_to_keep=1)
        return out.past_key_values, mask, pos[:, -1:], out.logits[:, -1]

    def _decode(self, b: _Base, wave: list[_Request]) -> None:
        """Prefill the wave's rows together, then decode them with one KV cache until every row has ended; rows that
        end leave the batch, and requests for the same base that arrive meanwhile join it (continuous batching)."""
        tokenizer = b.tokenizer
        assert tokenizer is not None and b.model is not None
        eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
        rows = self._rows(wave)
        past, mask, pos, logits = self._prefill(b.model, rows, pad)
        while True:
            self.stats.max_wave_rows = max(self.stats.max_wave_rows, len(rows))
            toks = self._sample(rows, logits)
            lps = self._logprobs(rows, logits, toks)
            by_request: dict[int, list[ChoiceDelta]] = {}
            for k, row in enumerate(rows):
                if row.req.cancelled:
                    row.finish = row.finish or "stop"
                    continue
                delta = self._accept(row, toks[k], lps[k], eos, tokenizer, b.token_lock)
                if delta is not None:
                    by_request.setdefault(id(row.req), []).append(delta)
                if row.finish is not None:
                    row.req.rows_left -= 1
            for req in dict.fromkeys(r.req for r in rows):
                if req.cancelled:
                    continue
                if deltas := by_request.get(id(req)):
                    self._emit(req, Progress(tuple(deltas)))
                if req.rows_left == 0:
                    self._emit(req, Finished(len(req.prompt), req.completion_tokens))
            keep = [k for k, r in enumerate(rows) if r.finish is None]
            if not keep:
                return
            tok_t = torch.tensor(toks, dtype=torch.long, device=self.device)
            if len(keep) < len(rows):  # finished rows leave the batch, their cache rows with them
                idx = torch.tensor(keep, dtype=torch.long, device=self.device)
                past.batch_select_indices(idx)
                mask, pos, tok_t = mask[idx], pos[idx], tok_t[idx]
                rows = [rows[k] for k in keep]
                past, mask = _trim_left(past, mask)
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=-1)
            pos = pos + 1
            out = self._forward(
                b.model,
                rows,
                input_ids=tok_t.unsqueeze(-1),
                attention_mask=mask,
                position_ids=pos,
                past_key_values=past,
            )
            past, logits = out.past_key_values, out.logits[:, -1]
            if _joinable(past) and (joiners := self._take_joiners(b.name, rows)):
                busy = {r.req.adapter.key for r in rows if r.req.adapter is not None}
                if joiners := self._admit(b, joiners, busy):
                    new = self._rows(joiners)
                    past2, mask2, pos2, logits2 = self._prefill(b.model, new, pad)
                    past, mask = _merge(past, mask, past2, mask2)
                    pos, logits = torch.cat([pos, pos2]), torch.cat([logits, logits2])
                    rows = rows + new
                    self.stats.joins += len(joiners)


def _joinable(cache: Cache) -> bool:
    """Rows can join a cache whose layers are all plain growing key/value tensors (not sliding windows, not
    quantised or offloaded ones)."""
    return isinstance(cache, DynamicCache) and all(type(layer) is DynamicLayer for layer in cache.layers)


def _pad_left(t: Tensor, width: int) -> Tensor:
    """[N, H, L, D] → [N, H, width, D], zeros on the left of the sequence axis."""
    return torch.nn.functional.pad(t, (0, 0, width - t.shape[-2], 0))


def _merge(a: Cache, mask_a: Tensor, b: Cache, mask_b: Tensor) -> tuple[Cache, Tensor]:
    """The rows of ``b`` appended to those of ``a``: each layer's keys and values and the masks [N, L] left-padded
    to the longer length (the padding is masked: it changes no row's attention)."""
    width = max(mask_a.shape[1], mask_b.shape[1])
    for la, lb in zip(a.layers, b.layers, strict=True):
        assert isinstance(la, DynamicLayer) and isinstance(lb, DynamicLayer)
        la.keys = torch.cat([_pad_left(la.keys, width), _pad_left(lb.keys, width)])
        la.values = torch.cat([_pad_left(la.values, width), _pad_left(lb.values, width)])
    pad = torch.nn.functional.pad
    return a, torch.cat([pad(mask_a, (width - mask_a.shape[1], 0)), pad(mask_b, (width - mask_b.shape[1], 0))])


def _trim_left(cache: Cache, mask: Tensor) -> tuple[Cache, Tensor]:
    """Drop the leading cache positions that no row attends to (left by rows that left the batch)."""
    if not _joinable(cache):
        return cache, mask
    lead = int((mask.sum(0) == 0).long().cumprod(0).sum())
    if lead == 0:
        return cache, mask
    for layer in cache.layers:
        assert isinstance(layer, DynamicLayer)
        layer.keys, layer.values = layer.keys[:, :, lead:], layer.values[:, :, lead:]
    return cache, mask[:, lead:]
