"""Constrained decoding: what a sampler may write next, token by token, so that an answer is JSON that a schema admits
(a ``response_format``), a tool call in the model's syntax (``tool_choice`` required or named), or text without a tool
call's marker in it (``tool_choice: none``: :func:`text_without`).

The grammars are llguidance's (the Guidance project's Rust matcher, which vLLM and SGLang use too): a JSON schema or a
Lark grammar is compiled once per request, and each sequence keeps a matcher of its own that consumes the tokens it
samples and says which tokens may come next (a bit mask over the vocabulary, computed on the CPU, applied to the
logits on any device). EOS is allowed only where the grammar is complete, so an answer that ends is whole; one cut by
its token budget is not, and is reported as cut (``length``), never as finished.

Three users share it: the inference engine (``trainer.serving.inference_waves``: one :class:`TokenConstraint` per
row), the RL rollout (``trainer.generation.rollout.generate``'s ``constraint``: :class:`RowConstraints`) and
transformers' ``generate`` (:class:`GrammarLogitsProcessor`).
"""

from __future__ import annotations

import dataclasses
import json
import re
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import llguidance
import llguidance.hf
import llguidance.torch
import torch
from torch import Tensor
from transformers import LogitsProcessor, PreTrainedTokenizerBase

from trainer.spec.response_format import Format, json_schema_of


class GrammarError(ValueError):
    """A grammar the matcher refuses (an unsupported schema feature, a grammar that does not compile)."""


@dataclass(frozen=True)
class Grammar:
    """What a sequence may write: ``source`` an llguidance grammar (None: any text) and ``banned``, strings that no
    sampled token may contain (a token whose text holds one is never sampled)."""

    source: str | None = None
    banned: tuple[str, ...] = ()

    def check(self) -> Grammar:
        """The grammar itself once llguidance has compiled it without a tokenizer; else :class:`GrammarError`."""
        if self.source is not None:
            is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(self.source, None)
            if is_error:
                raise GrammarError("; ".join(messages))
        return self


def json_grammar(schema: dict[str, Any]) -> Grammar:
    """JSON that ``schema`` admits, and nothing after it (whitespace between tokens allowed, as JSON allows)."""
    try:
        return Grammar(llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema))).check()
    except ValueError as err:
        raise GrammarError(str(err)) from None


def lark_grammar(lark: str) -> Grammar:
    """A Lark grammar in llguidance's dialect (``%json {...}`` embeds a JSON schema)."""
    return Grammar(llguidance.LLMatcher.grammar_from_lark(lark)).check()


def text_without(markers: Sequence[str]) -> Grammar:
    """Any text in which none of ``markers`` occurs, written in any tokens: banning the tokens that hold a marker
    whole is not enough, as a model may spell it in pieces (``<``, ``tool``, ``_call``, ``>``). A regex lexeme
    less those that contain a marker (llguidance's ``&`` and ``~``); the tokens holding one are banned too."""
    contains = "|".join(re.escape(m).replace("/", "\\/") for m in markers)
    lark = f"start: TEXT\nTEXT: /(?s:.*)/ & ~/(?s:.*(?:{contains}).*)/\n"
    return dataclasses.replace(lark_grammar(lark), banned=tuple(markers))


def response_grammar(fmt: Format | None) -> Grammar | None:
    """The grammar of a response format: None for plain text."""
    schema = json_schema_of(fmt)
    return None if schema is None else json_grammar(schema)


# -- the tokenizer as the matcher sees it -------------------------------------------------------------------------


