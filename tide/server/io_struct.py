"""Messages between the HTTP process (TokenizerManager) and the scheduler process.

Everything on the wire is a `msgspec.Struct` tagged with its class name and encoded with msgpack, so
both sides decode into typed objects (`decode_message`) and an unknown message is an error, not a
silent `dict`. Names follow sglang (`TokenizedGenerateReqInput`, `BatchTokenIDOut`, `AbortReq`, ...).

Control messages (flush, info, load, shutdown) carry a `req_id`; the scheduler answers each with one
`ControlReqOutput` bearing the same `req_id`, so the HTTP side can match replies to callers.
"""

from __future__ import annotations

from typing import Any, Union

import msgspec


class TokenizedGenerateReqInput(msgspec.Struct, tag=True):
    """One generation request, already tokenized and validated (n == 1; the HTTP side expands n)."""

    rid: str
    input_ids: list[int]
    sampling_params: dict[str, Any]
    return_logprob: bool = False
    top_logprobs_num: int = 0


class AbortReq(msgspec.Struct, tag=True):
    """Abort the requests `rids` (or every request with `abort_all`); they are reported finished
    with reason abort. With a `req_id`, the scheduler also replies (`data["num_aborted"]`) after
    those outputs, so the caller knows the aborts have landed."""

    rids: list[str] = []
    abort_all: bool = False
    message: str = "aborted"
    req_id: str | None = None


class FlushCacheReqInput(msgspec.Struct, tag=True):
    """Reset radix cache, request slots and KV allocator once idle, waiting up to `timeout` seconds."""

    req_id: str
    timeout: float = 0.0


class GetLoadReqInput(msgspec.Struct, tag=True):
    """Ask for the scheduler's live counters (queue, running, KV slots, token totals)."""

    req_id: str


class GetServerInfoReqInput(msgspec.Struct, tag=True):
    """Ask for the scheduler's static facts plus its live counters."""

    req_id: str


class ShutdownReq(msgspec.Struct, tag=True):
    """Abort everything, reply, and leave the loop."""

    req_id: str


class BatchTokenIDOut(msgspec.Struct, tag=True):
    """Incremental outputs of one scheduler step: for each request that got tokens, the new ids.

    All lists are parallel to `rids`. Logprob lists are empty for requests that did not ask for them;
    `finished_reasons[i]` is None while request i is running.
    """

    rids: list[str]
    new_token_ids: list[list[int]]
    new_token_logprobs: list[list[float]]
    new_top_logprobs: list[list[list[tuple[float, int]]]]
    finished_reasons: list[dict[str, Any] | None]
    cached_tokens: list[int]


class ControlReqOutput(msgspec.Struct, tag=True):
    """Reply to a control message."""

    req_id: str
    success: bool
    message: str = ""
    data: dict[str, Any] = {}


class SchedulerReady(msgspec.Struct, tag=True):
    """Sent once (over the start-up pipe) when the model is loaded, or with `error` when it failed."""

    error: str | None = None
    info: dict[str, Any] = {}


SchedulerInput = Union[
    TokenizedGenerateReqInput,
    AbortReq,
    FlushCacheReqInput,
    GetLoadReqInput,
    GetServerInfoReqInput,
    ShutdownReq,
]
SchedulerOutput = Union[BatchTokenIDOut, ControlReqOutput]

_encoder = msgspec.msgpack.Encoder()
_input_decoder = msgspec.msgpack.Decoder(SchedulerInput)
_output_decoder = msgspec.msgpack.Decoder(SchedulerOutput)


def encode_message(msg: msgspec.Struct) -> bytes:
    return _encoder.encode(msg)


def decode_input(data: bytes) -> SchedulerInput:
    return _input_decoder.decode(data)


def decode_output(data: bytes) -> SchedulerOutput:
    return _output_decoder.decode(data)
