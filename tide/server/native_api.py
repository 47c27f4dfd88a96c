"""sglang-compatible `POST /generate`: one item or a batch, by text or token ids, streamed or not.

Output per sequence (as sglang; no `text` when the server has no tokenizer, `--skip-tokenizer-init`):
`{"text", "output_ids", "meta_info": {"id", "finish_reason",
"prompt_tokens", "completion_tokens", "cached_tokens", "e2e_latency", "weight_version",
"output_token_logprobs", "output_top_logprobs"}}` (`weight_version`: the weights the tokens so far were
generated with; once finished, the version it finished with); logprob entries are
`[logprob, token_id, token_text_or_null]`. With `return_logprob` and `logprob_start_len` >= 0 (sglang's
names), `meta_info` also holds `input_token_logprobs` (prompt positions from `logprob_start_len` on;
position 0's logprob is null) and, with `top_logprobs_num`, `input_top_logprobs`: in the response, or
in a stream's last event only. A single item with `n == 1` returns one object, anything else
a list. Streaming sends `data: {...}` events whose `text`
and `output_ids` are cumulative (each event also has `index`, the sequence's place in the list), then
`data: [DONE]`.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import Response, StreamingResponse
from starlette.requests import Request

from tide.sampling_params import SamplingParams
from tide.server.auth import caller_of
from tide.server.errors import APIError, invalid_request
from tide.server.limits import check_at_most, check_logprob_entries
from tide.server.protocol import GenerateReqInput
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


@dataclasses.dataclass
class _Item:
    prompt_ids: list[int]
    params: SamplingParams
    rid: str | None
    return_logprob: bool
    top_logprobs_num: int
    logprob_start_len: int = -1


class NativeServing:
    """Implements `/generate` on top of the TokenizerManager."""

    def __init__(self, tm: TokenizerManager, incremental: bool = False) -> None:
        self.tm = tm
        # Stream events carry what a sequence added since the last event (sglang's
        # `incremental_streaming_output`), else all of it so far (sglang's default).
        self.incremental = incremental

    async def generate(self, req: GenerateReqInput, raw_request: Request) -> Response:
        owner = caller_of(raw_request).identity
        async with self.tm.admission:
            single, items = await self._normalize(req, owner)
        event = asyncio.Event()
        if req.stream:
            # Submitted inside the stream, so a client gone before it starts leaves nothing behind.
            return StreamingResponse(
                self._stream(items, event, req.return_text_in_logprobs, owner),
                media_type="text/event-stream", headers=SSE_HEADERS,
            )
        states = self._submit(items, event, owner)
        try:
            async with DisconnectWatch(raw_request, event) as watch:
                while not all(s.finished for s in states):
                    await self.tm.wait(event, watch)
        except ClientDisconnected:
            return Response(status_code=499)
        finally:
            self.tm.abort_states(states, "client disconnected")

        def render() -> Response:
            outs = [self._output(s, req.return_text_in_logprobs) for s in states]
            return large_json_response(outs[0] if single and len(outs) == 1 else outs)

        return await rendered(render, any(s.return_logprob for s in states))

    def _submit(self, items: list[_Item], event: asyncio.Event, owner: str) -> list[ReqState]:
        """Every sequence to the scheduler; the rids' reservations (`_normalize`) end here."""
        states: list[ReqState] = []
        try:
            for item in items:
                base = item.rid or self.tm.new_rid()
                n = item.params.n
                for j in range(n):
                    seed = item.params.seed
                    params = dataclasses.replace(
                        item.params, n=1, seed=None if seed is None else (seed + j) % 2**63
                    )
                    states.append(self.tm.submit(
                        item.prompt_ids, params, event,
                        rid=base if n == 1 else f"{base}-{j}", user_rid=item.rid,
                        return_logprob=item.return_logprob,
                        top_logprobs_num=item.top_logprobs_num, owner=owner,
                        logprob_start_len=item.logprob_start_len,
                    ))
        except BaseException:
            self.tm.abort_states(states, "request failed")
            raise
        finally:
            self.tm.release_rids([(owner, r) for r in _expanded_rids(items)])
        return states

    async def _stream(self, items: list[_Item], event: asyncio.Event,
                      text_in_logprobs: bool, owner: str) -> AsyncIterator[bytes]:
        try:
            states = self._submit(items, event, owner)
        except APIError as e:
            yield sse(e.body())
            return
        reported = [(0, False)] * len(states)  # (tokens, finished) last sent per sequence
        sent_text = [0] * len(states)  # characters of text sent (incremental streams)
        try:
            while True:
                all_finished = all(s.finished for s in states)  # before the scan: none is missed
                for i, s in enumerate(states):
                    mark = (len(s.output_ids), s.finished)
                    if mark != reported[i]:
                        start = reported[i][0] if self.incremental else 0
                        reported[i] = mark
                        out = self._output(s, text_in_logprobs, start, sent_text[i])
                        if self.incremental:
                            sent_text[i] += len(out.get("text", ""))
                        out["index"] = i
                        yield sse(out)
                if all_finished:
                    break
                await self.tm.wait(event)
            yield SSE_DONE
        finally:
            self.tm.abort_states(states, "client disconnected")

    # ---- input
    async def _normalize(self, req: GenerateReqInput, owner: str) -> tuple[bool, list[_Item]]:
        """Validate the whole request (counts and sampling parameters before any text is
        tokenized), then tokenize; one item per prompt."""
        tm = self.tm
        limits = tm.limits
        if (req.text is None) == (req.input_ids is None):
            raise invalid_request("Exactly one of 'text' or 'input_ids' must be given", "text",
                                  "invalid_value")
        if req.text is not None:
            tm.require_tokenizer("text")
            single = isinstance(req.text, str)
            texts = [req.text] if isinstance(req.text, str) else req.text
            if not texts:
                raise invalid_request("'text' must not be an empty list", "text", "invalid_value")
            count = len(texts)
            prompt_param = "text"
        else:
            ids = req.input_ids
            assert ids is not None
            if not ids:
                raise invalid_request("'input_ids' must not be empty", "input_ids", "invalid_value")
            single = not isinstance(ids[0], list)
            count = 1 if single else len(ids)
            prompt_param = "input_ids"
        check_at_most(count, limits.max_batch_size, prompt_param, "prompts")
        sp_list = _per_item(req.sampling_params, count, "sampling_params", single)
        rids = _per_item(req.rid, count, "rid", single, repeat=False)
        lp_flags = _per_item(req.return_logprob, count, "return_logprob", single)
        tops = _per_item(req.top_logprobs_num, count, "top_logprobs_num", single)
        starts = _per_item(req.logprob_start_len, count, "logprob_start_len", single)
        params_list: list[SamplingParams] = []
        for k in range(count):
            sfx = "" if single else f".{k}"
            params_list.append(make_sampling_params(
                sp_list[k], "sampling_params" + sfx, limits=limits,
                vocab_size=tm.model_info.vocab_size))
            if tops[k] < 0 or tops[k] > limits.max_top_logprobs_num:
                raise invalid_request(
                    f"'top_logprobs_num' must be in [0, {limits.max_top_logprobs_num}]",
                    "top_logprobs_num" + sfx, "invalid_value")
        check_at_most(sum(p.n for p in params_list), limits.max_batch_size, "sampling_params",
                      f"sequences in all ({count} prompts x n)")
        prompts: list[list[int]]
        if req.text is not None:
            names = ["text" if single else f"text.{k}" for k in range(count)]
            for t, name in zip(texts, names):
                if not t:
                    raise invalid_request(f"'{name}' must not be empty", name, "invalid_value")
            prompts = await tm.tokenize(texts, names)
        else:
            prompts = [ids] if single else ids  # type: ignore[list-item,assignment]
            for k, p in enumerate(prompts):
                tm.check_input_ids(p, "input_ids" if single else f"input_ids.{k}")
        items: list[_Item] = []
        entries = 0
        for k, ids in enumerate(prompts):
            sfx = "" if single else f".{k}"
            params = params_list[k]
            if params.stop_strs:
                tm.require_tokenizer(f"sampling_params{sfx}.stop")
            budget = tm.resolve_max_new_tokens(len(ids), params.max_new_tokens, prompt_param + sfx,
                                               f"sampling_params{sfx}.max_new_tokens")
            if lp_flags[k] or tops[k] > 0:
                # A cumulative stream's every event carries the logprobs so far (sglang's
                # default): up to budget * (budget + 1) / 2 entries a sequence in all.
                cumulative = req.stream and not self.incremental
                written = budget * (budget + 1) // 2 if cumulative else budget
                entries += params.n * written * (1 + int(tops[k]))
            start = starts[k]
            if start < -1:
                raise invalid_request("'logprob_start_len' must be >= -1 (-1: no input logprobs)",
                                      "logprob_start_len" + sfx, "invalid_value")
            if (lp_flags[k] or tops[k] > 0) and 0 <= start < len(ids):
                # Input logprobs: once a sequence, in its last stream event or its response.
                entries += params.n * (len(ids) - start) * (1 + int(tops[k]))
            else:
                start = -1  # none asked for (a start past the prompt need not fit the wire)
            items.append(_Item(list(ids), params, rids[k], bool(lp_flags[k]), int(tops[k]),
                               start))
        check_logprob_entries(entries, limits.max_logprob_entries,
                              "top_logprobs_num" if any(t > 0 for t in tops) else "return_logprob")
        user_rids = [it.rid for it in items if it.rid is not None]
        if len(set(user_rids)) != len(user_rids):
            raise invalid_request("'rid' values must be unique", "rid", "duplicate_rid")
        expanded = _expanded_rids(items)
        if len(set(expanded)) != len(expanded):  # e.g. "x" with n=2 beside "x-0"
            raise invalid_request("'rid' values must be unique once each is expanded to "
                                  "'<rid>-<i>' for its n sequences", "rid", "duplicate_rid")
        tm.check_rids_free(expanded, owner, reserve=True)  # until `_submit`
        return single, items

    # ---- output
    def _output(self, s: ReqState, text_in_logprobs: bool, start: int = 0,
                text_start: int = 0) -> dict[str, Any]:
        """sglang's output of sequence `s`: its text, output ids and logprobs from output token
        `start` and text character `text_start` on (both 0: everything so far); the counts in
        `meta_info` are always the whole sequence's."""
        meta: dict[str, Any] = {
            "id": s.rid,
            "finish_reason": s.finished_reason,
            "prompt_tokens": len(s.prompt_ids),
            "completion_tokens": len(s.output_ids),
            "cached_tokens": s.cached_tokens,
            "e2e_latency": s.e2e_latency,
            "weight_version": s.weight_version if s.weight_version is not None
            else self.tm.weight_version,
        }
        if s.return_logprob:
            texts: dict[int, str | None] = {}  # the top logprobs repeat tokens: decode each once

            def decode(t: int) -> str | None:
                if not text_in_logprobs:
                    return None
                if t not in texts:
                    texts[t] = self._token_text(t)
                return texts[t]

            meta["output_token_logprobs"] = [
                [lp, t, decode(t)] for lp, t in zip(s.output_token_logprobs[start:],
                                                    s.output_ids[start:], strict=False)
            ]
            if s.top_logprobs_num > 0:
                meta["output_top_logprobs"] = [
                    [[lp, t, decode(t)] for lp, t in row] for row in s.output_top_logprobs[start:]
                ]
            if s.finished and s.input_token_logprobs:  # once: the response, or a stream's end
                first = s.logprob_start_len
                meta["input_token_logprobs"] = [
                    [lp, t, decode(t)] for lp, t in zip(s.input_token_logprobs,
                                                        s.prompt_ids[first:], strict=False)
                ]
                if s.top_logprobs_num > 0:
                    meta["input_top_logprobs"] = [
                        None if row is None else [[lp, t, decode(t)] for lp, t in row]
                        for row in s.input_top_logprobs
                    ]
        if self.tm.tokenizer is None:  # as sglang with skip_tokenizer_init: ids, no text
            return {"output_ids": s.output_ids[start:], "meta_info": meta}
        return {"text": s.text[text_start:], "output_ids": s.output_ids[start:], "meta_info": meta}

    def _token_text(self, token_id: int) -> str | None:
        tok = self.tm.tokenizer
        return tok.decode([token_id]) if tok is not None else None


def _per_item(value: Any, count: int, name: str, single: bool, repeat: bool = True) -> list[Any]:
    """Spread a scalar over the batch, or check a per-item list has one entry per prompt."""
    if isinstance(value, list):
        if single:
            raise invalid_request(f"'{name}' must be a single value for a single prompt", name,
                                  "invalid_type")
        if len(value) != count:
            raise invalid_request(
                f"'{name}' has {len(value)} entries but there are {count} prompts", name,
                "invalid_value")
        return list(value)
    if not repeat and value is not None and not single:
        raise invalid_request(f"'{name}' must be a list with one entry per prompt for a batch",
                              name, "invalid_type")
    return [value] * count


def _expanded_rids(items: list[_Item]) -> list[str]:
    """The client rids of every sequence: `rid`, or `rid-j` for an item with n > 1."""
    return [r if it.params.n == 1 else f"{r}-{j}"
            for it in items if (r := it.rid) is not None for j in range(it.params.n)]
