"""Constrained decoding: a request's output held to a JSON schema, a regular expression or an EBNF
grammar (sglang's sampling fields `json_schema`, `regex`, `ebnf`), through xgrammar.

A grammar is compiled once per distinct text against the model's tokenizer (a cache of them), on a
worker thread, so a long compile never holds up the scheduler's steps. Each request then gets its
own matcher: before every token the matcher writes the set of tokens the grammar allows next as a
bitmask (32 tokens a word, bit b of word w is token 32 w + b), the sampler gives every other token
-inf, and the sampled token advances the matcher. When the grammar is complete only the tokenizer's
stop tokens (eos) are allowed, and the request ends on one.

xgrammar is an optional dependency (`pip install 'tide[grammar]'`); without it a request with a
grammar is refused with a ValueError naming its field.
"""

from __future__ import annotations

import functools
import json
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

# The sampling fields that take a grammar (at most one per request), in sglang's names.
GRAMMAR_FIELDS = ("json_schema", "regex", "ebnf")
# The longest grammar text a request may send (characters): parsing and compiling are bounded by it.
MAX_GRAMMAR_CHARS = 65536
# The longest grammar a request's text may expand to (characters of xgrammar's EBNF): compile time
# follows the expanded grammar, not the text (a JSON schema of 2,000 optional properties in 59k
# characters expands to 406k and compiles for 15 s at a 4k-token vocabulary, 4,500 for 162 s).
MAX_EXPANDED_GRAMMAR_CHARS = 4 * MAX_GRAMMAR_CHARS
# Grammars compiled at once: a slow compile within the bounds holds one thread while the others
# serve the requests behind it.
COMPILE_THREADS = 4
# Deepest nesting of objects and arrays a JSON schema may have: xgrammar's schema conversion takes
# time that grows steeply with depth (seconds at a few hundred levels), and real schemas are shallow.
MAX_SCHEMA_DEPTH = 32
# Compiled grammars kept for reuse (requests of one rollout send the same schema): at most this
# many, holding at most CACHE_MAX_BYTES of xgrammar's tables. A grammar's tables grow with the
# vocabulary: at 152k tokens a small schema takes 0.4 MiB, and bounded repetitions (`maxLength`,
# `{1,n}`) 25-40 MiB, so the count alone would let distinct grammars hold gigabytes.
CACHE_SIZE = 256
CACHE_MAX_BYTES = 1 << 30
# A request whose grammar has not compiled after this long ends with an abort (a compile already
# running goes on and is cached for later requests with the same text; one not started is dropped
# when no other request waits for it).
COMPILE_TIMEOUT_S = 300.0
# Longest the matcher may take to follow one sampled token (s of the scheduler thread's CPU time).
# It runs on the scheduler's thread, so every request in the engine waits for it; xgrammar's Earley
# parser follows a valid but ambiguous grammar (e.g. `root ::= root root | "a"`) in time that grows
# steeply with the output (tens of ms a token after a few hundred tokens, seconds later), while real
# grammars take microseconds. A request whose grammar takes longer for SLOW_ACCEPTS tokens in a row
# ends with an abort. CPU time, not wall time: a host that deschedules the thread does not count.
MAX_ACCEPT_S = 0.05
SLOW_ACCEPTS = 3


def _xgrammar() -> Any:
    try:
        import xgrammar
    except ImportError:
        return None
    return xgrammar


def available() -> bool:
    """Whether constrained decoding can run here (xgrammar is installed)."""
    return _xgrammar() is not None


def grammar_of(params: Any) -> tuple[str, str] | None:
    """(field, text) of the grammar a `SamplingParams` asks for, or None."""
    for name in GRAMMAR_FIELDS:
        text = getattr(params, name, None)
        if text is not None:
            return name, text
    return None


def check_grammar(field: str, text: Any) -> None:
    """ValueError naming `field` unless `text` is a grammar of that kind that xgrammar parses
    (syntax only: no tokenizer is needed, and the result is cached per text)."""
    if not isinstance(text, str):
        raise ValueError(f"{field} must be a string, got {type(text).__name__}")
    if not text:
        raise ValueError(f"{field} must not be empty")
    if len(text) > MAX_GRAMMAR_CHARS:
        raise ValueError(f"{field} may be at most {MAX_GRAMMAR_CHARS} characters, got {len(text)}")
    if field == "json_schema":
        try:
            schema = json.loads(text)
        except (ValueError, RecursionError) as e:
            raise ValueError(f"json_schema is not valid JSON: {e}") from None
        depth = _depth(schema)
        if depth > MAX_SCHEMA_DEPTH:
            raise ValueError(f"json_schema may nest objects and arrays at most {MAX_SCHEMA_DEPTH} "
                             f"deep, got {depth}")
    if not available():
        raise ValueError(f"{field}: constrained decoding needs the xgrammar package "
                         "(pip install 'tide[grammar]')")
    error = _parse_error(field, text)
    if error is not None:
        raise ValueError(f"{field} is not a valid {_KIND[field]}: {error}")


