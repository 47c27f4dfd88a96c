"""The HTTP process's side of the engine: tokenize, submit, track, detokenize, abort.

`TokenizerManager` owns the zmq channel to the scheduler process. Routes tokenize and validate their
input, then `submit` one `ReqState` per sequence (n > 1 and batches are several states sharing one
`asyncio.Event`); the receive loop applies each `BatchTokenIDOut` to the states, runs incremental
detokenization (never showing text past a stop string, or a tail that may start one), finishes
requests when the scheduler does (stop strings included: it finds them) and sets the event.
Consumers read whatever is new since their last look, so a slow client sees tokens coalesced rather
than a growing queue.

Control calls (flush, load, info, and the admin calls: weight updates, pause/continue, versions) get a
`req_id` and await the scheduler's `ControlReqOutput` with the same id.

Rid scoping: every state has an `owner` (the caller's identity, `tide.server.auth`); a client rid lives
in its owner's scope, so the same rid from two identities names two independent requests, duplicate
checks look only at the caller's own requests, and an abort by rid reaches only them (an admin abort
reaches every scope). Rids the server makes are random (128 bits), so nobody can guess them.

Liveness: a watchdog fails everything when the scheduler process dies, and, when it lives but stops
responding (`SchedulerLiveness`), refuses new work after `health_timeout` seconds and aborts in-flight
requests (and pending control calls) after `abort_timeout` seconds; it recovers if the scheduler
comes back.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import secrets
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from tide.detokenizer import IncrementalDetokenizer
from tide.grammar import grammar_of
from tide.io_struct import (
    AbortReq,
    BatchTokenIDOut,
    ControlReqOutput,
    FlushCacheReqInput,
    GetLoadReqInput,
    GetServerInfoReqInput,
    SchedulerHeartbeat,
    ShutdownReq,
    TokenizedGenerateReqInput,
    decode_output,
    encode_message,
)
from tide.sampling_params import SamplingParams
from tide.server.auth import INTERNAL
from tide.server.errors import APIError, invalid_request
from tide.server.limits import RequestLimits
from tide.server.liveness import SchedulerLiveness
from tide.server.metrics import ServerMetrics

logger = logging.getLogger("tide.server")

ADMISSION_CONCURRENCY = 16  # generation requests being admitted at once
# How long a checked rid stays reserved for the request that will submit it (a stream submits once
# its response starts; one whose client left before that never does).
RID_RESERVATION_S = 60.0

_NEG_INF_LOGPROB = -9999.0  # JSON has no -inf


@dataclass
class ModelInfo:
    """Facts about the served model, reported by the scheduler process when it is ready."""

    model_path: str
    context_len: int
    max_total_tokens: int
    vocab_size: int
    eos_token_ids: list[int]
    raw: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_ready(cls, info: dict[str, Any]) -> ModelInfo:
        return cls(
            model_path=info["model_path"],
            context_len=int(info["context_length"]),
            max_total_tokens=int(info["max_total_tokens"]),
            vocab_size=int(info["vocab_size"]),
            eos_token_ids=list(info["eos_token_ids"]),
            raw=dict(info),
        )


class ReqState:
    """What the HTTP side knows about one in-flight sequence (n == 1)."""

    def __init__(
        self,
        owner: str,
        rid: str,
        user_rid: str | None,
        wire_rid: str,
        prompt_ids: list[int],
        params: SamplingParams,
        return_logprob: bool,
        top_logprobs_num: int,
        detok: IncrementalDetokenizer | None,
        event: asyncio.Event,
        logprob_start_len: int = -1,
    ) -> None:
        self.owner = owner  # the identity whose scope `rid` lives in
        self.rid = rid
        self.user_rid = user_rid
        self.wire_rid = wire_rid
        self.prompt_ids = prompt_ids
        self.params = params
        self.return_logprob = return_logprob or top_logprobs_num > 0
        self.top_logprobs_num = top_logprobs_num
        self.detok = detok
        self.event = event
        self.output_ids: list[int] = []
        self.output_token_logprobs: list[float] = []
        self.output_top_logprobs: list[list[tuple[float, int]]] = []
        # Input logprobs of prompt positions logprob_start_len.. (None for position 0), once the
        # prompt is prefilled.
        self.logprob_start_len = logprob_start_len
        self.input_token_logprobs: list[float | None] = []
        self.input_top_logprobs: list[list[tuple[float, int]] | None] = []
        # Text length of output_ids[:k] for each k computed so far (completions' text_offset).
        self.text_offsets: list[int] = []
        self.finished_reason: dict[str, Any] | None = None
        self.cached_tokens = 0
        self.weight_version: str | None = None  # of the tokens so far (of the finish, once finished)
        self.created = time.perf_counter()
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        self.finished_time: float | None = None

    @property
    def finished(self) -> bool:
        return self.finished_reason is not None

    @property
    def text(self) -> str:
        return self.detok.visible_text if self.detok is not None else ""

    @property
    def e2e_latency(self) -> float:
        end = self.finished_time if self.finished_time is not None else time.perf_counter()
        return end - self.created


class ClientDisconnected(Exception):
    """The HTTP client went away; its requests were aborted."""


class DisconnectWatch:
    """Listens for the client's `http.disconnect` while a non-streaming request waits, and wakes
    the waiter through the group's event. (Streaming responses are cancelled by Starlette.)"""

    def __init__(self, raw_request: Any, event: asyncio.Event) -> None:
        self.gone = False
        self._receive = raw_request.receive
        self._event = event
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> DisconnectWatch:
        self._task = asyncio.create_task(self._listen())
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._task is not None:
            self._task.cancel()

    async def _listen(self) -> None:
        await client_gone(self._receive)
        self.gone = True
        self._event.set()


