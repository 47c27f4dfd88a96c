"""OpenAI-compatible `/v1/completions`, `/v1/chat/completions` and `/v1/models`.

Responses follow the OpenAI schema so the official `openai` client works unchanged. Choices are ordered
prompt-major (`index = prompt * n + j`). Streams send one chunk per choice with new text, then (with
`stream_options.include_usage`) a chunk with empty `choices` and the `usage`, then `data: [DONE]`.
A completions stream also puts the running `usage` on the chunk that finishes the last choice, so a
client that does not ask for it still gets the totals. Finish reasons: `stop`, `length`, or `abort`
(aborted by `/abort_request`, shutdown, or the server).

Non-streaming responses carry sglang's `"metadata": {"weight_version": ...}` (streams do not).

Without a tokenizer (`--skip-tokenizer-init`) completions take token-id prompts only and return empty
`text`; chat, text prompts and stop strings are a 400 naming the field.

Completions with `echo` and `logprobs` score the prompt (its first token's logprob is null), as
OpenAI's legacy completions do; with `logprobs`, a stream sends a choice's echoed prompt once its
prompt is prefilled (without, at once).

Chat with `tools` (tool_choice `auto`) needs `--tool-call-parser`: calls come back as
`message.tool_calls` with `finish_reason: "tool_calls"` (`function_call_parser`); `--reasoning-parser`
moves a reasoning model's thinking to `reasoning_content` (`reasoning_parser`). Earlier turns' calls
(`messages[k].tool_calls`) and results (role `tool`) reach the chat template.

`response_format` (`json_object`, `json_schema`) and sglang's `json_schema` / `regex` / `ebnf` fields
(one of them at most) constrain the output (`tide.grammar`).

tool_choice `required` or a named function holds the output to one call in the parser's format
(its arguments following the function's `parameters` schema) through constrained decoding; a
thinking model does not think first.

Not supported (400): the legacy `functions`, `best_of`, `suffix`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import inspect
import json
import re
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi.responses import Response, StreamingResponse
from starlette.requests import Request

from tide.sampling_params import SamplingParams
from tide.server.auth import caller_of
from tide.server.errors import APIError, invalid_request
from tide.server.function_call_parser import FunctionCallParser, ToolCall, forced_call_grammar
from tide.server.limits import check_at_most, check_logprob_entries
from tide.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    NamedToolChoice,
    _OpenAISampling,
)
from tide.server.reasoning_parser import ReasoningParser
from tide.server.tokenizer_manager import (
    ClientDisconnected,
    DisconnectWatch,
    ReqState,
    TokenizerManager,
)
from tide.server.utils import (
    SSE_DONE,
    SSE_HEADERS,
    large_json_response,
    make_sampling_params,
    rendered,
    sse,
)

_OPENAI_NAMES = {"max_new_tokens": "max_tokens"}


def _json_schema(req: _OpenAISampling) -> str | None:
    """The JSON schema (as text) the request holds its output to: `response_format`'s (any JSON
    object for `json_object`), or sglang's `json_schema` field; 400 when both are given."""
    fmt = req.response_format
    if fmt is None or fmt.type == "text":
        if fmt is not None and fmt.json_schema is not None:
            raise invalid_request("response_format.json_schema needs type 'json_schema'",
                                  "response_format", "invalid_value")
        return req.json_schema
    if req.json_schema is not None:
        raise invalid_request("give response_format or json_schema, not both", "json_schema",
                              "invalid_value")
    if fmt.type == "json_object":
        if fmt.json_schema is not None:
            raise invalid_request("response_format.json_schema needs type 'json_schema'",
                                  "response_format", "invalid_value")
        return '{"type": "object"}'
    if fmt.json_schema is None or fmt.json_schema.schema_ is None:
        raise invalid_request("response_format of type 'json_schema' needs json_schema.schema",
                              "response_format", "invalid_value")
    try:
        return json.dumps(fmt.json_schema.schema_)
    except (ValueError, RecursionError):
        raise invalid_request("response_format.json_schema.schema is not serialisable JSON",
                              "response_format", "invalid_value") from None


def finish_reason_name(reason: dict[str, Any] | None) -> str | None:
    if reason is None:
        return None
    kind = reason.get("type")
    return kind if kind in ("stop", "length") else "abort"


@dataclasses.dataclass
class _Prompt:
    ids: list[int]
    text: str | None  # the prompt as text (for echo); None until needed


_OFFSET_WINDOW = 8  # tokens of context when measuring the text a token adds (text_offset)


