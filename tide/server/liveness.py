"""Is the scheduler alive and making progress? (the HTTP side's view)

The scheduler process sends a `SchedulerHeartbeat` from a helper thread every interval (at most a
second): how many turns its loop has made, and the long operation it has declared, if any (a weight
update, a memory release...). Its outputs and replies come from the loop itself. So:

- a stopped or frozen process (SIGSTOP, a held GIL) sends nothing: *silent*;
- a loop stuck in one turn (a hung step) keeps beating with the same turn count: *no progress*;
- a loop inside a declared long operation beats with the operation named: that is progress enough
  (a distributed weight update may block the loop for as long as the trainer takes).

`stalled_for()` is how long the scheduler has been silent, or, outside a declared operation, how long
its loop has not turned; the `TokenizerManager` compares it with the server's bounds.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from tide.io_struct import SchedulerHeartbeat


class SchedulerLiveness:
    """Tracks the last sign of life and of loop progress (times on this process's monotonic clock)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        now = clock()
        self.last_message = now  # anything received from the scheduler process
        self.last_progress = now  # the loop turned (or sent an output/reply itself)
        self.loop_count = -1
        self.operation: str | None = None
        self.operation_seconds = 0.0

    def on_output(self) -> None:
        """An output or a reply arrived: the loop itself sent it."""
        now = self._clock()
        self.last_message = self.last_progress = now

    def on_heartbeat(self, beat: SchedulerHeartbeat) -> None:
        now = self._clock()
        self.last_message = now
        if beat.loop_count != self.loop_count:
            self.loop_count = beat.loop_count
            self.last_progress = now
        self.operation = beat.operation
        self.operation_seconds = beat.operation_seconds

    def stalled_for(self) -> float:
        """Seconds without a sign of life, or (outside a declared operation) without progress."""
        now = self._clock()
        if self.operation is not None:
            return now - self.last_message
        return now - self.last_progress

    def describe(self) -> dict[str, Any]:
        return {
            "stalled_seconds": round(self.stalled_for(), 3),
            "seconds_since_heartbeat": round(self._clock() - self.last_message, 3),
            "operation": self.operation,
            "operation_seconds": round(self.operation_seconds, 3) if self.operation else None,
        }
