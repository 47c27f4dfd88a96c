"""Tool calls out of a model's output text (`tide serve --tool-call-parser NAME`).

A chat completion with `tools` then answers with `message.tool_calls` (streams: `delta.tool_calls`,
each call whole in one delta) and `finish_reason: "tool_calls"`, as OpenAI's API does. The formats,
named as sglang names them:

- `qwen25` (alias `qwen`; Qwen2.5, Qwen3, Hermes-style models): each call is
  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, anywhere in the text.
- `llama3` (Llama 3.1+ JSON tool calling): the output is `{"name": ..., "parameters": {...}}`,
  several separated by `;`, optionally after `<|python_tag|>`.
- `mistral`: the output is `[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]` (the marker is
  a special token, so it is usually gone from the text already).

A call counts only if it names one of the request's tools and its arguments are a JSON object
(strict JSON: no NaN; missing arguments are `{}`); otherwise its text stays in the content, so
nothing the model wrote is lost. Call ids are `call_` and 24 hex digits, or for `mistral` 9 letters
and digits (the form Mistral's templates take back). Whitespace next to a
call is dropped. Text arrives in any pieces; every split gives the same result.
"""

from __future__ import annotations

import dataclasses
import json
import secrets
import string
import uuid
from collections.abc import Callable, Collection
from typing import Any, Protocol

from tide.grammar import framed_json_ebnf
from tide.server.text_segments import Opening, Trimmed, partial_tag_suffix


@dataclasses.dataclass(frozen=True)
class ToolCall:
    """One parsed call: the function's name, its arguments as JSON object text, and the id the
    parser gave it (in the form the model family's templates take back; not compared)."""

    name: str
    arguments: str
    id: str = dataclasses.field(default="", compare=False)

    def to_openai(self, index: int | None = None) -> dict[str, Any]:
        """The call as OpenAI's `tool_calls` item (streams give each item its `index`)."""
        out: dict[str, Any] = {"id": self.id, "type": "function",
                               "function": {"name": self.name, "arguments": self.arguments}}
        if index is not None:
            out["index"] = index
        return out


@dataclasses.dataclass
class _Piece:
    """Raw output text, and for the text of a call region the JSON values decoded from it (None:
    plain text, or a region that did not decode)."""

    text: str
    values: list[Any] | None = None


class _Format(Protocol):
    def feed(self, text: str) -> list[_Piece]: ...

    def finish(self) -> list[_Piece]: ...


def _json_values(body: str) -> list[Any] | None:
    """The JSON values of `body`, one after another, separated by whitespace or `;` (None: not
    all of it is JSON)."""
    decoder = json.JSONDecoder()
    values: list[Any] = []
    pos, end = 0, len(body)
    try:
        while True:
            while pos < end and (body[pos].isspace() or (values and body[pos] == ";")):
                pos += 1
            if pos == end:
                return values or None
            value, pos = decoder.raw_decode(body, pos)
            values.append(value)
    except (ValueError, RecursionError):
        return None