class OpenAIServingBase:
    """What both OpenAI routes share: model check, sampling params, submission, token strings."""

    def __init__(self, tm: TokenizerManager, served_model_names: list[str]) -> None:
        self.tm = tm
        self.served_model_names = served_model_names

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]

    def check_model(self, model: str) -> None:
        if model not in self.served_model_names:
            raise APIError(
                f"The model '{model}' does not exist; this server serves "
                f"'{self.model_name}'", 404, param="model", code="model_not_found")

    def sampling_params(self, req: _OpenAISampling, num_prompts: int) -> SamplingParams:
        """The request's sampling parameters, checked against the server's limits before any prompt
        is tokenized (`max_new_tokens` is 0 here; the caller sets it once the prompts' lengths are
        known)."""
        limits = self.tm.limits
        check_at_most(req.n, limits.max_n, "n", "sequences")
        check_at_most(num_prompts * req.n, limits.max_batch_size, "n",
                      f"sequences in all ({num_prompts} prompts x n)")
        if req.stream_options is not None and not req.stream:
            raise invalid_request("'stream_options' is only allowed when 'stream' is true",
                                  "stream_options", "invalid_value")
        params = {
            "max_new_tokens": 0,
            "temperature": 1.0 if req.temperature is None else req.temperature,
            "top_p": 1.0 if req.top_p is None else req.top_p,
            "top_k": req.top_k,
            "min_p": req.min_p,
            "presence_penalty": req.presence_penalty,
            "frequency_penalty": req.frequency_penalty,
            "repetition_penalty": req.repetition_penalty,
            "stop": req.stop if req.stop else None,
            "stop_token_ids": req.stop_token_ids,
            "ignore_eos": req.ignore_eos,
            "skip_special_tokens": req.skip_special_tokens,
            "seed": req.seed,
            "logit_bias": req.logit_bias,
            "no_stop_trim": req.no_stop_trim,
            "spaces_between_special_tokens": req.spaces_between_special_tokens,
            "regex": req.regex,
            "ebnf": req.ebnf,
            "json_schema": _json_schema(req),
        }
        if req.stop:
            self.tm.require_tokenizer("stop")
        names = dict(_OPENAI_NAMES)
        if req.response_format is not None and req.response_format.type != "text":
            names["json_schema"] = "response_format"
        return make_sampling_params(params, "", names, limits=limits,
                                    vocab_size=self.tm.model_info.vocab_size)

    @staticmethod
    def _with_lengths(params: SamplingParams, req: _OpenAISampling, max_new: int,
                      max_param: str) -> SamplingParams:
        """`params` with the output budget resolved from the prompt (`max_new`) and the request's
        `min_tokens` (400 naming it when it exceeds that budget)."""
        if req.min_tokens > max_new:
            raise invalid_request(f"min_tokens ({req.min_tokens}) must be at most {max_param} "
                                  f"({max_new})", "min_tokens", "invalid_value")
        if req.min_tokens and params.constrained:
            raise invalid_request("min_tokens cannot be combined with response_format, json_schema, "
                                  "regex or ebnf (the grammar decides where the output may end)",
                                  "min_tokens", "invalid_value")
        return dataclasses.replace(params, max_new_tokens=max_new, min_new_tokens=req.min_tokens)

    def _reserve_rid(self, rid: str | None, count: int, owner: str) -> None:
        """400 `duplicate_rid` unless the `count` sequences' rids (`rid`, or `rid-i` for several)
        are free; they stay reserved until `submit` (a stream submits once its response starts)."""
        if rid:
            self.tm.check_rids_free(_sequence_rids(rid, count), owner, reserve=True)

    def submit(self, prompts: list[_Prompt], params: SamplingParams, n: int, event: asyncio.Event,
               rid: str | None, logprobs: int | None, owner: str,
               score_prompt: bool = False) -> list[ReqState]:
        """n sequences per prompt (prompt-major); seeded requests get seed + j for copy j;
        `score_prompt` (with `logprobs`): input logprobs of the whole prompt. The rids'
        reservations (`_reserve_rid`) end here, submitted or not."""
        states: list[ReqState] = []
        subs = _sequence_rids(rid, len(prompts) * n) if rid else []
        reserved = [(owner, r) for r in subs]
        try:
            for i, prompt in enumerate(prompts):
                for j in range(n):
                    seed = None if params.seed is None else (params.seed + j) % 2**63
                    sub = subs[i * n + j] if subs else None
                    states.append(self.tm.submit(
                        prompt.ids, dataclasses.replace(params, seed=seed), event, rid=sub,
                        user_rid=rid, return_logprob=logprobs is not None,
                        top_logprobs_num=logprobs or 0, owner=owner,
                        logprob_start_len=0 if score_prompt else -1,
                    ))
        except BaseException:
            self.tm.abort_states(states, "request failed")
            raise
        finally:
            self.tm.release_rids(reserved)
        return states

    async def wait_all(self, states: list[ReqState], event: asyncio.Event,
                       raw_request: Request) -> bool:
        """Wait for every state to finish; False if the client went away (requests aborted)."""
        try:
            async with DisconnectWatch(raw_request, event) as watch:
                while not all(s.finished for s in states):
                    await self.tm.wait(event, watch)
        except ClientDisconnected:
            return False
        finally:
            self.tm.abort_states(states, "client disconnected")
        return True

    async def deltas(self, states: list[ReqState],
                     event: asyncio.Event) -> AsyncIterator[tuple[int, ReqState, str, int, int, bool]]:
        """What each request added since it was last seen, until all have finished: (index, state,
        new text, first new token, token count, finished). A request's last delta has finished=True;
        a request with nothing new is skipped."""
        sent_text = [0] * len(states)
        sent_tokens = [0] * len(states)
        done = [False] * len(states)
        while True:
            for i, s in enumerate(states):
                if done[i]:
                    continue
                text, n_tok, finished = s.text, len(s.output_ids), s.finished
                if len(text) == sent_text[i] and n_tok == sent_tokens[i] and not finished:
                    continue
                start, delta = sent_tokens[i], text[sent_text[i]:]
                sent_text[i], sent_tokens[i], done[i] = len(text), n_tok, finished
                yield i, s, delta, start, n_tok, finished
            if all(done):
                return
            await self.tm.wait(event)

    @functools.lru_cache(maxsize=65536)  # noqa: B019 - one instance per server
    def token_str(self, token_id: int) -> str:
        """A token's text as shown in logprobs (special tokens included)."""
        tok = self.tm.tokenizer
        return tok.decode([token_id]) if tok is not None else ""

    @functools.lru_cache(maxsize=65536)  # noqa: B019
    def token_bytes(self, token_id: int) -> list[int]:
        """A token's raw UTF-8 bytes, also for tokens holding part of a character."""
        text = self.token_str(token_id)
        if "\ufffd" not in text or self.tm.tokenizer is None:
            return list(text.encode())
        raw = raw_token_bytes(self.tm.tokenizer, token_id)
        return list(raw) if raw is not None else list(text.encode())

    def metadata(self, states: list[ReqState]) -> dict[str, Any]:
        """sglang's `metadata` of non-streaming responses: the weights the output came from."""
        version = states[0].weight_version if states else None
        return {"weight_version": version if version is not None else self.tm.weight_version}

    @staticmethod
    def usage(states: list[ReqState], n: int) -> dict[str, Any]:
        """OpenAI's `usage` for prompt-major `states`, `n` per prompt: each prompt counts once (as
        OpenAI bills `n` choices), its cached tokens are those of its first choice (so `cached_tokens
        <= prompt_tokens`), and every choice's output counts."""
        firsts = states[::n]
        prompt = sum(len(s.prompt_ids) for s in firsts)
        cached = sum(min(s.cached_tokens, len(s.prompt_ids)) for s in firsts)
        completion = sum(len(s.output_ids) for s in states)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
        }


