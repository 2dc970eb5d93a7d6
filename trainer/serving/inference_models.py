"""The inference engine's models (``trainer.serving.inference``): base models loaded once, LoRA adapters loaded into
them under names of their own, the least recently used adapter unloaded to make room for another and what stays idle
too long unloaded; everything loads again on demand. Used on the model thread only (a tokenizer also from the
request threads, under its base's ``token_lock``).
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch
from peft import PeftModel
from transformers import AutoConfig, PreTrainedTokenizerBase

from trainer.generation.models import ModelError, Precision, load_base_model, load_tokenizer, store_frozen_linears_in
from trainer.serving.inference_requests import AdapterInfo

log = logging.getLogger("proxima.inference")


@dataclass
class EngineStats:
    """The engine's counters: loads and unloads (counted here), waves and rows (by the wave decoder)."""

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
class Base:
    """A base model by name: its tokenizer and context length once asked for, its weights while loaded."""

    name: str
    source: str  # a local folder or a hub id
    tokenizer: PreTrainedTokenizerBase | None = None
    context: int | None = None  # max_position_embeddings
    model: torch.nn.Module | None = None  # the base, or a PeftModel around it once an adapter is loaded
    loaded: list[str] = field(default_factory=list)  # adapter keys loaded into it
    last_used: float = 0.0
    error: str | None = None  # why the last load failed
    token_lock: threading.Lock = field(default_factory=threading.Lock)


class ModelCache:
    """The bases by name (``models``: name → local folder or hub id) and the adapters loaded into them, at most
    ``max_adapters`` at once; ``stats`` counts the loads and unloads."""

    def __init__(
        self,
        models: Mapping[str, str],
        *,
        device: torch.device,
        precision: Precision,
        max_adapters: int,
        stats: EngineStats,
        clock: Callable[[], float],
    ) -> None:
        self.device, self.precision, self.max_adapters = device, precision, max_adapters
        self.stats, self.clock = stats, clock
        self.bases = {name: Base(name, source) for name, source in models.items()}
        self.lru: OrderedDict[str, tuple[str, AdapterInfo]] = OrderedDict()  # adapter key → (base, info): loaded
        self.adapter_used: dict[str, float] = {}  # adapter key → when a wave last used it

    def loaded_adapters(self) -> list[str]:
        """The names of the adapters whose weights are loaded, least recently used first."""
        return [info.name for _, info in list(self.lru.values())]

    def tokenizer(self, base: str) -> tuple[PreTrainedTokenizerBase, Base]:
        """The base's tokenizer (loaded, with its context length, on first use) and the base."""
        b = self.bases[base]
        with b.token_lock:
            if b.tokenizer is None:
                tokenizer = load_tokenizer(b.source)
                try:
                    config = AutoConfig.from_pretrained(b.source)
                except (OSError, ValueError) as err:
                    raise ModelError(f"cannot load model {b.source!r}: {err}") from None
                b.tokenizer, b.context = tokenizer, getattr(config, "max_position_embeddings", None)
            return b.tokenizer, b

    def load_base(self, b: Base) -> torch.nn.Module:
        if b.model is None:
            try:
                self.tokenizer(b.name)
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

    def unload_base(self, b: Base) -> None:
        for key in list(b.loaded):
            self.lru.pop(key, None)
            self.adapter_used.pop(key, None)
        b.model, b.loaded = None, []
        self.stats.model_unloads += 1
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        log.info("inference: unloaded %s", b.name)

    def load_adapter(self, b: Base, info: AdapterInfo, keep: set[str]) -> None:
        """Load ``info``'s weights into ``b`` (evicting the least recently used adapters not in ``keep``)."""
        if info.key in self.lru:
            self.lru.move_to_end(info.key)
            return
        while len(self.lru) >= self.max_adapters:
            victim = next((k for k in self.lru if k not in keep), None)
            if victim is None:
                break
            self.unload_adapter(victim)
            self.stats.adapter_evictions += 1
        model = b.model if b.model is not None else self.load_base(b)  # (dropped if an unload failed)
        if isinstance(model, PeftModel):
            model.load_adapter(str(info.path), adapter_name=info.key, is_trainable=False)
        else:
            model = PeftModel.from_pretrained(model, str(info.path), adapter_name=info.key, is_trainable=False)
        model.eval()
        b.model = model
        b.loaded.append(info.key)
        self.lru[info.key] = (b.name, info)
        self.stats.adapter_loads += 1
        log.info("inference: loaded adapter %s on %s", info.name, b.name)

    def unload_adapter(self, key: str) -> None:
        base_name, info = self.lru.pop(key)
        self.adapter_used.pop(key, None)
        b = self.bases[base_name]
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
                self.unload_base(b)
                return
        log.info("inference: unloaded adapter %s of %s", info.name, base_name)

    def use_adapter(self, b: Base, info: AdapterInfo, keep: set[str]) -> None:
        """Load ``info``'s weights into ``b`` unless they are (evicting none of ``keep``), noting that a wave uses
        them now."""
        self.load_adapter(b, info, keep)
        self.adapter_used[info.key] = self.clock()

    def unload_unused(self, live: set[str], busy: set[str], *, now: float, idle_unload_s: float) -> None:
        """Unload the adapters whose key is not in ``live`` (replaced or unregistered), and the adapters and the bases
        (those no request in ``busy`` asks for) unused for more than ``idle_unload_s`` at ``now``."""
        for key in list(self.lru):
            if key not in live or now - self.adapter_used.get(key, 0.0) > idle_unload_s:
                self.unload_adapter(key)
        for b in self.bases.values():
            if b.model is not None and b.name not in busy and now - b.last_used > idle_unload_s:
                self.unload_base(b)