class _TaggedCalls:
    """Calls between a start and an end tag, anywhere in the text (qwen25)."""

    START = "<tool_call>"
    END = "</tool_call>"

    def __init__(self) -> None:
        self._text = ""  # outside a call: what may begin START (shorter than it)
        self._call: list[str] = []  # inside a call: its text so far, in pieces
        self._tail = ""  # inside a call: its last len(END) - 1 characters
        self._in_call = False

    def feed(self, text: str) -> list[_Piece]:
        out: list[_Piece] = []
        if self._in_call:  # a call begun in an earlier piece: look for END across the seam
            window = self._tail + text
            end = window.find(self.END)
            if end < 0:
                self._call.append(text)
                self._tail = window[-(len(self.END) - 1):]
                return out
            cut = end - len(self._tail)  # where END starts in `text` (< 0: in the tail)
            body = "".join(self._call)
            body = body[:len(body) + cut] if cut < 0 else body + text[:cut]
            out.append(_Piece(self.START + body + self.END, _json_values(body)))
            self._call, self._tail, self._in_call = [], "", False
            buf, pos = text, cut + len(self.END)
        else:
            buf, pos, self._text = self._text + text, 0, ""
        # One scan of `buf` from `pos` on: linear in the piece, however many calls it holds.
        while True:
            start = buf.find(self.START, pos)
            if start < 0:
                rest = buf[pos:]
                cut = len(rest) - partial_tag_suffix(rest, (self.START,))
                if cut:
                    out.append(_Piece(rest[:cut]))
                self._text = rest[cut:]
                return out
            if start > pos:
                out.append(_Piece(buf[pos:start]))
            pos = start + len(self.START)
            end = buf.find(self.END, pos)
            if end < 0:  # the call goes on in the next piece
                rest = buf[pos:]
                self._call, self._tail, self._in_call = [rest], rest[-(len(self.END) - 1):], True
                return out
            body = buf[pos:end]
            out.append(_Piece(self.START + body + self.END, _json_values(body)))
            pos = end + len(self.END)

    def finish(self) -> list[_Piece]:
        if self._in_call:  # the output ended inside a call: it counts if its JSON is whole
            body = "".join(self._call)
            self._call, self._tail, self._in_call = [], "", False
            return [_Piece(self.START + body, _json_values(body))]
        text, self._text = self._text, ""
        return [_Piece(text)] if text else []


class _LeadingCalls:
    """An output that is nothing but calls: an optional marker, then JSON from `opener` on to the
    end (llama3, mistral). Any other output is text, shown as it comes; calls are decoded once the
    output has ended."""

    def __init__(self, marker: str, opener: str) -> None:
        self._marker, self._opener = marker, opener
        self._opening = Opening()
        self._calls: list[str] = []
        self._state = "start"

    def feed(self, text: str) -> list[_Piece]:
        if self._state == "calls":
            self._calls.append(text)
            return []
        if self._state == "start":
            head = self._opening.add(text)
            if head.startswith((self._marker, self._opener)):
                self._state, self._calls = "calls", [self._opening.text()]
                return []
            if not head or self._marker.startswith(head):
                return []
            self._state, text = "text", self._opening.text()
        return [_Piece(text)] if text else []

    def finish(self) -> list[_Piece]:
        if self._state == "start":
            text = self._opening.text()
            return [_Piece(text)] if text else []
        if self._state == "text":
            return []
        text = "".join(self._calls)
        head = text.lstrip()
        body = head[len(self._marker):] if head.startswith(self._marker) else head
        return [_Piece(text, _json_values(body))]


def _hex_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _mistral_call_id() -> str:
    """Mistral's chat templates take back only ids of 9 letters and digits."""
    return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))


# name -> (a new parser of that format, a new call id in that family's form)
_FORMATS: dict[str, tuple[Callable[[], _Format], Callable[[], str]]] = {
    "qwen25": (_TaggedCalls, _hex_call_id),
    "qwen": (_TaggedCalls, _hex_call_id),
    "llama3": (lambda: _LeadingCalls("<|python_tag|>", "{"), _hex_call_id),
    "mistral": (lambda: _LeadingCalls("[TOOL_CALLS]", "["), _mistral_call_id),
}
TOOL_CALL_PARSERS = tuple(_FORMATS)


# name -> (text before a forced call, the arguments' key, text after it): the call's framing in
# that format, for tool_choice "required" or a named function (one call, compact JSON).
_FORCED: dict[str, tuple[str, str, str]] = {
    "qwen25": ("<tool_call>\n", "arguments", "\n</tool_call>"),
    "qwen": ("<tool_call>\n", "arguments", "\n</tool_call>"),
    "llama3": ("", "parameters", ""),
    "mistral": ("[", "arguments", "]"),  # the [TOOL_CALLS] marker is a special token: left out
}