class _Tokens:
    """A tokenizer as llguidance's ``TokenizerWrapper`` takes it: each token's bytes (special tokens marked with
    the 0xFF byte, so that no text matches them) and an encoder. For tokenizers whose decoder llguidance cannot read
    from ``tokenizer.json`` (a word-level vocabulary with the ``Fuse`` decoder, as the built-in models have).

    llguidance tokenises the bytes a grammar forces (an object's opening ``{``, a string's closing quote at its
    ``maxLength``) and allows the tokens that continue that tokenisation; a word-level vocabulary has no token for
    many single characters and its encoder writes ``<unk>`` there, which would leave ``<unk>`` the only token
    allowed. So each byte that no token spells alone gets a virtual token after the vocabulary (ids from
    ``len(tokenizer)``, never sampled: :class:`TokenConstraint` allows no id past the tokenizer's), and text the
    encoder cannot write without ``<unk>`` is tokenised greedily, longest token first, over both."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        self.eos_token_id = tokenizer.eos_token_id
        self.bos_token_id = tokenizer.bos_token_id
        special = set(tokenizer.all_special_ids)
        self.special_token_ids = sorted(special)
        names = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
        self.tokens = [
            b"\xff" + str(name).encode() if i in special else tokenizer.decode([i]).encode()
            for i, name in enumerate(names)
        ]
        self._ids = {t: i for i, t in enumerate(self.tokens) if i not in special and t}
        for b in range(256):
            if bytes([b]) not in self._ids:
                self._ids[bytes([b])] = len(self.tokens)
                self.tokens.append(bytes([b]))
        self._longest = max(len(t) for t in self._ids)

    def __call__(self, text: str | bytes) -> list[int]:
        s = text.decode("utf-8", errors="replace") if isinstance(text, bytes) else text
        ids = list(self.tokenizer.encode(s, add_special_tokens=False))
        unk = self.tokenizer.unk_token_id
        if unk is None or unk not in ids:
            return ids
        return self._greedy(text if isinstance(text, bytes) else text.encode())

    def _greedy(self, data: bytes) -> list[int]:
        out, i = [], 0
        while i < len(data):
            n = next(n for n in range(min(self._longest, len(data) - i), 0, -1) if data[i : i + n] in self._ids)
            out.append(self._ids[data[i : i + n]])
            i += n
        return out


_cache: weakref.WeakKeyDictionary[PreTrainedTokenizerBase, llguidance.LLTokenizer] = weakref.WeakKeyDictionary()
_cache_lock = threading.Lock()


def grammar_tokenizer(tokenizer: PreTrainedTokenizerBase) -> llguidance.LLTokenizer:
    """The matcher's view of ``tokenizer``, built once per tokenizer (about a second for a 150k vocabulary)."""
    with _cache_lock:
        found = _cache.get(tokenizer)
        if found is None:
            try:
                found = llguidance.hf.from_tokenizer(tokenizer)
            except ValueError:  # a decoder it cannot read: give it every token's bytes
                found = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Tokens(tokenizer)))
            _cache[tokenizer] = found
        return found


_banned: weakref.WeakKeyDictionary[PreTrainedTokenizerBase, dict[tuple[str, ...], Tensor]] = weakref.WeakKeyDictionary()


def banned_ids(tokenizer: PreTrainedTokenizerBase, banned: Sequence[str]) -> Tensor:
    """The ids of the tokens whose text contains one of ``banned`` (computed once per tokenizer and strings)."""
    key = tuple(banned)
    with _cache_lock:
        found = _banned.setdefault(tokenizer, {}).get(key)
    if found is None:
        ids = range(len(tokenizer))
        names = tokenizer.convert_ids_to_tokens(list(ids))
        hits = [i for i in ids if any(b in tokenizer.decode([i]) or b in str(names[i]) for b in key)]
        found = torch.tensor(hits, dtype=torch.long)
        with _cache_lock:
            _banned.setdefault(tokenizer, {})[key] = found
    return found


# -- one sequence ---------------------------------------------------------------------------------------------------


_SHIFTS = torch.arange(32, dtype=torch.int32)
_BYTE_SHIFTS = torch.arange(8, dtype=torch.uint8)
_executor: llguidance.LLExecutor | None = None