async def client_gone(receive: Any) -> None:
    """Returns when the ASGI `receive` channel reports the client's disconnect (once the body has
    been read, that is all it still reports)."""
    while (await receive())["type"] != "http.disconnect":
        pass


class TokenizerManager:
    """Tokenizes, submits and tracks requests; talks to the scheduler process over zmq."""

    def __init__(
        self,
        tokenizer: Any,
        model_info: ModelInfo,
        input_addr: str,
        output_addr: str,
        metrics: ServerMetrics,
        scheduler_alive: Callable[[], bool] = lambda: True,
        limits: RequestLimits | None = None,
        health_timeout: float = 30.0,
        abort_timeout: float = 120.0,
    ) -> None:
        self.tokenizer = tokenizer
        self.model_info = model_info
        self.limits = limits or RequestLimits()
        # Tokenizing (and rendering chat templates) runs here, off the event loop: a long prompt
        # never stalls other clients. The tokenizer releases the GIL while it works.
        self._tokenize_pool = ThreadPoolExecutor(self.limits.tokenizer_threads,
                                                 thread_name_prefix="tide-tokenize")
        # Held while a generation request is validated, tokenized and submitted. A burst of
        # thousands of requests is admitted a slice at a time, so the event loop keeps answering
        # /health and streaming between slices instead of validating them all in one go.
        self.admission = asyncio.Semaphore(ADMISSION_CONCURRENCY)
        self.input_addr = input_addr
        self.output_addr = output_addr
        self.metrics = metrics
        self.scheduler_alive = scheduler_alive
        self.health_timeout = health_timeout
        self.abort_timeout = abort_timeout
        self.liveness = SchedulerLiveness()
        self._stall_reported = False
        # by (owner, the rid the client sees): rids are scoped to the caller's identity
        self.rid_to_state: dict[tuple[str, str], ReqState] = {}
        # (owner, rid) -> deadline: rids a request has checked and will submit (a stream submits
        # once its response starts), so a concurrent request cannot take them meanwhile.
        self._reserved: dict[tuple[str, str], float] = {}
        self.wire_to_state: dict[str, ReqState] = {}  # by the scheduler's (never reused) rid
        self._wire_seq = 0
        self._pending_control: dict[str, asyncio.Future[ControlReqOutput]] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._last_load: dict[str, Any] | None = None
        self._last_info: dict[str, Any] | None = None
        # Last known scheduler state, from replies and outputs (for routes that must not wait).
        self.weight_version: str | None = model_info.raw.get("weight_version")
        self.paused: str | None = None
        self.on_fatal: Callable[[], None] = lambda: None
        self.dead = False
        self.shutting_down = False

    # ---- lifecycle
    async def start(self) -> None:
        """Open the sockets and start the receive loop and the scheduler watchdog (in the loop)."""
        self._actx = zmq.asyncio.Context()
        self._recv_sock = self._actx.socket(zmq.PULL)
        self._recv_sock.setsockopt(zmq.RCVHWM, 0)
        self._recv_sock.bind(self.output_addr)
        self._sctx = zmq.Context()
        self._send_sock = self._sctx.socket(zmq.PUSH)
        self._send_sock.setsockopt(zmq.SNDHWM, 0)
        self._send_sock.setsockopt(zmq.LINGER, 2000)
        self._send_sock.connect(self.input_addr)
        self.liveness = SchedulerLiveness()
        self._tasks = [
            asyncio.create_task(self._handle_loop()),
            asyncio.create_task(self._watchdog()),
        ]

    async def stop(self, timeout: float = 5.0) -> None:
        """Abort everything, ask the scheduler to stop, and close the sockets."""
        self.shutting_down = True
        self.abort_all_local("server shutting down")
        if not self.dead:
            try:
                await self._control(lambda req_id: ShutdownReq(req_id=req_id), timeout)
            except (TimeoutError, APIError):
                logger.warning("scheduler did not acknowledge shutdown in %.0f s", timeout)
        for task in self._tasks:
            task.cancel()
        self._recv_sock.close(linger=0)
        self._send_sock.close(linger=500)
        self._actx.term()
        self._sctx.term()
        self._tokenize_pool.shutdown(wait=False, cancel_futures=True)

    # ---- tokenization and validation
    def require_tokenizer(self, param: str) -> None:
        """A 400 naming `param` (a text input, stop strings) when this server has no tokenizer."""
        if self.tokenizer is None:
            raise invalid_request(
                f"'{param}' needs a tokenizer, and this server runs without one "
                "(--skip-tokenizer-init): send token ids ('input_ids', or a prompt of ids) and "
                "stop_token_ids instead", param, "tokenizer_missing")

    def check_grammar_served(self, params: SamplingParams) -> None:
        """A 400 naming the grammar field when this server cannot constrain outputs (no
        tokenizer, `--grammar-backend none`, or no xgrammar in the scheduler's environment)."""
        spec = grammar_of(params)
        if spec is None:
            return
        self.require_tokenizer(spec[0])
        if self.model_info.raw.get("grammar_backend", "none") == "none":
            raise invalid_request(
                f"'{spec[0]}' needs constrained decoding, which this server runs without "
                "(--grammar-backend none, or the xgrammar package is not installed)", spec[0],
                "unsupported_value")

    def check_prompt_chars(self, length: int, param: str) -> None:
        """A 400 (`context_length_exceeded`) for a text too long to fit the context whatever its
        tokens; checked before anything tokenizes it."""
        limit = self.limits.max_prompt_chars(self.model_info.context_len)
        if length > limit:
            raise APIError(
                f"'{param}' has {length} characters; this model's context of "
                f"{self.model_info.context_len} tokens holds at most {limit} "
                f"({self.limits.prompt_chars_per_token} per token). Shorten '{param}'.",
                400, param=param, code="context_length_exceeded")

    async def tokenize(self, texts: Sequence[str], params: Sequence[str],
                       add_special_tokens: bool = True) -> list[list[int]]:
        """Token ids of each text, tokenized in the tokenizer pool after each text's length has
        been checked (`params` names each text for errors)."""
        if self.tokenizer is None:
            raise invalid_request("this model has no tokenizer; send token ids instead", params[0])
        for text, param in zip(texts, params, strict=True):
            self.check_prompt_chars(len(text), param)
        return await self.run_in_tokenizer_pool(self._encode_all, list(texts), add_special_tokens)

    async def run_in_tokenizer_pool(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run `fn(*args)` on a tokenizer thread (CPU-heavy work that must not block the loop)."""
        return await asyncio.get_running_loop().run_in_executor(self._tokenize_pool, fn, *args)

    def _encode_all(self, texts: list[str], add_special_tokens: bool) -> list[list[int]]:
        return [list(self.tokenizer.encode(t, add_special_tokens=add_special_tokens))
                for t in texts]

    def check_input_ids(self, ids: list[int], param: str) -> None:
        if not ids:
            raise invalid_request(f"'{param}' must not be empty", param, "invalid_value")
        vocab = self.model_info.vocab_size
        low, high = min(ids), max(ids)
        if low < 0 or high >= vocab:
            bad = low if low < 0 else high
            raise invalid_request(
                f"'{param}' contains token id {_short_int(bad)}, outside the vocabulary "
                f"[0, {vocab})", param, "invalid_value",
            )

    @property
    def max_seq_len(self) -> int:
        """Longest prompt + output a request may have (context length, bounded by the KV pool)."""
        return min(self.model_info.context_len, self.model_info.max_total_tokens)

    def resolve_max_new_tokens(self, prompt_len: int, requested: int | None, prompt_param: str,
                               max_param: str) -> int:
        """The output budget of a prompt: `requested`, or all the room left when None. A 400
        (`context_length_exceeded`) names the prompt when it leaves no room, else `max_param`."""
        limit = self.max_seq_len
        if requested is not None and prompt_len + requested <= limit:
            return requested
        if prompt_len >= limit:
            raise APIError(
                f"This model's maximum context length is {limit} tokens, but the prompt has "
                f"{prompt_len} tokens. Shorten '{prompt_param}'.",
                400, param=prompt_param, code="context_length_exceeded",
            )
        if requested is None:
            return limit - prompt_len
        raise APIError(
            f"This model's maximum context length is {limit} tokens; the prompt has "
            f"{prompt_len} tokens and '{max_param}' asks for {requested} more "
            f"({prompt_len + requested} in all). Lower '{max_param}' or the prompt.",
            400, param=max_param, code="context_length_exceeded",
        )

    # ---- requests
    def new_rid(self) -> str:
        """A server-made rid: 128 random bits, so nobody can guess another's request id."""
        return secrets.token_hex(16)

    def submit(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        event: asyncio.Event,
        rid: str | None = None,
        user_rid: str | None = None,
        return_logprob: bool = False,
        top_logprobs_num: int = 0,
        owner: str = INTERNAL.identity,
        logprob_start_len: int = -1,
    ) -> ReqState:
        """Send one sequence (params.n must be 1) to the scheduler and start tracking it under
        `owner`'s scope (the caller's identity)."""
        self._check_serving()
        self.check_grammar_served(params)
        try:
            params.check_endings(self.model_info.vocab_size, self.model_info.eos_token_ids)
        except ValueError as e:
            raise invalid_request(str(e), "min_new_tokens", "invalid_value") from None
        rid = rid or self.new_rid()
        if (owner, rid) in self.rid_to_state:
            raise invalid_request(f"rid {rid!r} is already in use by a running request", "rid",
                                  "duplicate_rid")
        detok = None
        if self.tokenizer is not None:
            detok = IncrementalDetokenizer(
                self.tokenizer, prompt_ids, params.skip_special_tokens, params.stop_strs,
                min_new_tokens=params.min_new_tokens, keep_stop=params.no_stop_trim,
                spaces_between_special_tokens=params.spaces_between_special_tokens,
            )
        # The scheduler sees a fresh id, so a late output for an earlier request that used the same
        # client rid can never land on this one.
        self._wire_seq += 1
        wire_rid = f"{rid}@{self._wire_seq}"
        state = ReqState(owner, rid, user_rid, wire_rid, prompt_ids, params, return_logprob,
                         top_logprobs_num, detok, event, logprob_start_len)
        wire_params = {f.name: getattr(params, f.name) for f in dataclasses.fields(params) if f.init}
        wire_params["n"] = 1
        # Encoded before the state is registered: a message that cannot be encoded (or sent)
        # leaves nothing behind.
        data = encode_message(
            TokenizedGenerateReqInput(
                rid=wire_rid,
                input_ids=prompt_ids,
                sampling_params=wire_params,
                return_logprob=state.return_logprob,
                top_logprobs_num=top_logprobs_num,
                logprob_start_len=logprob_start_len,
            )
        )
        self._send_sock.send(data)
        self.rid_to_state[(owner, rid)] = state
        self.wire_to_state[wire_rid] = state
        return state

    def check_rids_free(self, rids: list[str], owner: str, param: str = "rid",
                        reserve: bool = False) -> list[tuple[str, str]]:
        """400 `duplicate_rid` if one of `rids` names a running request of `owner`'s, or one another
        request reserved. With `reserve`, holds them (at most `RID_RESERVATION_S`) until the
        caller submits and passes the returned keys to `release_rids`."""
        now = time.monotonic()
        if len(self._reserved) > 1024:
            self._reserved = {k: d for k, d in self._reserved.items() if d > now}
        for rid in rids:
            if (owner, rid) in self.rid_to_state or self._reserved.get((owner, rid), 0.0) > now:
                raise invalid_request(f"rid {rid!r} is already in use by a running request",
                                      param, "duplicate_rid")
        if not reserve:
            return []
        keys = [(owner, rid) for rid in rids]
        for key in keys:
            self._reserved[key] = now + RID_RESERVATION_S
        return keys

    def release_rids(self, keys: list[tuple[str, str]]) -> None:
        """Drop reservations of `check_rids_free` (once submitted, the running requests hold the
        rids; if submitting failed, they are free again)."""
        for key in keys:
            self._reserved.pop(key, None)

    async def wait(self, event: asyncio.Event, watch: DisconnectWatch | None = None) -> None:
        """Wait for any update of the group behind `event`; raise ClientDisconnected if `watch`
        saw the client leave."""
        await event.wait()
        event.clear()
        if watch is not None and watch.gone:
            raise ClientDisconnected()

    def abort_states(self, states: list[ReqState], message: str) -> None:
        """Finish unfinished `states` now (their consumer is gone) and abort them in the scheduler."""
        live = [s for s in states if not s.finished and s.wire_rid in self.wire_to_state]
        if not live:
            return
        self._send(AbortReq(rids=[s.wire_rid for s in live], message=message))
        for state in live:
            self._finish(state, {"type": "abort", "message": message})

    async def abort_request(self, rid: str | None, owner: str | None = None,
                            message: str = "aborted by request") -> int:
        """Abort live requests of `owner` (None: of anyone) whose rid (or the rid the client gave
        to their group) is `rid`, or all requests if `rid` is None. Returns once the scheduler has
        finished them (their streams end with reason abort), with how many it aborted. Another
        owner's request is not found, exactly as a rid that names nothing."""
        rids: list[str] = []
        if rid is not None:
            rids = [s.wire_rid for s in self.wire_to_state.values()
                    if rid in (s.rid, s.user_rid) and owner in (None, s.owner)]
            if not rids:
                return 0
        out = await self._control(
            lambda req_id: AbortReq(rids=rids, abort_all=rid is None, message=message, req_id=req_id),
            30.0,
        )
        return int(out.data.get("num_aborted", 0))

    def abort_all_local(self, message: str) -> None:
        """Finish every live request now (shutdown, dead scheduler) and tell the scheduler."""
        if not self.dead:
            try:
                self._send(AbortReq(abort_all=True, message=message))
            except zmq.ZMQError:
                pass
        for state in list(self.wire_to_state.values()):
            self._finish(state, {"type": "abort", "message": message})

    # ---- control
    async def flush_cache(self, timeout: float = 0.0) -> tuple[bool, str]:
        out = await self._control(lambda r: FlushCacheReqInput(req_id=r, timeout=timeout),
                                  timeout + 10.0)
        return out.success, out.message

    async def get_load(self, timeout: float = 5.0) -> dict[str, Any]:
        """Live scheduler counters; the last known ones if the scheduler does not answer in time."""
        try:
            out = await self._control(lambda r: GetLoadReqInput(req_id=r), timeout)
            self._last_load = dict(out.data)
            self._note_state(out.data)
        except (TimeoutError, APIError):
            if self._last_load is None:
                raise
        assert self._last_load is not None
        return self._last_load

    async def get_server_info(self, timeout: float = 5.0) -> dict[str, Any]:
        """The scheduler's facts and live counters, plus `scheduler_responsive` and
        `scheduler_liveness`. While the scheduler does not respond: the last known ones."""
        if self.responsive:
            out = await self._control(lambda r: GetServerInfoReqInput(req_id=r), timeout)
            info = dict(out.data)
            self._last_info = dict(info)
        else:
            self._check_alive()
            info = dict(self._last_info or self.model_info.raw)
        info["scheduler_responsive"] = self.responsive
        info["scheduler_liveness"] = self.liveness.describe()
        return info

    async def admin(self, make: Callable[[str], msgspec.Struct],
                    timeout: float | None = None) -> ControlReqOutput:
        """Send an admin message and wait for its reply (no time limit by default: a weight update
        waits for running requests to finish; a dead scheduler fails the wait with a 503)."""
        out = await self._control(make, timeout)
        self._note_state(out.data)
        return out

    def _note_state(self, data: dict[str, Any]) -> None:
        if "weight_version" in data:
            self.weight_version = data["weight_version"]
        if "paused" in data:
            self.paused = data["paused"]

    async def _control(self, make: Callable[[str], msgspec.Struct],
                       timeout: float | None) -> ControlReqOutput:
        self._check_alive()
        self._check_responsive()
        req_id = uuid.uuid4().hex
        fut: asyncio.Future[ControlReqOutput] = asyncio.get_running_loop().create_future()
        self._pending_control[req_id] = fut
        try:
            self._send(make(req_id))
            return await asyncio.wait_for(fut, timeout)
        except TimeoutError:
            raise APIError(f"the scheduler did not answer within {timeout:g} s", 503,
                           code="scheduler_timeout", err_type="server_error") from None
        finally:
            self._pending_control.pop(req_id, None)

    # ---- liveness
    @property
    def responsive(self) -> bool:
        """The scheduler has stepped or answered within `health_timeout` (a declared long
        operation counts as answering)."""
        return self.liveness.stalled_for() < self.health_timeout

    def _check_responsive(self) -> None:
        if not self.responsive:
            raise APIError(
                f"the scheduler has not responded for {self.liveness.stalled_for():.0f} s; "
                "try again later", 503, code="engine_unresponsive", err_type="server_error")

    def _check_stall(self) -> None:
        """Report a stalled scheduler once; past `abort_timeout`, fail everything waiting on it."""
        stalled = self.liveness.stalled_for()
        if stalled < self.health_timeout:
            if self._stall_reported:
                self._stall_reported = False
                logger.warning("the scheduler responds again")
            return
        if not self._stall_reported:
            self._stall_reported = True
            logger.error("the scheduler has not responded for %.1f s (operation: %s); /health is "
                         "503 and new requests are refused", stalled, self.liveness.operation)
        if stalled < self.abort_timeout:
            return
        message = f"the scheduler stopped responding ({stalled:.0f} s without progress)"
        states = list(self.wire_to_state.values())
        if states:
            logger.error("%s: aborting %d in-flight requests", message, len(states))
            # The abort waits in the socket: if the scheduler comes back, it frees their KV.
            self.abort_states(states, message)
        for fut in self._pending_control.values():
            if not fut.done():
                fut.set_exception(APIError(message, 503, code="engine_unresponsive",
                                           err_type="server_error"))

    # ---- internals
    def _check_alive(self) -> None:
        if self.dead:
            raise APIError("the scheduler process is not running", 503, code="engine_dead",
                           err_type="server_error")

    def _check_serving(self) -> None:
        self._check_alive()
        self._check_responsive()
        if self.shutting_down:
            raise APIError("the server is shutting down", 503, code="shutting_down",
                           err_type="server_error")

    def _send(self, msg: msgspec.Struct) -> None:
        self._send_sock.send(encode_message(msg))

    async def _handle_loop(self) -> None:
        while True:
            data = await self._recv_sock.recv()
            try:
                msg = decode_output(data)
                if isinstance(msg, SchedulerHeartbeat):
                    self.liveness.on_heartbeat(msg)
                    continue
                self.liveness.on_output()
                if isinstance(msg, BatchTokenIDOut):
                    self._handle_batch(msg)
                else:
                    fut = self._pending_control.get(msg.req_id)
                    if fut is not None and not fut.done():
                        fut.set_result(msg)
            except Exception:  # one bad message must not stop serving
                logger.exception("failed to handle a scheduler message")

    def _handle_batch(self, msg: BatchTokenIDOut) -> None:
        now = time.perf_counter()
        for i, wire_rid in enumerate(msg.rids):
            state = self.wire_to_state.get(wire_rid)
            if state is None:
                continue  # finished here already (client gone, shutdown)
            new_ids = msg.new_token_ids[i]
            reason = msg.finished_reasons[i]
            if new_ids:
                gap = None if state.last_token_time is None else now - state.last_token_time
                if state.first_token_time is None:
                    state.first_token_time = now
                    self.metrics.on_first_token(now - state.created)
                state.last_token_time = now
                self.metrics.on_tokens(len(new_ids), gap)
                state.output_ids.extend(new_ids)
                if state.return_logprob:
                    state.output_token_logprobs.extend(_finite(x) for x in msg.new_token_logprobs[i])
                    if state.top_logprobs_num > 0:
                        state.output_top_logprobs.extend(
                            [(_finite(lp), int(t)) for lp, t in row] for row in msg.new_top_logprobs[i]
                        )
                if state.detok is not None:
                    # A matched stop token (always the last) stays out of the text, as sglang's
                    # does, unless `no_stop_trim`.
                    trim = (reason is not None and isinstance(reason.get("matched"), int)
                            and not state.params.no_stop_trim)
                    state.detok.add(new_ids[:-1] if trim else new_ids)
            if msg.input_token_logprobs and msg.input_token_logprobs[i]:
                state.input_token_logprobs = [None if x is None else _finite(x)
                                              for x in msg.input_token_logprobs[i]]
                if state.top_logprobs_num > 0:
                    state.input_top_logprobs = [
                        None if row is None else [(_finite(lp), int(t)) for lp, t in row]
                        for row in msg.input_top_logprobs[i]]
            state.cached_tokens = msg.cached_tokens[i]
            if msg.weight_versions:
                state.weight_version = msg.weight_versions[i]
            if reason is not None:  # stop strings too: the scheduler finds them, once
                self._finish(state, dict(reason))
            state.event.set()

    def _finish(self, state: ReqState, reason: dict[str, Any]) -> None:
        if state.finished:
            return
        if state.detok is not None:
            state.detok.finish()
        state.finished_reason = reason
        state.finished_time = time.perf_counter()
        self.wire_to_state.pop(state.wire_rid, None)
        if self.rid_to_state.get((state.owner, state.rid)) is state:
            del self.rid_to_state[(state.owner, state.rid)]
        e2e = state.finished_time - state.created
        kind = str(reason.get("type", "unknown"))
        self.metrics.on_finish(len(state.prompt_ids), state.cached_tokens, e2e, kind)
        ttft = (state.first_token_time - state.created) if state.first_token_time else None
        n_out = len(state.output_ids)
        decode_time = (state.last_token_time or 0.0) - (state.first_token_time or 0.0)
        rate = (n_out - 1) / decode_time if n_out > 1 and decode_time > 0 else 0.0
        detail = f" ({reason['message']})" if kind == "abort" and reason.get("message") else ""
        logger.info(
            "req %s (%s): %s%s | prompt %d tok (%d cached), output %d tok | ttft %s, %.1f tok/s, "
            "e2e %.3f s",
            state.rid, state.owner, kind, detail, len(state.prompt_ids), state.cached_tokens, n_out,
            f"{ttft * 1000:.1f} ms" if ttft is not None else "-", rate, e2e,
        )
        state.event.set()

    async def _watchdog(self) -> None:
        interval = min(1.0, self.health_timeout / 4)
        last = time.monotonic()
        while True:
            await asyncio.sleep(interval)
            now = time.monotonic()
            # If this event loop was itself blocked, outputs may wait unread in the socket: judge
            # the scheduler on the next turn, once they have been read.
            lagged = now - last > 2 * interval + 0.5
            last = now
            if not self.scheduler_alive():
                self.dead = True
                logger.error("the scheduler process died; failing in-flight requests, stopping")
                self.abort_all_local("the scheduler process died")
                for fut in self._pending_control.values():
                    if not fut.done():
                        fut.set_exception(APIError("the scheduler process died", 503,
                                                   code="engine_dead", err_type="server_error"))
                self.on_fatal()
                return
            if not lagged:
                self._check_stall()


def _finite(x: float) -> float:
    return x if x > _NEG_INF_LOGPROB else _NEG_INF_LOGPROB


def _short_int(value: int) -> str:
    return str(value) if abs(value) < 10**18 else f"a {value.bit_length()}-bit integer"