_KIND = {"json_schema": "JSON schema", "regex": "regular expression", "ebnf": "EBNF grammar"}


def _depth(value: Any) -> int:
    """How deep JSON objects and arrays nest in `value` (a scalar: 0), without recursion."""
    deepest = 0
    stack = [(value, 1)]
    while stack:
        item, level = stack.pop()
        children: Iterable[Any]
        if isinstance(item, dict):
            children = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        deepest = max(deepest, level)
        stack.extend((child, level + 1) for child in children)
    return deepest


@functools.lru_cache(maxsize=CACHE_SIZE)
def _parse_error(field: str, text: str) -> str | None:
    xgr = _xgrammar()
    try:
        if field == "json_schema":
            grammar = xgr.Grammar.from_json_schema(text)
        elif field == "regex":
            grammar = xgr.Grammar.from_regex(text)
        else:
            grammar = xgr.Grammar.from_ebnf(text)
    except (RuntimeError, ValueError, RecursionError) as e:
        return _error_text(e)
    expanded = len(str(grammar))
    if expanded > MAX_EXPANDED_GRAMMAR_CHARS:
        return (f"it expands to a grammar of {expanded} characters, more than "
                f"{MAX_EXPANDED_GRAMMAR_CHARS} (too costly to compile)")
    return None


def _error_text(e: BaseException) -> str:
    """xgrammar's message without its C++ source prefix ("[time] file.cc:123: ")."""
    text = str(e).strip()
    head, sep, rest = text.partition(": ")
    if sep and ".cc:" in head:
        text = rest.strip()
    return text[:300]


def framed_json_ebnf(prefix: str, schema: dict[str, Any], suffix: str) -> str:
    """EBNF text (for the `ebnf` field) of `prefix`, then compact JSON that follows `schema`,
    then `suffix` (a tool call in a model family's format). ValueError when the schema is too
    large, too deep or not one xgrammar takes, or xgrammar is not installed."""
    xgr = _xgrammar()
    if xgr is None:
        raise ValueError("constrained decoding needs the xgrammar package "
                         "(pip install 'tide[grammar]')")
    text = json.dumps(schema)
    if len(text) > MAX_GRAMMAR_CHARS:
        raise ValueError(f"the schema may be at most {MAX_GRAMMAR_CHARS} characters, got "
                         f"{len(text)}")
    if _depth(schema) > MAX_SCHEMA_DEPTH:
        raise ValueError(f"the schema may nest objects and arrays at most {MAX_SCHEMA_DEPTH} deep")
    try:
        parts = [xgr.Grammar.from_json_schema(text, any_whitespace=False)]
        if prefix:
            parts.insert(0, xgr.Grammar.from_ebnf(f"root ::= {json.dumps(prefix)}"))
        if suffix:
            parts.append(xgr.Grammar.from_ebnf(f"root ::= {json.dumps(suffix)}"))
        grammar = parts[0] if len(parts) == 1 else xgr.Grammar.concat(*parts)
    except (RuntimeError, ValueError, RecursionError) as e:
        raise ValueError(f"the schema is not one constrained decoding takes: "
                         f"{_error_text(e)}") from None
    ebnf = str(grammar)
    if len(ebnf) > MAX_GRAMMAR_CHARS:
        raise ValueError(f"the grammar of the schema takes {len(ebnf)} characters, more than "
                         f"{MAX_GRAMMAR_CHARS}")
    return ebnf