def _words(bits: Tensor) -> Tensor:
    """[..., 32 k] bool → [..., k] int32, bit j of word i the id 32 i + j (llguidance's bit mask layout)."""
    packed = (bits.view(*bits.shape[:-1], -1, 32).long() << _SHIFTS.long()).sum(-1)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def _only(token: int, n_words: int) -> Tensor:
    """[n_words] int32: the bit of ``token`` alone."""
    out = torch.zeros(n_words, dtype=torch.int32)
    bit = 1 << (token % 32)
    out[token // 32] = bit - 2**32 if bit >= 2**31 else bit
    return out


def _unpacked(words: Tensor, width: int) -> Tensor:
    """[N, k] int32 → [N, width] bool, on the words' device: unpacked byte by byte (little-endian words: id 32 i + j
    is bit j % 8 of byte 4 i + j // 8), a byte per token where 32-bit shifts would take four."""
    shifts = _BYTE_SHIFTS.to(words.device)
    by = words.contiguous().view(torch.uint8)  # [N, 4 k]
    return ((by.unsqueeze(-1) >> shifts) & 1).view(torch.bool).flatten(1)[:, :width]


class TokenConstraint:
    """One sequence's constraint: which tokens may come next (:meth:`allowed`), and the token it sampled
    (:meth:`advance`). ``dead``: the grammar left no token (the vocabulary cannot continue it): the sequence may only
    end, and its answer is incomplete."""

    def __init__(
        self,
        matcher: llguidance.LLMatcher | None,
        banned: Tensor | None,
        eos_id: int,
        vocab: int | None = None,
        words: int = 0,
    ) -> None:
        self.matcher, self.banned, self.eos_id = matcher, banned, eos_id
        self.vocab = vocab  # the tokenizer's ids: the matcher's past them (virtual tokens, padding) are never allowed
        self.words = words  # the matcher's bit mask, in 32-bit words (llguidance fills exactly that many)
        self.dead = False
        self._keep: dict[tuple[int, int], Tensor] = {}

    def keep(self, n_words: int, width: int) -> Tensor:
        """[n_words] int32: the ids below ``width`` (and the tokenizer's) that are not banned (computed once)."""
        key = (n_words, width)
        found = self._keep.get(key)
        if found is None:
            ok = torch.zeros(n_words * 32, dtype=torch.bool)
            ok[: min(width, width if self.vocab is None else self.vocab)] = True
            if self.banned is not None:
                ok[self.banned[self.banned < width]] = False
            found = self._keep[key] = _words(ok)
        return found

    def allowed(self, width: int) -> Tensor:
        """[width] bool on the CPU: the tokens that may come next (ids past the tokenizer's are never allowed)."""
        return _unpacked(row_masks([self], width), width)[0]

    def writable(self, width: int) -> bool:
        """Whether the sequence can go on: a token other than EOS may come, or EOS may end it whole (a grammar the
        vocabulary cannot write leaves neither)."""
        return not self.dead and not _row_bits([self], width)[1][0]

    def advance(self, token: int) -> None:
        if self.matcher is not None and not self.dead:
            self.matcher.consume_token(token)

    @property
    def complete(self) -> bool:
        """The grammar is satisfied (EOS may come)."""
        return not self.dead and (self.matcher is None or self.matcher.is_accepting())


def row_masks(rows: Sequence[TokenConstraint | None], width: int) -> Tensor:
    """[N, ceil(width / 32)] int32 on the CPU, llguidance's bit masks: the tokens each row may write next (a row
    without a constraint: all). A row whose grammar leaves no token but EOS while incomplete goes ``dead``: EOS
    alone, its answer cut."""
    bits, stuck = _row_bits(rows, width)
    for i, c in enumerate(rows):
        if c is not None:
            # llguidance offers EOS (or nothing) where the vocabulary cannot go on: the answer may only end, cut
            c.dead = c.dead or stuck[i]
            if c.dead:
                bits[i] = _only(c.eos_id, bits.shape[1])
    return bits


def _row_bits(rows: Sequence[TokenConstraint | None], width: int) -> tuple[Tensor, list[bool]]:
    """The rows' bit masks as their grammars and bans leave them, and whether each row is stuck (no token but EOS,
    its grammar incomplete). The matchers fill one buffer together (llguidance's executor, off the GIL)."""
    global _executor
    n_words = (width + 31) // 32
    bits = torch.full((len(rows), n_words), -1, dtype=torch.int32)
    matchers = [(c.matcher, i) for i, c in enumerate(rows) if c is not None and c.matcher is not None]
    if matchers:
        m_words = max(c.words for c in rows if c is not None)  # one tokenizer for the batch: one width
        filled = torch.full((len(rows), m_words), -1, dtype=torch.int32)
        _executor = _executor or llguidance.LLExecutor()
        llguidance.torch.fill_next_token_bitmask_par(_executor, matchers, filled)
        k = min(m_words, n_words)  # ids past the matcher's are past the tokenizer's: ``keep`` drops them
        bits[:, :k] = filled[:, :k]
    constrained = [i for i, c in enumerate(rows) if c is not None]
    stuck = [False] * len(rows)
    if not constrained:
        return bits, stuck
    bits[constrained] &= torch.stack([c.keep(n_words, width) for c in rows if c is not None])
    eos = next(c.eos_id for c in rows if c is not None)  # one tokenizer for the batch
    not_eos = ~_only(eos, n_words)
    others = (bits[constrained] & not_eos).ne(0).any(-1).tolist()
    for i, other in zip(constrained, others, strict=True):
        m = rows[i].matcher  # type: ignore[union-attr]
        stuck[i] = not other and m is not None and not m.is_accepting()
    return bits, stuck


def constraints(grammar: Grammar, tokenizer: PreTrainedTokenizerBase, n: int) -> list[TokenConstraint]:
    """``n`` fresh sequences' constraints for ``grammar`` (the grammar compiled once, its matcher copied)."""
    eos = tokenizer.eos_token_id
    assert isinstance(eos, int)
    ban = banned_ids(tokenizer, grammar.banned) if grammar.banned else None
    if grammar.source is None:
        return [TokenConstraint(None, ban, eos) for _ in range(n)]
    # Under a grammar no special token but EOS is ever written (llguidance lets <unk> through where nothing fits)
    specials = torch.tensor([i for i in tokenizer.all_special_ids if i != eos], dtype=torch.long)
    ban = specials if ban is None else torch.cat([ban, specials])
    lltok = grammar_tokenizer(tokenizer)
    first = llguidance.LLMatcher(lltok, grammar.source, log_level=0)
    if first.is_error():
        raise GrammarError(first.get_error())
    matchers = [first] + [first.deep_copy() for _ in range(n - 1)]
    words = (lltok.vocab_size + 31) // 32
    return [TokenConstraint(m, ban, eos, len(tokenizer), words) for m in matchers[:n]]


def mask_logits(logits: Tensor, rows: Sequence[TokenConstraint | None]) -> Tensor:
    """``logits`` [N, V] with −inf where each row's constraint forbids the token (rows without one unchanged): a new
    tensor when any row is constrained, else ``logits`` itself. One bit mask for the batch, copied to the logits'
    device as 32-bit words (a 32nd of a bool mask's bytes) and unpacked there."""
    if all(c is None for c in rows):
        return logits
    width = logits.shape[-1]
    ok = _unpacked(row_masks(rows, width).to(logits.device, non_blocking=True), width)
    return logits.masked_fill(~ok, float("-inf"))


# -- batches ---------------------------------------------------------------------------------------------------------


class RowConstraints:
    """``rollout.generate``'s constraint: one :class:`TokenConstraint` per row of the batch, fed each row's sampled
    token until the row ends."""

    def __init__(self, grammar: Grammar, tokenizer: PreTrainedTokenizerBase, n: int) -> None:
        self.rows = constraints(grammar, tokenizer, n)

    def mask(self, logits: Tensor, done: Tensor) -> Tensor:
        """[N, V] logits with each running row's forbidden tokens at −inf (ended rows unchanged: they write pad)."""
        ended = done.tolist()
        return mask_logits(logits, [None if ended[i] else c for i, c in enumerate(self.rows)])

    def advance(self, tokens: Tensor, done: Tensor) -> None:
        """Feed each row that was running before this step (``done`` as it was) its token [N]."""
        for i, (tok, ended) in enumerate(zip(tokens.tolist(), done.tolist(), strict=True)):
            if not ended:
                self.rows[i].advance(int(tok))

    def dead(self) -> Tensor:
        """[N] bool: the rows whose grammar went dead (the vocabulary could not continue it): their EOS ended an
        answer that is not whole."""
        return torch.tensor([c.dead for c in self.rows], dtype=torch.bool)


class GrammarLogitsProcessor(LogitsProcessor):  # type: ignore[misc]  # transformers is read as Any
    """transformers' ``generate(logits_processor=[...])`` under ``grammar``: a call whose ids do not extend the last
    call's by one token starts a new ``generate`` (fresh matchers, so the processor may be reused); each later call
    feeds each row the token ``generate`` appended. A row that wrote EOS or pad has ended: ``generate`` pads it from
    then on, and its matcher is neither fed nor asked."""

    def __init__(self, grammar: Grammar, tokenizer: PreTrainedTokenizerBase) -> None:
        self.grammar, self.tokenizer = grammar, tokenizer
        self.rows: list[TokenConstraint] = []
        self.ended: list[bool] = []
        self.last: Tensor | None = None  # the ids of the last call
        self.enders = {t for t in (tokenizer.eos_token_id, tokenizer.pad_token_id) if t is not None}

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        last, self.last = self.last, input_ids
        if last is None or last.shape[0] != input_ids.shape[0] or not torch.equal(input_ids[:, :-1], last):
            self.rows = constraints(self.grammar, self.tokenizer, input_ids.shape[0])
            self.ended = [False] * input_ids.shape[0]
        else:
            for i, tok in enumerate(input_ids[:, -1].tolist()):
                if self.ended[i] or tok in self.enders:
                    self.ended[i] = True
                else:
                    self.rows[i].advance(int(tok))
        rows = [None if ended else row for row, ended in zip(self.rows, self.ended, strict=True)]
        return mask_logits(scores, rows)  # type: ignore[return-value]
