"""`Engine.async_generate`'s side: calls wait on asyncio futures while one background thread submits
their requests and steps the engine's scheduler for them.

The event loop never takes the engine lock: a call goes to an inbox (its own small lock) and the
thread submits it between steps, so calls made together join one batch and a weight update draining
under the lock does not freeze the loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from tide.scheduler.request import Req
from tide.scheduler.scheduler import Scheduler

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class AsyncCall:
    """One `async_generate` call: its requests (validated, not yet submitted when it is made), the
    future (of `loop`) its outputs resolve, and whether its awaiting task was cancelled."""

    reqs: list[Req]
    future: asyncio.Future[Any]
    loop: asyncio.AbstractEventLoop
    outputs: Callable[[list[Req]], Any]  # the finished requests' result (the engine's outputs)
    cancelled: bool = False


class EngineLock(Protocol):
    """What `AsyncCalls` needs of the engine: its lock (stepping threads yield to the control
    calls counted in `_controls_waiting`), its state and its scheduler."""

    _cond: threading.Condition
    _controls_waiting: int
    _shut_down: bool
    scheduler: Scheduler


class AsyncCalls:
    """The calls of `Engine.async_generate` and the thread that steps for them.

    Invariants: `_inbox` (calls not yet submitted), `_live` (every call not yet answered) and
    `_thread` change only under `_inbox_lock`; `_waiting` (submitted calls) and every scheduler
    access change only under the engine's lock (taken before `_inbox_lock`). The thread runs while
    a call is unanswered, and whatever ends it (a defect, an interrupt) answers every call in
    `_live` first, so no call waits forever. Futures are answered outside the engine's lock
    (building outputs detokenizes)."""

    def __init__(self, engine: EngineLock, device: torch.device) -> None:
        """`device`: the model's; the thread makes it current, as the runner's maker did."""
        self.engine = engine
        self.device = device
        self._inbox: list[AsyncCall] = []
        self._live: list[AsyncCall] = []
        self._inbox_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._waiting: list[AsyncCall] = []

    @property
    def running(self) -> bool:
        """Whether the stepping thread is alive (it exits once no call waits)."""
        return self._thread is not None

    def submit(self, call: AsyncCall) -> None:
        """Queue `call`; the thread submits its requests between two steps."""
        with self._inbox_lock:
            self._inbox.append(call)
            self._live.append(call)
            if self._thread is None:
                thread = threading.Thread(target=self._run, daemon=True,
                                          name="tide-async-generate")
                try:
                    thread.start()
                except BaseException:  # no thread: the call is not taken
                    self._inbox.remove(call)
                    self._live.remove(call)
                    raise
                self._thread = thread

    def _run(self) -> None:
        try:
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)
            while self._turn():
                pass
        except BaseException as e:  # a defect or an interrupt, not a step: answer everyone
            logger.exception("the async_generate thread failed")
            with self.engine._cond, self._inbox_lock:
                calls, self._live = self._live, []
                self._waiting, self._inbox = [], []
                if self._thread is threading.current_thread():
                    self._thread = None
                self._abort(calls, "the engine's async_generate thread failed")
            error = e if isinstance(e, Exception) else RuntimeError(
                f"the engine's async_generate thread stopped: {type(e).__name__}")
            for call in calls:
                _answer(call, None, error)
            if not isinstance(e, Exception):
                raise

    def _turn(self) -> bool:
        """One pass: submit new calls, settle finished and cancelled ones, step (or wait); answer
        outside the lock, whatever happens in it. False once nothing waits (the thread has been
        let go)."""
        answers: list[tuple[AsyncCall, Any, BaseException | None]] = []
        keep_going = True
        engine = self.engine
        try:
            with engine._cond:
                self._take_inbox()
                answers += self._settle()
                if not self._waiting:
                    with self._inbox_lock:
                        if not self._inbox:
                            self._thread = None
                            keep_going = False
                elif engine._shut_down:  # its requests were aborted; any left are now
                    self._abort(self._waiting, "the engine is shut down")
                    answers += self._settle()
                    down = RuntimeError("the engine is shut down")
                    answers += [(call, None, down) for call in self._waiting]
                    self._waiting = []
                elif engine._controls_waiting or engine.scheduler.is_blocked():
                    engine._cond.wait(timeout=0.05)
                elif not engine.scheduler.has_work():
                    idle = RuntimeError("scheduler went idle with requests still pending")
                    answers += [(call, None, idle) for call in self._waiting]
                    self._waiting = []
                else:
                    try:
                        engine.scheduler.step()
                    except Exception as e:  # the calls waiting now fail with it, as generate
                        logger.exception("a step for async_generate failed")
                        failed, self._waiting = self._waiting, []
                        answers += [(call, None, e) for call in failed]
                        self._abort(failed, f"internal error: {type(e).__name__}: {e}")
                    engine._cond.notify_all()
        finally:
            self._deliver(answers)
        return keep_going

    def _take_inbox(self) -> None:
        """Under the engine's lock: submit the inbox's calls (each counted as waiting before its
        requests go in, so a failure part-way leaves it to be answered)."""
        with self._inbox_lock:
            calls, self._inbox = self._inbox, []
        for call in calls:
            self._waiting.append(call)
            if call.cancelled or self.engine._shut_down:
                continue  # settled (cancelled) or failed (shut down) on this pass
            for req in call.reqs:
                self.engine.scheduler.add_request(req)

    def _settle(self) -> list[tuple[AsyncCall, Any, BaseException | None]]:
        """Under the engine's lock: take out the finished calls (to answer) and the cancelled ones
        (their unfinished requests aborted)."""
        done: list[tuple[AsyncCall, Any, BaseException | None]] = []
        pending: list[AsyncCall] = []
        for call in self._waiting:
            if call.cancelled:
                self._abort([call], "the awaiting task was cancelled")
                done.append((call, None, asyncio.CancelledError()))  # its future is done already
            elif all(r.finished for r in call.reqs):
                done.append((call, None, None))
            else:
                pending.append(call)
        self._waiting = pending
        return done

    def _abort(self, calls: list[AsyncCall], message: str) -> None:
        """Abort the calls' unfinished requests; a failure to do so is logged, not raised (the
        calls are answered either way)."""
        unfinished = [r for call in calls for r in call.reqs if not r.finished]
        if not unfinished:
            return
        try:
            self.engine.scheduler.abort_reqs(unfinished, message)
        except Exception:
            logger.exception("aborting the requests of async_generate calls failed")

    def _deliver(self, answers: list[tuple[AsyncCall, Any, BaseException | None]]) -> None:
        """Answer each call (building its outputs, outside the engine's lock) and let it go."""
        for call, result, error in answers:
            if error is None:
                try:
                    result = call.outputs(call.reqs)
                except Exception as e:
                    logger.exception("building an async_generate output failed")
                    result, error = None, e
            with self._inbox_lock:
                if call in self._live:
                    self._live.remove(call)
            _answer(call, result, error)


def _answer(call: AsyncCall, result: Any, error: BaseException | None) -> None:
    """Resolve `call`'s future on its loop's thread (nothing if that loop has closed)."""
    with contextlib.suppress(RuntimeError):
        call.loop.call_soon_threadsafe(_resolve, call.future, result, error)


def _resolve(future: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    if future.done():  # its awaiting task was cancelled
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
