"""sglang's `/parse_function_call` and `/separate_reasoning`: the chat parsers on a given text.

For clients that generate through `/generate` (token ids in, token ids out, as RL rollouts of
multi-turn tool use do) and want the same tool calls and thinking a chat completion would give.
The work is linear in the text, which may be no longer than a prompt (`max_chars`: the context
length times `prompt_chars_per_token`); the routes run it on a worker thread.
"""

from __future__ import annotations

from typing import Any

from tide.server.errors import invalid_request
from tide.server.function_call_parser import TOOL_CALL_PARSERS, FunctionCallParser
from tide.server.limits import RequestLimits, check_at_most
from tide.server.protocol import ParseFunctionCallInput, SeparateReasoningInput
from tide.server.reasoning_parser import REASONING_PARSERS, ReasoningParser


def _parser_name(given: str | None, default: str | None, known: tuple[str, ...],
                 param: str) -> str:
    name = given if given is not None else default
    if name is None:
        raise invalid_request(f"'{param}' is required: this server was started without "
                              f"--{param.replace('_', '-')} (one of {', '.join(known)})", param,
                              "invalid_value")
    if name not in known:
        raise invalid_request(f"'{param}' must be one of {', '.join(known)}, got {name!r}", param,
                              "invalid_value")
    return name


def parse_function_call(body: ParseFunctionCallInput, default_parser: str | None,
                        limits: RequestLimits, max_chars: int) -> dict[str, Any]:
    """`{"normal_text", "calls": [{"tool_index", "name", "parameters"}]}` as sglang answers, with
    `parameters` the call's arguments as JSON text and `tool_index` its function's place in
    `tools`."""
    name = _parser_name(body.tool_call_parser, default_parser, TOOL_CALL_PARSERS,
                        "tool_call_parser")
    check_at_most(len(body.tools), limits.max_tools, "tools", "tools")
    check_at_most(len(body.text), max_chars, "text", "characters")
    names = [tool.function.name for tool in body.tools]
    parser = FunctionCallParser(name, names)
    text, calls = parser.feed(body.text)
    more_text, more_calls = parser.finish()
    return {"normal_text": text + more_text,
            "calls": [{"tool_index": names.index(call.name), "name": call.name,
                       "parameters": call.arguments} for call in calls + more_calls]}


def separate_reasoning(body: SeparateReasoningInput, default_parser: str | None,
                       max_chars: int) -> dict[str, Any]:
    """`{"text", "reasoning_text"}` as sglang answers: the answer and the thinking."""
    name = _parser_name(body.reasoning_parser, default_parser, tuple(REASONING_PARSERS),
                        "reasoning_parser")
    check_at_most(len(body.text), max_chars, "text", "characters")
    parser = ReasoningParser(name)
    reasoning, answer = parser.feed(body.text)
    more_reasoning, more_answer = parser.finish()
    return {"text": answer + more_answer, "reasoning_text": reasoning + more_reasoning}
