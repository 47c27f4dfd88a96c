"""Incremental detokenization: the scheduler finds stop strings with it, the HTTP side shows text with it.

`IncrementalDetokenizer` turns a growing list of output token ids into text that is safe to show:

* **Multi-byte characters.** A token may end in the middle of a UTF-8 character; the tokenizer then
  decodes the partial bytes as U+FFFD. Text ending in U+FFFD is held back until a later token completes
  the character (or the request finishes, when whatever is left is flushed as is).
* **Word boundaries.** Decoding the output alone can drop a leading space (SentencePiece strips it from
  the first token), so a few prompt tokens are decoded with it as context and their text subtracted.
* **Stop strings.** Text is never released past the start of a stop string, and the tail that could be
  the beginning of one is held back until it is clear whether the stop string follows. With
  `min_new_tokens`, a stop string counts only where a token after the min_new_tokens-th completes it
  (as vLLM's `min_tokens` does): the scheduler's decoder (token by token) and the server's (in chunks,
  split at that token) then agree on the match.

Invariant: `visible_text` only ever grows by appending (each value is a prefix of the next), so a stream
can send `visible_text[sent:]` at any time.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from tide.tokenizer import decode

if TYPE_CHECKING:
    from tide.tokenizer import Tokenizer

_CONTEXT_TOKENS = 5
_REPLACEMENT = "\ufffd"
# A character is at most 4 bytes, so an unfinished one lies in at most 3 tokens (of at least a byte
# each). Text still ending in an unfinished character after this many held tokens *and* this many
# `add`s is bytes no later token completes (a lone UTF-8 continuation byte, repeated): it is shown
# as decoded, so each decode stays short (holding it forever made every `add` decode all of it).
_MAX_HELD = 8


class IncrementalDetokenizer:
    """Per-request incremental decoder with multi-byte hold-back and stop-string handling."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_ids: Sequence[int],
        skip_special_tokens: bool = True,
        stop: Sequence[str] = (),
        min_new_tokens: int = 0,
        keep_stop: bool = False,
        spaces_between_special_tokens: bool = True,
    ) -> None:
        """`keep_stop` (`no_stop_trim`): once a stop string is found, the text after its start is
        shown too (the text of every token added) rather than cut there.
        `spaces_between_special_tokens` goes to the tokenizer's `decode` (`tide.tokenizer.decode`)."""
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._spaces = spaces_between_special_tokens
        context = list(prompt_ids[-_CONTEXT_TOKENS:])
        if context and self._decode(context).endswith(_REPLACEMENT):
            context = []  # the prompt ends mid-character; its text is no clean prefix
        self._ids: list[int] = context
        self._prefix_offset = 0
        self._read_offset = len(context)
        self.text = ""  # decoded output so far (complete characters unless finished)
        self._emitted = 0  # chars of the pending text (after _read_offset) already in `text`
        self._stops = [s for s in stop if s]
        self._max_stop = max((len(s) for s in self._stops), default=0)
        self._scanned = 0
        self._min_new_tokens = min_new_tokens
        self._keep_stop = keep_stop
        self._added = 0  # output tokens given to `add`
        self._held_adds = 0  # `_append`s since the pending text last ended in a whole character
        self.stop_pos: int | None = None
        self.stop_matched: str | None = None
        self.finished = False
        self._visible_len = 0

    def _decode(self, ids: Sequence[int]) -> str:
        return decode(self._tokenizer, ids, self._skip, self._spaces)

    def add(self, token_ids: Sequence[int]) -> None:
        """Append new output tokens; decoded text appears once its characters are complete."""
        if not token_ids or self.stop_matched is not None:
            return
        first_armed = self._min_new_tokens - self._added  # index of the token after the minimum
        if 0 < first_armed < len(token_ids):
            self._append(token_ids[:first_armed], armed=False)
            self._append(token_ids[first_armed:], armed=True)
        else:
            self._append(token_ids, armed=first_armed <= 0)

    def _append(self, token_ids: Sequence[int], armed: bool) -> None:
        """`add` for tokens all up to the min_new_tokens-th (`armed` False) or all after it."""
        self._added += len(token_ids)
        self._ids.extend(token_ids)
        new = self._pending_text()
        unfinished = new.endswith(_REPLACEMENT)
        self._held_adds = self._held_adds + 1 if unfinished else 0
        if unfinished and (len(self._ids) - self._read_offset <= _MAX_HELD
                           or self._held_adds <= _MAX_HELD):
            # Show what is complete; keep the unfinished character(s) for later.
            safe = new.rstrip(_REPLACEMENT)
            if len(safe) > self._emitted:
                self.text += safe[self._emitted :]
                self._emitted = len(safe)
        else:
            self.text += new[self._emitted :]
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)
            self._emitted = 0
            self._held_adds = 0
        self._scan_stops(armed)

    def finish(self) -> None:
        """No more tokens: flush held-back bytes (even an incomplete character) and stop prefixes."""
        if self.finished:
            return
        if self.stop_matched is None and self._read_offset < len(self._ids):
            new = self._pending_text()
            self.text += new[self._emitted :]
            self._read_offset = len(self._ids)
            self._emitted = 0
            self._scan_stops(self._added > self._min_new_tokens)
        self.finished = True

    def _pending_text(self) -> str:
        """Text of the tokens after `_read_offset`, decoded with the tokens before it as context."""
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full = self._decode(self._ids[self._prefix_offset :])
        return full[len(prefix) :] if len(full) > len(prefix) else ""

    def _scan_stops(self, armed: bool = True) -> None:
        """Find the first stop string that ends in text added since the last scan (when `armed`;
        otherwise that text is only marked scanned). Each stop is searched from where an occurrence
        would reach the new text, so one lying wholly in text scanned unarmed is passed over."""
        if not self._stops or self.stop_matched is not None:
            return
        if not armed:
            self._scanned = len(self.text)
            return
        best: tuple[int, str] | None = None
        for stop in self._stops:
            pos = self.text.find(stop, max(0, self._scanned - len(stop) + 1))
            if pos >= 0 and (best is None or pos < best[0]):
                best = (pos, stop)
        if best is not None:
            self.stop_pos, self.stop_matched = best
        self._scanned = len(self.text)

    def _partial_stop_len(self) -> int:
        """Length of the longest tail of `text` that is a proper prefix of some stop string."""
        text = self.text
        for k in range(min(self._max_stop - 1, len(text)), 0, -1):
            tail = text[-k:]
            if any(s.startswith(tail) for s in self._stops):
                return k
        return 0

    @property
    def visible_text(self) -> str:
        """Text that may be shown now: never past a stop string, never a possible stop prefix."""
        if self.stop_pos is not None:
            end = len(self.text) if self._keep_stop else self.stop_pos
        elif self.finished or not self._stops:
            end = len(self.text)
        else:
            end = len(self.text) - self._partial_stop_len()
        self._visible_len = max(self._visible_len, end)
        return self.text[: self._visible_len]
