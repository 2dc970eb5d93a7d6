"""The inference engine's decoding (``trainer.serving.inference``): a wave of requests for one base, prefilled together
and decoded with one KV cache on the model thread, as ``trainer.generation.rollout.generate`` decodes.

Batching is continuous: a row that finishes leaves the batch (its cache rows are dropped), and a request for the same
base that arrives meanwhile is prefilled and joins the running batch at the next step (its cache left-padded to the
batch's length), unless a request for another base is waiting. Each row runs with its request's adapter (PEFT's
mixed-batch forward when the rows' adapters differ). Tokens come back to each request as text deltas that never
reveal a stop string, with their log-probs when asked.
"""

from __future__ import annotations

import logging
import secrets
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from peft import PeftModel
from torch import Tensor
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer

from trainer.generation.constrained import TokenConstraint, mask_logits
from trainer.generation.models import ModelError, Precision, autocast
from trainer.generation.rollout import _sample_next, left_pad, position_ids
from trainer.serving.inference_models import Base, EngineStats, ModelCache
from trainer.serving.inference_requests import (
    ChoiceDelta,
    Failed,
    Finished,
    FinishReason,
    Progress,
    Request,
    RequestQueue,
    TokenLogprob,
    TopLogprob,
)

log = logging.getLogger("proxima.inference")

NO_ADAPTER = "__base__"  # PEFT's name, in adapter_names, for a row that runs the base alone


@dataclass(eq=False)
class _Row:
    """One choice being decoded."""

    req: Request
    index: int
    generator: torch.Generator | None
    ids: list[int] = field(default_factory=list)  # generated tokens, EOS excluded
    n_tokens: int = 0  # generated tokens, EOS included
    text: str = ""  # the decoded text, cut at a stop string
    sent: int = 0  # characters of text already sent
    finish: FinishReason | None = None
    constraint: TokenConstraint | None = None  # what the row may write next (a grammar), else anything
    drop: frozenset[int] | None = None  # with kept special tokens: the special ids dropped from the text


def special_ids_dropped(tokenizer: Any, keep: Sequence[str]) -> frozenset[int] | None:
    """The special token ids that a text keeping the special tokens ``keep`` leaves out (every special token but
    those): None when ``keep`` names none of the tokenizer's special tokens (the text skips them all)."""
    added = getattr(tokenizer, "added_tokens_decoder", {})
    special = set(tokenizer.all_special_ids) | {i for i, t in added.items() if getattr(t, "special", False)}
    vocab = tokenizer.get_vocab()
    kept = {vocab[m] for m in keep if m in vocab} & special
    return frozenset(special - kept) if kept else None


def decoded(tokenizer: Any, ids: list[int], drop: frozenset[int] | None) -> str:
    """The text of ``ids`` without special tokens, except those not in ``drop`` (a tool-call parser's markers:
    a call opened by a special token would otherwise lose its marker and read as content)."""
    if drop is None:
        return str(tokenizer.decode(ids, skip_special_tokens=True))  # as trainer.loops.evaluate decodes
    return str(tokenizer.decode([i for i in ids if i not in drop], skip_special_tokens=False))


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


