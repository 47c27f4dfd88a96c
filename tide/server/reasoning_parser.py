"""Separates a reasoning model's thinking from its answer (`tide serve --reasoning-parser NAME`).

Chat completions then carry the thinking as `message.reasoning_content` (streams: `delta.
reasoning_content`) and only the answer as `content`, as sglang's parsers of the same names do:

- `qwen3`: thinking is what an output opening with `<think>` holds up to `</think>`; an output that
  does not open with `<think>` (e.g. `enable_thinking=False`) is all answer.
- `deepseek-r1`, `qwen3-thinking`: the chat template opens the thinking in the prompt, so the output
  starts in it (a leading `<think>` is dropped) and the answer begins after `</think>`.

Thinking cut short (no `</think>` before the output ended) is all thinking. Whitespace next to the
tags is dropped. Text arrives in any pieces; every split gives the same result.
"""

from __future__ import annotations

from tide.server.text_segments import Opening, Trimmed, partial_tag_suffix

THINK_START = "<think>"
THINK_END = "</think>"
# name -> whether the output starts inside the thinking
REASONING_PARSERS: dict[str, bool] = {"qwen3": False, "deepseek-r1": True, "qwen3-thinking": True}


def check_reasoning_parser(name: str | None) -> str | None:
    if name is not None and name not in REASONING_PARSERS:
        raise ValueError(f"reasoning_parser must be one of {sorted(REASONING_PARSERS)}, got "
                         f"{name!r}")
    return name


class ReasoningParser:
    """One output's thinking/answer split, fed in pieces: `feed` and `finish` return the
    (reasoning, answer) text that can be shown so far. Linear in the output's length."""

    def __init__(self, name: str) -> None:
        check_reasoning_parser(name)
        self._starts_inside = REASONING_PARSERS[name]
        self._state = "start"
        self._opening = Opening()
        self._buf = ""  # thinking: what may begin THINK_END (shorter than it)
        self._reasoning = Trimmed(after_tag=True)
        self._answer = Trimmed(after_tag=False)

    def feed(self, text: str) -> tuple[str, str]:
        reasoning = ""
        if self._state == "start":
            head = self._opening.add(text)
            if head.startswith(THINK_START):
                self._state, text = "reasoning", head[len(THINK_START):]
            elif THINK_START.startswith(head):
                return "", ""  # may still become the tag
            elif self._starts_inside:
                self._state, text = "reasoning", head
            else:
                self._state, text = "answer", self._opening.text()
        if self._state == "reasoning":
            text, self._buf = self._buf + text, ""
            end = text.find(THINK_END)
            if end < 0:
                cut = len(text) - partial_tag_suffix(text, (THINK_END,))
                self._buf = text[cut:]
                return self._reasoning.push(text[:cut]), ""
            reasoning = self._reasoning.push(text[:end])
            self._reasoning.before_tag()
            self._state, self._answer = "answer", Trimmed(after_tag=True)
            text = text[end + len(THINK_END):]
        return reasoning, self._answer.push(text)

    def finish(self) -> tuple[str, str]:
        """The output ended: whatever was held back."""
        if self._state == "start":
            if self._starts_inside:
                return self._reasoning.push(self._opening.text()) + self._reasoning.at_end(), ""
            return "", self._opening.text()
        if self._state == "reasoning":
            buf, self._buf = self._buf, ""
            return self._reasoning.push(buf) + self._reasoning.at_end(), ""
        return "", self._answer.at_end()