def forced_call_grammar(parser: str, tools: list[dict[str, Any]], name: str | None) -> str:
    """EBNF text that holds an output to one call, in `parser`'s format, of the function `name`
    (None: any of `tools`), its arguments following the function's `parameters` schema (any JSON
    object where it has none). ValueError saying why when it cannot be built."""
    prefix, key, suffix = _FORCED[parser]
    options = []
    # Each function's schema sits under the root's $defs, its local references ("#/$defs/X",
    # "#/definitions/X", "#") rewritten to point there: they name places in that schema, not in
    # the schema built around it.
    defs: dict[str, Any] = {}
    for tool in tools:
        function = tool["function"]
        if name is not None and function["name"] != name:
            continue
        params = function.get("parameters") or {"type": "object"}
        where = f"tool{len(defs)}"
        defs[where] = _rebase_refs(params, f"#/$defs/{where}")
        options.append({"type": "object", "properties": {"name": {"const": function["name"]},
                                                         key: {"$ref": f"#/$defs/{where}"}},
                        "required": ["name", key], "additionalProperties": False})
    if not options:
        raise ValueError(f"no tool is named {name!r}")
    schema = options[0] if len(options) == 1 else {"anyOf": options}
    return framed_json_ebnf(prefix, {"$defs": defs, **schema}, suffix)


def _rebase_refs(schema: Any, base: str) -> Any:
    """`schema` with each local `$ref` ("#...") moved under the JSON pointer `base`."""
    if isinstance(schema, dict):
        return {k: base + v[1:] if k == "$ref" and isinstance(v, str) and v.startswith("#")
                else _rebase_refs(v, base) for k, v in schema.items()}
    if isinstance(schema, list):
        return [_rebase_refs(v, base) for v in schema]
    return schema


def check_tool_call_parser(name: str | None) -> str | None:
    if name is not None and name not in _FORMATS:
        raise ValueError(f"tool_call_parser must be one of {sorted(_FORMATS)}, got {name!r}")
    return name


class FunctionCallParser:
    """One output's content/tool-call split, fed in pieces: `feed` and `finish` return the content
    that can be shown so far and the calls completed so far.

    `tool_names`: the request's functions (a call naming another stays text); `parallel`: False
    keeps only the first call (OpenAI's `parallel_tool_calls`)."""

    def __init__(self, name: str, tool_names: Collection[str], parallel: bool = True) -> None:
        check_tool_call_parser(name)
        new_format, self._new_id = _FORMATS[name]
        self._format = new_format()
        self._tool_names = frozenset(tool_names)
        self._parallel = parallel
        self._segment = Trimmed(after_tag=False)
        self.num_calls = 0

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        return self._take(self._format.feed(text))

    def finish(self) -> tuple[str, list[ToolCall]]:
        """The output ended: whatever was held back."""
        content, calls = self._take(self._format.finish())
        return content + self._segment.at_end(), calls

    def _take(self, pieces: list[_Piece]) -> tuple[str, list[ToolCall]]:
        content = ""
        calls: list[ToolCall] = []
        for piece in pieces:
            parsed = self._calls(piece.values) if piece.values is not None else None
            if parsed is None:
                content += self._segment.push(piece.text)
                continue
            self._segment.before_tag()
            self._segment = Trimmed(after_tag=True)
            for call in parsed:
                if self._parallel or self.num_calls == 0:
                    calls.append(call)
                    self.num_calls += 1
        return content, calls

    def _calls(self, values: list[Any]) -> list[ToolCall] | None:
        """The calls `values` hold (objects, or lists of objects), or None if any is not a call of
        one of the request's functions."""
        items = [item for value in values
                 for item in (value if isinstance(value, list) else [value])]
        calls = [self._call(item) for item in items]
        if not calls or any(call is None for call in calls):
            return None
        return [call for call in calls if call is not None]

    def _call(self, item: Any) -> ToolCall | None:
        if not isinstance(item, dict):
            return None
        name = item.get("name")
        if not isinstance(name, str) or name not in self._tool_names:
            return None
        args = item.get("arguments", item.get("parameters", {}))
        try:
            if isinstance(args, str):
                args = json.loads(args)
            if not isinstance(args, dict):
                return None
            # strict JSON (no NaN), every string valid Unicode (no lone surrogate from an escape)
            text = json.dumps(args, ensure_ascii=False, allow_nan=False)
            text.encode("utf-8")
        except (ValueError, RecursionError):
            return None
        return ToolCall(name, text, self._new_id())