class WaveDecoder:
    """Runs the waves that the model thread takes off ``queue``: the requests' base and adapters loaded through
    ``models``, their rows decoded together, requests for the same base joining while it runs; ``stats`` counts the
    waves, rows and joins."""

    def __init__(
        self,
        models: ModelCache,
        queue: RequestQueue,
        *,
        device: torch.device,
        precision: Precision,
        stats: EngineStats,
    ) -> None:
        self.models, self.queue = models, queue
        self.device, self.precision, self.stats = device, precision, stats

    def run(self, wave: list[Request]) -> None:
        """Decode ``wave`` (requests for one base) to its end; a request that cannot run gets :class:`Failed`."""
        b = self.models.bases[wave[0].base]
        try:
            self.models.load_base(b)
        except (ModelError, OSError, ValueError) as err:
            for req in wave:
                req.emit(Failed(str(err), "model"))
            return
        ready = self._admit(b, wave, set())
        if ready:
            self.stats.waves += 1
            with torch.inference_mode():
                self._decode(b, ready)
        b.last_used = self.models.clock()

    def _admit(self, b: Base, requests: list[Request], busy: set[str]) -> list[Request]:
        """Load the requests' adapters (never evicting those in ``busy`` or theirs); the requests that can run (the
        others get :class:`Failed`)."""
        keep = busy | {r.adapter.key for r in requests if r.adapter is not None}
        ready: list[Request] = []
        for req in requests:
            if req.adapter is not None:
                try:
                    self.models.use_adapter(b, req.adapter, keep)
                except Exception as err:  # PEFT raises many kinds: a missing file, a shape or module mismatch
                    log.warning("inference: adapter %s did not load: %s", req.adapter.name, err, exc_info=True)
                    req.emit(Failed(f"adapter {req.adapter.name!r} cannot be loaded: {err}", "adapter"))
                    continue
            ready.append(req)
        return ready

    def _sample(self, rows: list[_Row], logits: torch.Tensor) -> list[int]:
        """One token per row from logits [N, V]: greedy rows by argmax, the others by ``_sample_next`` (the
        trainer's sampler: softmax(z/T) within the top-p nucleus) with the row's own generator; a row under a
        grammar among the tokens it allows (the log-probs stay the model's own)."""
        logits = mask_logits(logits, [r.constraint for r in rows])
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
        b = self.models.bases[rows[0].req.base]
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
        grammar = row.constraint
        if grammar is not None:
            grammar.advance(tok)
        if tok == eos:
            # EOS under a grammar that left no token ends an answer that is not whole: it was cut, not finished
            row.finish = "length" if grammar is not None and grammar.dead else "stop"
        else:
            row.ids.append(tok)
            with lock:
                row.text = decoded(tokenizer, row.ids, row.drop)
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

    def _rows(self, requests: list[Request]) -> list[_Row]:
        rows: list[_Row] = []
        for req in requests:
            drop = None
            if req.sampling.keep_special:
                b = self.models.bases[req.base]
                with b.token_lock:
                    drop = special_ids_dropped(b.tokenizer, req.sampling.keep_special)
            for i in range(req.sampling.n):
                gen = None
                if req.sampling.temperature > 0:
                    seed = req.sampling.seed if req.sampling.seed is not None else secrets.randbits(62)
                    gen = torch.Generator(self.device).manual_seed((seed + i) % 2**63)
                constraint = req.constraints[i] if req.constraints else None
                rows.append(_Row(req, i, gen, constraint=constraint, drop=drop))
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

    def _decode(self, b: Base, wave: list[Request]) -> None:
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
            self._report(rows, toks, self._logprobs(rows, logits, toks), eos, b)
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
            if _joinable(past) and (joined := self._join(b, rows, pad)):
                new, past2, mask2, pos2, logits2 = joined
                past, mask = _merge(past, mask, past2, mask2)
                pos, logits = torch.cat([pos, pos2]), torch.cat([logits, logits2])
                rows = rows + new

    def _report(self, rows: list[_Row], toks: list[int], lps: list[TokenLogprob | None], eos: int, b: Base) -> None:
        """Add each row's new token, then send each request its step's deltas, and :class:`Finished` once its last
        row has ended. A cancelled request's rows end without a word."""
        by_request: dict[int, list[ChoiceDelta]] = {}
        for k, row in enumerate(rows):
            if row.req.cancelled:
                row.finish = row.finish or "stop"
                continue
            delta = self._accept(row, toks[k], lps[k], eos, b.tokenizer, b.token_lock)
            if delta is not None:
                by_request.setdefault(id(row.req), []).append(delta)
            if row.finish is not None:
                row.req.rows_left -= 1
        for req in dict.fromkeys(r.req for r in rows):
            if req.cancelled:
                continue
            if deltas := by_request.get(id(req)):
                req.emit(Progress(tuple(deltas)))
            if req.rows_left == 0:
                req.emit(Finished(len(req.prompt), req.completion_tokens))

    def _join(self, b: Base, rows: list[_Row], pad: int) -> tuple[list[_Row], Cache, Tensor, Tensor, Tensor] | None:
        """The pending requests for the wave's base that fit beside ``rows`` and whose adapters load, prefilled: their
        rows and their prefill (cache, mask, last positions, next-token logits); None when none joins."""
        busy = {r.req.adapter.key for r in rows if r.req.adapter is not None}
        joiners = self.queue.take_joiners(b.name, rows=len(rows), keys=busy)
        if joiners:
            joiners = self._admit(b, joiners, busy)
        if not joiners:
            return None
        assert b.model is not None
        new = self._rows(joiners)
        prefill = self._prefill(b.model, new, pad)
        self.stats.joins += len(joiners)
        return (new, *prefill)


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