class OpenAIServingCompletion(OpenAIServingBase):
    """`POST /v1/completions`."""

    async def create(self, req: CompletionRequest, raw_request: Request) -> Response:
        self.check_model(req.model)
        if req.logprobs is not None:
            check_at_most(req.logprobs, self.tm.limits.max_top_logprobs, "logprobs")
        prompt = req.prompt
        single = isinstance(prompt, str) or bool(prompt and isinstance(prompt[0], int))
        num_prompts = 1 if single else len(prompt)
        params = self.sampling_params(req, num_prompts)
        async with self.tm.admission:
            prompts = await self._prompts(req)
        # With max_tokens null, every prompt gets the room the longest one leaves.
        max_tokens = min(self.tm.resolve_max_new_tokens(len(p.ids), req.max_tokens, "prompt",
                                                        "max_tokens") for p in prompts)
        params = self._with_lengths(params, req, max_tokens, "max_tokens")
        if req.logprobs is not None:
            echoed = sum(len(p.ids) for p in prompts) if req.echo else 0
            check_logprob_entries(
                (len(prompts) * max_tokens + echoed) * (1 + req.logprobs) * req.n,
                self.tm.limits.max_logprob_entries, "logprobs")
        if req.echo:
            for p in prompts:
                if p.text is None:
                    # as a text prompt echoes: without the special tokens (the BOS) it holds
                    p.text = (self.tm.tokenizer.decode(p.ids, skip_special_tokens=True)
                              if self.tm.tokenizer else "")
        owner = caller_of(raw_request).identity
        self._reserve_rid(req.rid, len(prompts) * req.n, owner)
        event = asyncio.Event()
        cid = f"cmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        if req.stream:
            return StreamingResponse(self._stream(req, prompts, params, event, cid, created, owner),
                                     media_type="text/event-stream", headers=SSE_HEADERS)
        states = self.submit(prompts, params, req.n, event, req.rid, req.logprobs, owner,
                             score_prompt=req.echo)
        if not await self.wait_all(states, event, raw_request):
            return Response(status_code=499)

        def render() -> Response:
            choices = []
            for idx, s in enumerate(states):
                source = prompts[idx // req.n]
                text = s.text
                logprobs = None
                if req.logprobs is not None:
                    logprobs = self._logprobs(s, 0, len(s.output_ids), req.echo, source,
                                              len(source.text or "") if req.echo else 0)
                if req.echo:
                    text = (source.text or "") + text
                choices.append({"index": idx, "text": text, "logprobs": logprobs,
                                "finish_reason": finish_reason_name(s.finished_reason)})
            return large_json_response({
                "id": cid, "object": "text_completion", "created": created,
                "model": self.model_name, "choices": choices, "usage": self.usage(states, req.n),
                "system_fingerprint": None, "metadata": self.metadata(states),
            })

        return await rendered(render, req.logprobs is not None)

    async def _prompts(self, req: CompletionRequest) -> list[_Prompt]:
        prompt = req.prompt
        if isinstance(prompt, str) or (isinstance(prompt, list) and prompt
                                       and isinstance(prompt[0], str)):
            self.tm.require_tokenizer("prompt")
        if isinstance(prompt, str):
            if not prompt:
                raise invalid_request("'prompt' must not be empty", "prompt", "invalid_value")
            ids = await self.tm.tokenize([prompt], ["prompt"])
            return [_Prompt(ids[0], prompt)]
        if not prompt:
            raise invalid_request("'prompt' must not be an empty list", "prompt", "invalid_value")
        if isinstance(prompt[0], str):
            texts: list[str] = list(prompt)
            names = [f"prompt.{k}" for k in range(len(texts))]
            for text, name in zip(texts, names):
                if not text:
                    raise invalid_request(f"'{name}' must not be empty", name, "invalid_value")
            ids_list = await self.tm.tokenize(texts, names)
            return [_Prompt(ids, text) for ids, text in zip(ids_list, texts)]
        if isinstance(prompt[0], int):
            self.tm.check_input_ids(prompt, "prompt")
            return [_Prompt(list(prompt), None)]
        out: list[_Prompt] = []
        for k, token_ids in enumerate(prompt):
            self.tm.check_input_ids(token_ids, f"prompt.{k}")
            out.append(_Prompt(list(token_ids), None))
        return out

    def _logprobs(self, s: ReqState, start: int, end: int, echo: bool, prompt: _Prompt,
                  base: int) -> dict[str, Any]:
        """OpenAI completions logprobs for output tokens [start, end); with `echo` (and start == 0)
        the prompt tokens come first, with their input logprobs (null for the first token, and for
        all of them if the request ended before its prefill). `base` is the text offset of the first
        output token (the echoed prompt's length, else 0). A token's `text_offset` is where its
        text starts in the returned text: the length of the text the tokens before it decode to
        (special tokens skipped as in the text), the same whether streamed or not."""
        tokens: list[str] = []
        token_logprobs: list[float | None] = []
        top: list[dict[str, float] | None] = []
        if echo and start == 0:
            scored = s.input_token_logprobs
            scored_top = s.input_top_logprobs
            for k, t in enumerate(prompt.ids):
                tokens.append(self.token_str(t))
                token_logprobs.append(scored[k] if k < len(scored) else None)
                row = scored_top[k] if k < len(scored_top) else None
                top.append(None if row is None else self._top_entry(row))
        for k in range(start, end):
            tokens.append(self.token_str(s.output_ids[k]))
            token_logprobs.append(s.output_token_logprobs[k] if k < len(s.output_token_logprobs)
                                  else None)
            if s.top_logprobs_num > 0 and k < len(s.output_top_logprobs):
                top.append(self._top_entry(s.output_top_logprobs[k]))
            else:
                top.append(None)
        text_offset = []
        if echo and start == 0:
            prompt_offsets: list[int] = []
            self._text_lengths(prompt.ids, prompt_offsets, len(prompt.ids), True)
            text_offset += prompt_offsets[: len(prompt.ids)]
        self._text_lengths(s.output_ids, s.text_offsets, end, s.params.skip_special_tokens)
        text_offset += [base + s.text_offsets[k] for k in range(start, end)]
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top,
                "text_offset": text_offset}

    def _top_entry(self, row: list[tuple[float, int]]) -> dict[str, float]:
        """OpenAI's `{token text: logprob}` of one position's top logprobs (best first: the best
        one is kept when two tokens have the same text)."""
        entry: dict[str, float] = {}
        for lp, t in row:
            entry.setdefault(self.token_str(t), lp)
        return entry

    def _text_lengths(self, ids: list[int], lengths: list[int], upto: int, skip: bool) -> None:
        """Extend `lengths` so that lengths[k], k <= upto, is the length of the text ids[:k] decode
        to: each token adds what decoding it after up to `_OFFSET_WINDOW` tokens before it adds,
        so the work is linear in the tokens (a full decode per token would be quadratic)."""
        tok = self.tm.tokenizer
        if not lengths:
            lengths.append(0)
        while len(lengths) <= upto:
            k = len(lengths) - 1  # lengths[k + 1] from lengths[k]
            if tok is None:
                lengths.append(0)
                continue
            j = max(0, k - _OFFSET_WINDOW)
            grown = len(tok.decode(ids[j:k + 1], skip_special_tokens=skip))
            before = len(tok.decode(ids[j:k], skip_special_tokens=skip)) if k > j else 0
            lengths.append(lengths[k] + grown - before)

    async def _stream(self, req: CompletionRequest, prompts: list[_Prompt],
                      params: SamplingParams, event: asyncio.Event, cid: str,
                      created: int, owner: str) -> AsyncIterator[bytes]:
        try:
            states = self.submit(prompts, params, req.n, event, req.rid, req.logprobs, owner,
                                 score_prompt=req.echo)
        except APIError as e:
            yield sse(e.body())
            return
        n = req.n
        base = [len(prompts[i // n].text or "") if req.echo else 0 for i in range(len(states))]
        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        def chunk(choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> bytes:
            body: dict[str, Any] = {"id": cid, "object": "text_completion", "created": created,
                                    "model": self.model_name, "choices": choices}
            if usage is not None:
                body["usage"] = usage
            return sse(body)

        def echo_chunk(i: int) -> bytes:
            prompt = prompts[i // n]
            lp = (self._logprobs(states[i], 0, 0, True, prompt, 0)
                  if req.logprobs is not None else None)
            return chunk([{"index": i, "text": prompt.text or "", "logprobs": lp,
                           "finish_reason": None}])

        # With logprobs a choice's echo waits for its first output: its prompt's logprobs come
        # with it (the prefill computes them).
        echo_pending = set(range(len(states))) if req.echo else set()
        try:
            if req.echo and req.logprobs is None:
                for i in range(len(states)):
                    yield echo_chunk(i)
                echo_pending.clear()
            finished_count = 0
            async for i, s, delta, start, end, finished in self.deltas(states, event):
                if i in echo_pending:
                    echo_pending.discard(i)
                    yield echo_chunk(i)
                lp = None
                if req.logprobs is not None:
                    lp = self._logprobs(s, start, end, False, prompts[i // n], base[i])
                finished_count += finished
                usage = self.usage(states, n) if finished_count == len(states) else None
                yield chunk([{"index": i, "text": delta, "logprobs": lp,
                              "finish_reason": finish_reason_name(s.finished_reason)}], usage)
            if include_usage:
                yield chunk([], self.usage(states, n))
            yield SSE_DONE
        finally:
            self.tm.abort_states(states, "client disconnected")


class ChatOutputParser:
    """One choice's output split into thinking, content and tool calls, fed in pieces (the
    reasoning parser first, then the tool-call parser on what it leaves as content)."""

    def __init__(self, reasoning_parser: str | None, tool_call_parser: str | None,
                 tool_names: frozenset[str], parallel_tool_calls: bool) -> None:
        self._reasoning = ReasoningParser(reasoning_parser) if reasoning_parser else None
        self._calls = (FunctionCallParser(tool_call_parser, tool_names, parallel_tool_calls)
                       if tool_call_parser else None)

    def feed(self, text: str, finished: bool) -> tuple[str, str, list[ToolCall]]:
        """(thinking, content, calls) that `text` adds; `finished`: the output ended with it."""
        reasoning, content = ("", text) if self._reasoning is None else self._reasoning.feed(text)
        if finished and self._reasoning is not None:
            more_reasoning, more_content = self._reasoning.finish()
            reasoning, content = reasoning + more_reasoning, content + more_content
        calls: list[ToolCall] = []
        if self._calls is not None:
            content, calls = self._calls.feed(content)
            if finished:
                more_content, more_calls = self._calls.finish()
                content, calls = content + more_content, calls + more_calls
        return reasoning, content, calls


class OpenAIServingChat(OpenAIServingBase):
    """`POST /v1/chat/completions`; `tool_call_parser` and `reasoning_parser` are the server's
    (`ServerArgs`) parser names, None for none."""

    def __init__(self, tm: TokenizerManager, served_model_names: list[str],
                 tool_call_parser: str | None = None, reasoning_parser: str | None = None) -> None:
        super().__init__(tm, served_model_names)
        self.tool_call_parser = tool_call_parser
        self.reasoning_parser = reasoning_parser

    async def create(self, req: ChatCompletionRequest, raw_request: Request) -> Response:
        self.check_model(req.model)
        if req.top_logprobs is not None and not req.logprobs:
            raise invalid_request("'top_logprobs' requires 'logprobs' to be true", "top_logprobs",
                                  "invalid_value")
        if req.top_logprobs is not None:
            check_at_most(req.top_logprobs, self.tm.limits.max_top_logprobs, "top_logprobs")
        tools = self._tools(req)
        params = self.sampling_params(req, 1)
        forced = tools is not None and req.tool_choice not in (None, "auto")
        if forced:
            params = self._force_call(req, params, tools or [])
        async with self.tm.admission:
            prompt_ids = await self._apply_template(req, tools)
        tool_names = frozenset(t["function"]["name"] for t in tools or ())
        # A forced call is the whole output: there is no thinking to separate.
        reasoning_parser = self.reasoning_parser if req.separate_reasoning and not forced else None

        def output_parser() -> ChatOutputParser:
            return ChatOutputParser(reasoning_parser, self.tool_call_parser if tools else None,
                                    tool_names, req.parallel_tool_calls)
        max_new = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        max_param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        max_new = self.tm.resolve_max_new_tokens(len(prompt_ids), max_new, "messages", max_param)
        params = self._with_lengths(params, req, max_new, max_param)
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        if logprobs is not None:
            check_logprob_entries(req.n * max_new * (1 + logprobs), self.tm.limits.max_logprob_entries,
                                  "top_logprobs" if logprobs else "logprobs")
        owner = caller_of(raw_request).identity
        self._reserve_rid(req.rid, req.n, owner)
        prompts = [_Prompt(prompt_ids, None)]
        event = asyncio.Event()
        cid = f"chatcmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        if req.stream:
            return StreamingResponse(self._stream(req, prompts, params, logprobs, event, cid,
                                                  created, owner, output_parser),
                                     media_type="text/event-stream", headers=SSE_HEADERS)
        states = self.submit(prompts, params, req.n, event, req.rid, logprobs, owner)
        if not await self.wait_all(states, event, raw_request):
            return Response(status_code=499)

        def render() -> Response:
            choices = []
            for idx, s in enumerate(states):
                reasoning, content, calls = output_parser().feed(s.text, finished=True)
                message: dict[str, Any] = {"role": "assistant",
                                           "content": None if calls and not content else content,
                                           "refusal": None}
                if reasoning_parser is not None:
                    message["reasoning_content"] = reasoning or None
                if calls:
                    message["tool_calls"] = [call.to_openai() for call in calls]
                choices.append({
                    "index": idx,
                    "message": message,
                    "logprobs": ({"content": self._logprobs(s, 0, len(s.output_ids)),
                                  "refusal": None} if logprobs is not None else None),
                    "finish_reason": _chat_finish_reason(s, bool(calls)),
                })
            return large_json_response({
                "id": cid, "object": "chat.completion", "created": created,
                "model": self.model_name, "choices": choices,
                "usage": self.usage(states, len(states)),
                "system_fingerprint": None, "metadata": self.metadata(states),
            })

        return await rendered(render, logprobs is not None)

    def _tools(self, req: ChatCompletionRequest) -> list[dict[str, Any]] | None:
        """The `tools` to render and parse calls of (None: no tool calling), after checking them
        against `tool_choice` and the server's parser."""
        choice = req.tool_choice
        if not req.tools:
            if choice not in (None, "none"):
                raise invalid_request("'tool_choice' requires 'tools'", "tool_choice",
                                      "invalid_value")
            return None
        check_at_most(len(req.tools), self.tm.limits.max_tools, "tools", "tools")
        seen: set[str] = set()
        for k, tool in enumerate(req.tools):
            if tool.function.name in seen:
                raise invalid_request(f"'tools.{k}.function.name': '{tool.function.name}' is "
                                      "defined twice", f"tools.{k}.function.name", "invalid_value")
            seen.add(tool.function.name)
        if choice == "none":
            return None
        if isinstance(choice, NamedToolChoice) and choice.function.name not in seen:
            raise invalid_request(f"'tool_choice.function.name': no tool is named "
                                  f"'{choice.function.name}'", "tool_choice.function.name",
                                  "invalid_value")
        if self.tool_call_parser is None:
            raise invalid_request(
                "This server returns no tool calls: start it with --tool-call-parser NAME, or "
                "send tool_choice 'none' to leave the tools out", "tools", "unsupported_value")
        return [tool.model_dump(exclude_none=True) for tool in req.tools]

    def _force_call(self, req: ChatCompletionRequest, params: SamplingParams,
                    tools: list[dict[str, Any]]) -> SamplingParams:
        """`params` holding the output to one call (tool_choice 'required': of any tool; a named
        function: of that one) in the tool-call parser's format, through constrained decoding."""
        if params.constrained:
            raise invalid_request("a forced tool call ('tool_choice' required or a named function) "
                                  "cannot be combined with response_format, json_schema, regex or "
                                  "ebnf", "tool_choice", "invalid_value")
        assert self.tool_call_parser is not None  # `_tools` refused tools without a parser
        name = req.tool_choice.function.name if isinstance(req.tool_choice, NamedToolChoice) else None
        try:
            ebnf = forced_call_grammar(self.tool_call_parser, tools, name)
            return dataclasses.replace(params, ebnf=ebnf)
        except ValueError as e:
            raise invalid_request(f"'tool_choice' cannot be forced with these tools: {e}",
                                  "tool_choice", "invalid_value") from None

    async def _apply_template(self, req: ChatCompletionRequest,
                              tools: list[dict[str, Any]] | None) -> list[int]:
        """Render the chat template (with `tools`, when given) and tokenize, on a tokenizer
        thread, after bounding the messages' number and characters."""
        self.tm.require_tokenizer("messages")
        tok = self.tm.tokenizer
        if not getattr(tok, "chat_template", None):
            raise invalid_request("This model has no chat template; use /v1/completions",
                                  "messages", "chat_template_missing")
        check_at_most(len(req.messages), self.tm.limits.max_messages, "messages", "messages")
        chars = len(json.dumps(tools)) if tools else 0
        for m in req.messages:
            content = m.content
            chars += (len(content) if isinstance(content, str)
                      else sum(len(part.text) for part in content or ()))
            chars += len(m.reasoning_content or "")
            chars += sum(len(c.function.name) + len(c.function.arguments)
                         for c in m.tool_calls or ())
        self.tm.check_prompt_chars(chars, "messages")
        depth = self.tm.limits.max_json_depth
        messages = [_template_message(k, m, depth) for k, m in enumerate(req.messages)]
        kwargs = _template_variables(tok, req.chat_template_kwargs)
        if tools:
            kwargs["tools"] = tools

        def render() -> str:
            return tok.apply_chat_template(
                messages, tokenize=False,
                add_generation_prompt=req.add_generation_prompt and not req.continue_final_message,
                continue_final_message=req.continue_final_message, **kwargs,
            )

        try:
            text = await self.tm.run_in_tokenizer_pool(render)
        except Exception as e:  # noqa: BLE001 - jinja errors (bad role or order) are client input
            raise invalid_request(f"The chat template rejected 'messages': {e}", "messages",
                                  "invalid_value") from None
        ids = (await self.tm.tokenize([text], ["messages"], add_special_tokens=False))[0]
        if not ids:
            raise invalid_request("'messages' render to an empty prompt", "messages",
                                  "invalid_value")
        return ids

    def _logprobs(self, s: ReqState, start: int, end: int) -> list[dict[str, Any]]:
        out = []
        for k in range(start, min(end, len(s.output_token_logprobs))):
            tok = self.token_str(s.output_ids[k])
            top = []
            if s.top_logprobs_num > 0 and k < len(s.output_top_logprobs):
                top = [{"token": self.token_str(t), "logprob": lp, "bytes": self.token_bytes(t)}
                       for lp, t in s.output_top_logprobs[k]]
            out.append({"token": tok, "logprob": s.output_token_logprobs[k],
                        "bytes": self.token_bytes(s.output_ids[k]), "top_logprobs": top})
        return out

    async def _stream(self, req: ChatCompletionRequest, prompts: list[_Prompt],
                      params: SamplingParams, logprobs: int | None, event: asyncio.Event,
                      cid: str, created: int, owner: str,
                      output_parser: Callable[[], ChatOutputParser]) -> AsyncIterator[bytes]:
        try:
            states = self.submit(prompts, params, req.n, event, req.rid, logprobs, owner)
        except APIError as e:
            yield sse(e.body())
            return
        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        def chunk(choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> bytes:
            body: dict[str, Any] = {"id": cid, "object": "chat.completion.chunk",
                                    "created": created, "model": self.model_name,
                                    "choices": choices, "system_fingerprint": None}
            if usage is not None:
                body["usage"] = usage
            return sse(body)

        parsers = [output_parser() for _ in states]
        num_calls = [0] * len(states)
        try:
            for i in range(len(states)):
                yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""},
                              "logprobs": None, "finish_reason": None}])
            async for i, s, delta_text, start, end, finished in self.deltas(states, event):
                lp = None
                if logprobs is not None:
                    lp = {"content": self._logprobs(s, start, end), "refusal": None}
                reasoning, content, calls = parsers[i].feed(delta_text, finished)
                if not (finished or reasoning or content or calls or (lp and lp["content"])):
                    continue  # held back (bytes of a character, or what may be a tag): nothing yet
                delta: dict[str, Any] = {}
                if reasoning:
                    delta["reasoning_content"] = reasoning
                if content:
                    delta["content"] = content
                if calls:
                    delta["tool_calls"] = [call.to_openai(num_calls[i] + k)
                                           for k, call in enumerate(calls)]
                    num_calls[i] += len(calls)
                yield chunk([{"index": i, "delta": delta, "logprobs": lp,
                              "finish_reason": (_chat_finish_reason(s, num_calls[i] > 0)
                                                if finished else None)}])
            if include_usage:
                yield chunk([], self.usage(states, len(states)))
            yield SSE_DONE
        finally:
            self.tm.abort_states(states, "client disconnected")


def _chat_finish_reason(s: ReqState, called: bool) -> str | None:
    """OpenAI's chat finish reason: `tool_calls` when the output made calls and stopped by itself."""
    reason = finish_reason_name(s.finished_reason)
    return "tool_calls" if called and reason == "stop" else reason


def _template_message(k: int, m: Any, max_depth: int) -> dict[str, Any]:
    """`messages[k]` as chat templates take it: text parts joined, an earlier turn's call arguments
    as the objects they encode (templates write them with `tojson`; at most `max_depth` deep), the
    call id of a tool result."""
    for name in ("function_call", "audio"):
        if getattr(m, name) is not None:
            raise invalid_request(f"'messages.{k}.{name}' is not supported", f"messages.{k}.{name}",
                                  "unsupported_value")
    content = m.content
    if isinstance(content, list):
        content = "".join(part.text for part in content)
    if content is None:
        if m.role != "assistant":
            raise invalid_request(f"'messages.{k}.content' is required for role '{m.role}'",
                                  f"messages.{k}.content", "invalid_value")
        content = ""
    msg: dict[str, Any] = {"role": m.role, "content": content}
    if m.name is not None:
        msg["name"] = m.name
    if m.reasoning_content is not None:
        msg["reasoning_content"] = m.reasoning_content
    if m.tool_calls is not None:
        if m.role != "assistant":
            raise invalid_request(f"'messages.{k}.tool_calls' is only allowed for role "
                                  "'assistant'", f"messages.{k}.tool_calls", "invalid_value")
        msg["tool_calls"] = [
            {"id": c.id, "type": c.type, "function": {"name": c.function.name, "arguments": _arguments(
                c.function.arguments, f"messages.{k}.tool_calls.{j}.function.arguments", max_depth)}}
            for j, c in enumerate(m.tool_calls)]
    if m.role == "tool":
        if m.tool_call_id is None:
            raise invalid_request(f"'messages.{k}.tool_call_id' is required for role 'tool'",
                                  f"messages.{k}.tool_call_id", "invalid_value")
        msg["tool_call_id"] = m.tool_call_id
    return msg


def _arguments(text: str, param: str, max_depth: int) -> Any:
    """A call's arguments as the JSON object they encode (text that is not one stays text); a 400
    naming `param` if they nest deeper than `max_depth` or hold a lone surrogate (an escape)."""
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        value = None
    if not isinstance(value, dict):
        return text
    level: list[Any] = [value]
    depth = 0
    while level:
        depth += 1
        if depth > max_depth:
            raise invalid_request(f"'{param}' nests deeper than {max_depth}", param,
                                  "invalid_value")
        level = [v for c in level for v in (c.values() if isinstance(c, dict) else c)
                 if isinstance(v, (dict, list))]
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except ValueError:  # UnicodeEncodeError: a lone surrogate
        raise invalid_request(f"'{param}' holds a lone surrogate (not valid Unicode)", param,
                              "invalid_value") from None
    return value


_BYTE_FALLBACK = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


@functools.lru_cache(maxsize=1)
def _byte_level_table() -> dict[str, int]:
    """The byte-level BPE alphabet: printable bytes stand for themselves, the rest for 256 + k."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    table = {chr(b): b for b in printable}
    extra = 0
    for b in range(256):
        if b not in printable:
            table[chr(256 + extra)] = b
            extra += 1
    return table


def raw_token_bytes(tokenizer: Any, token_id: int) -> bytes | None:
    """Bytes of a byte-level BPE token or a SentencePiece byte-fallback token; None otherwise."""
    piece = tokenizer.convert_ids_to_tokens(token_id)
    if not isinstance(piece, str):
        return None
    m = _BYTE_FALLBACK.match(piece)
    if m:
        return bytes([int(m.group(1), 16)])
    table = _byte_level_table()
    if piece and all(c in table for c in piece):
        return bytes(table[c] for c in piece)
    return None


def models_response(names: list[str], model_path: str, context_len: int,
                    created: int) -> dict[str, Any]:
    return {
        "object": "list",
        "data": [
            {"id": name, "object": "model", "created": created, "owned_by": "tide",
             "root": model_path, "max_model_len": context_len}
            for name in names[:1]
        ],
    }


# Parameters of transformers' `apply_chat_template` (besides the conversation) that are not template
# variables: a client could otherwise render its own template (unbounded time and memory) or change
# what the call returns. Read from the tokenizer's signature too, for tokenizers that add more.
_TEMPLATE_CALL_PARAMS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
    "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs", "processor_kwargs",
})
MAX_TEMPLATE_VARIABLES = 64


def _call_params(tok: Any) -> frozenset[str]:
    try:
        sig = inspect.signature(tok.apply_chat_template)
    except (TypeError, ValueError, AttributeError):
        return _TEMPLATE_CALL_PARAMS
    named = {n for n, p in sig.parameters.items()
             if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL) and n != "self"}
    return _TEMPLATE_CALL_PARAMS | named


def _template_variables(tok: Any, given: dict[str, Any] | None) -> dict[str, Any]:
    """`chat_template_kwargs` as extra variables of the model's own template (e.g.
    `enable_thinking`): at most `MAX_TEMPLATE_VARIABLES`, none of them a parameter of the render
    call itself (400 naming `chat_template_kwargs.<key>`)."""
    given = dict(given or {})
    check_at_most(len(given), MAX_TEMPLATE_VARIABLES, "chat_template_kwargs", "keys")
    reserved = _call_params(tok)
    for key in given:
        if key in reserved:
            raise invalid_request(
                f"'chat_template_kwargs.{key}' is not accepted: chat_template_kwargs are variables "
                "of the model's chat template, not arguments of the render call",
                f"chat_template_kwargs.{key}", "invalid_value")
    return given


def _sequence_rids(rid: str, count: int) -> list[str]:
    """The rids of a request's `count` sequences: `rid` itself for one, `rid-i` for several."""
    return [rid] if count == 1 else [f"{rid}-{i}" for i in range(count)]
