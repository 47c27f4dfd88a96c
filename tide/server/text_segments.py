"""Pieces shared by the chat output parsers (`reasoning_parser`, `function_call_parser`).

Both parsers take a model's output text in arbitrary pieces (as a stream delivers it) and must give
the same result for any split, the whole text in one piece included. They hold back what could still
turn into a tag, and drop whitespace next to a tag: `Trimmed` does the second.
"""

from __future__ import annotations


def partial_tag_suffix(text: str, tags: tuple[str, ...]) -> int:
    """Length of the longest end of `text` that is a proper beginning of one of `tags` (0: none),
    i.e. what must wait for the next piece before it can be shown as text."""
    best = 0
    for tag in tags:
        for k in range(min(len(tag) - 1, len(text)), best, -1):
            if text.endswith(tag[:k]):
                best = k
                break
    return best


class Trimmed:
    """One segment of text between tags, emitted piece by piece with the whitespace that touches a
    tag removed: leading whitespace when the segment follows a tag (`after_tag`), trailing whitespace
    when a tag ends it (`before_tag`). Trailing whitespace is held until something else follows it,
    so a stream never sends what a later tag would have removed."""

    def __init__(self, after_tag: bool) -> None:
        self._started = not after_tag
        self._held: list[str] = []  # pieces, joined when shown: a long run costs linear time

    def push(self, text: str) -> str:
        """The part of `text` that can be shown now."""
        if not self._started:
            text = text.lstrip()
            if not text:
                return ""
            self._started = True
        body = text.rstrip()
        if not body:
            self._held.append(text)
            return ""
        out = "".join(self._held) + body
        self._held = [text[len(body):]]
        return out

    def before_tag(self) -> None:
        """A tag ends the segment: the held whitespace is dropped."""
        self._held = []

    def at_end(self) -> str:
        """The output ends the segment: the held whitespace is shown after all."""
        held, self._held = "".join(self._held), []
        return held


class Opening:
    """The start of an output, until it shows whether it opens with a tag: the leading whitespace
    (kept in pieces) and the first other characters (`head`, never longer than the tags)."""

    def __init__(self) -> None:
        self._lead: list[str] = []
        self.head = ""

    def add(self, text: str) -> str:
        """Take `text`; return the head so far."""
        if not self.head:
            body = text.lstrip()
            self._lead.append(text[:len(text) - len(body)])
            text = body
        self.head += text
        return self.head

    def text(self) -> str:
        """Everything taken, whitespace included."""
        return "".join(self._lead) + self.head