def bitmask_words(vocab_size: int) -> int:
    """32-bit words a row's bitmask of `vocab_size` tokens takes."""
    return (vocab_size + 31) // 32


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int] | None = None) -> None:
    """Give -inf to every token of `logits` [B, V] whose bit is clear in `bitmask` [B, words]
    (int32, on the host or the logits' device; rows of all ones change nothing), in rows `rows`
    (None: all). Tokens past the bitmask keep their logits. On CUDA the bits are unpacked by torch
    ops (measured faster there than xgrammar's Triton kernel, which a step launches from Python
    with its row list); elsewhere xgrammar's C++ loop masks in place (2.5x the unpack on CPU)."""
    words = bitmask.to(logits.device, non_blocking=True)
    if logits.is_cuda:
        unpack_and_mask(logits, words)
        return
    vocab = min(logits.shape[1], words.shape[1] * 32)
    _xgrammar().apply_token_bitmask_inplace(logits, words, vocab_size=vocab, indices=rows,
                                            backend="cpu")


def unpack_and_mask(logits: torch.Tensor, words: torch.Tensor) -> None:
    """`apply_bitmask` over every row, by torch ops on the logits' device."""
    shifts = torch.arange(32, device=logits.device, dtype=torch.int32)
    allowed = ((words.unsqueeze(-1) >> shifts) & 1).bool().reshape(words.shape[0], -1)
    n = min(logits.shape[1], allowed.shape[1])
    logits[:, :n].masked_fill_(~allowed[:, :n], -torch.inf)


class RequestGrammar:
    """One request's position in its grammar. Not thread-safe: the scheduler's thread only."""

    def __init__(self, matcher: Any, vocab_size: int, filler: Any) -> None:
        self._matcher = matcher
        self._filler = filler  # the backend's xgrammar BatchGrammarMatcher (threads)
        self.bitmask_words = bitmask_words(vocab_size)
        self.last_accept_s = 0.0  # the thread's CPU time the last `accept` took
        self.slow_accepts = 0  # consecutive accepts slower than MAX_ACCEPT_S

    def accept(self, token: int) -> bool:
        """Advance by `token`; False (and no change) when the grammar does not allow it."""
        start = time.thread_time()
        ok = bool(self._matcher.accept_token(token))
        self.last_accept_s = time.thread_time() - start
        self.slow_accepts = self.slow_accepts + 1 if self.last_accept_s > MAX_ACCEPT_S else 0
        return ok

    def allows_any(self) -> bool:
        """Whether some token may come next (False where no text the grammar matches starts
        with the output so far: e.g. `root ::= root`, or a regex of an empty class)."""
        bitmask = torch.zeros((1, self.bitmask_words), dtype=torch.int32)
        self._matcher.fill_next_token_bitmask(bitmask)
        return bool(bitmask.any())

    @property
    def terminated(self) -> bool:
        """The grammar is complete and its stop token was accepted."""
        return bool(self._matcher.is_terminated())


class GrammarMasks:
    """The allowed next tokens of a batch's rows, as a bitmask [rows, words] (all ones for rows
    without a grammar), computed when first asked for: the sampler asks after the forward is
    launched, so on a GPU the matchers fill it while the device runs the forward. The requests'
    last tokens must have been applied (their matchers advanced) before that."""

    def __init__(self, rows: int, grammars: list[tuple[int, RequestGrammar]]) -> None:
        self._rows = rows
        self._grammars = grammars
        self._bitmask: torch.Tensor | None = None

    def bitmask(self) -> torch.Tensor:
        if self._bitmask is None:
            words = max(g.bitmask_words for _, g in self._grammars)
            bitmask = torch.full((self._rows, words), -1, dtype=torch.int32)
            filler = self._grammars[0][1]._filler
            filler.batch_fill_next_token_bitmask([g._matcher for _, g in self._grammars], bitmask,
                                                 [row for row, _ in self._grammars])
            self._bitmask = bitmask
        return self._bitmask

    def rows(self) -> list[int]:
        """The rows that have a grammar (the others allow every token)."""
        return [row for row, _ in self._grammars]

    def select(self, rows: list[int]) -> GrammarMasks:
        """The masks of rows `rows`, in that order."""
        return _SelectedMasks(self, rows)


class _SelectedMasks(GrammarMasks):
    def __init__(self, parent: GrammarMasks, rows: list[int]) -> None:
        super().__init__(len(rows), [])
        self._parent, self._selected = parent, rows

    def bitmask(self) -> torch.Tensor:
        if self._bitmask is None:
            self._bitmask = self._parent.bitmask()[self._selected]
        return self._bitmask

    def rows(self) -> list[int]:
        constrained = set(self._parent.rows())
        return [k for k, row in enumerate(self._selected) if row in constrained]


class GrammarBackend:
    """Compiles grammars for one tokenizer (`vocab_size`: the model's, which may exceed the
    tokenizer's) on `COMPILE_THREADS` worker threads, keeping the last `CACHE_SIZE` distinct ones
    (fewer where they would hold over `CACHE_MAX_BYTES`). A compile's future may be cancelled by
    its last waiter before it starts; the cache then compiles that text again when it is asked
    for next. Evicting a grammar only drops the cache's reference: requests using it keep it."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int]) -> None:
        xgr = _xgrammar()
        if xgr is None:
            raise ValueError("grammar_backend 'xgrammar' needs the xgrammar package "
                             "(pip install 'tide[grammar]')")
        self._xgr = xgr
        self.vocab_size = vocab_size
        stops = sorted(t for t in stop_token_ids if 0 <= t < vocab_size)
        self._info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                        stop_token_ids=stops or None)
        self._compiler = xgr.GrammarCompiler(self._info, max_threads=2, cache_enabled=False)
        self._pool = ThreadPoolExecutor(max_workers=COMPILE_THREADS,
                                        thread_name_prefix="tide-grammar")
        # Fills a batch's masks on several threads (a row inside a JSON string checks most of
        # the vocabulary: ~0.1 ms a row at 152k tokens on one core).
        self._filler = xgr.BatchGrammarMatcher(max_threads=min(8, os.cpu_count() or 1))
        self._cache: OrderedDict[tuple[str, str], Future] = OrderedDict()
        self._sizes: dict[tuple[str, str], int] = {}  # bytes of each compiled grammar cached
        self._bytes = 0  # their sum
        self._lock = threading.Lock()

    def compile(self, field: str, text: str) -> Future:
        """A future of the compiled grammar (shared by every request with the same text). A
        grammar that fails to compile gives a future holding a ValueError naming `field`."""
        key = (field, text)
        with self._lock:
            future = self._cache.get(key)
            if future is not None and not future.cancelled():
                self._cache.move_to_end(key)
                return future
            future = self._pool.submit(self._compile, field, text)
            self._cache[key] = future
            self._cache.move_to_end(key)
            self._evict()
        # Outside the lock: a compile already done runs the callback here, at once.
        future.add_done_callback(lambda done: self._account(key, done))
        return future

    @property
    def cached_bytes(self) -> int:
        """Bytes of xgrammar's tables the cache holds (compiled grammars only)."""
        return self._bytes

    def _account(self, key: tuple[str, str], future: Future) -> None:
        """Count a finished compile's size while the cache still holds it; evict to the bounds."""
        if future.cancelled() or future.exception() is not None:
            return
        size = int(getattr(future.result(), "memory_size_bytes", 0))
        with self._lock:
            if self._cache.get(key) is future and key not in self._sizes:
                self._sizes[key] = size
                self._bytes += size
                self._evict(keep=key)

    def drop(self, future: Future) -> None:
        """No request waits for `future` any more: a compile not yet started never runs, and the
        cache forgets it (a running one finishes and stays cached)."""
        if not future.cancel():
            return
        with self._lock:
            for key, cached in self._cache.items():
                if cached is future:
                    del self._cache[key]
                    break

    def _evict(self, keep: tuple[str, str] | None = None) -> None:
        """Drop the least recently used entries past `CACHE_SIZE`, then the least recently used
        compiled ones while their tables pass `CACHE_MAX_BYTES` (compiles still running hold
        nothing yet and stay, so none runs twice; `keep`, the one just counted, stays even alone
        over the bytes). The lock is held."""
        while len(self._cache) > CACHE_SIZE:
            key, _ = self._cache.popitem(last=False)
            self._bytes -= self._sizes.pop(key, 0)
        if self._bytes <= CACHE_MAX_BYTES:
            return
        for key in [k for k in self._cache if k in self._sizes and k != keep]:
            del self._cache[key]
            self._bytes -= self._sizes.pop(key)
            if self._bytes <= CACHE_MAX_BYTES:
                return

    def _compile(self, field: str, text: str) -> Any:
        compile_with: Callable[[str], Any] = {
            "json_schema": self._compiler.compile_json_schema,
            "regex": self._compiler.compile_regex,
            "ebnf": self._compiler.compile_grammar,
        }[field]
        try:
            return compile_with(text)
        except (RuntimeError, ValueError, RecursionError) as e:
            raise ValueError(f"{field} could not be compiled: {_error_text(e)}") from None

    def matcher(self, compiled: Any) -> RequestGrammar:
        return RequestGrammar(self._xgr.GrammarMatcher(compiled), self.vocab_size, self._filler)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
