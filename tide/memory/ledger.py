"""The memory ledger: the timeline of every allocator release point and lifecycle event of one engine.

Each engine (in-process `Engine`, or the scheduler process of `tide serve`) owns one `MemoryLedger` and
passes it to whatever records into it: `empty_device_cache(reason=..., ledger=...)` records each release
(reason, host stall, reserved bytes before/after), and the scheduler side adds lifecycle marks
(`ledger.mark("pause")`, `"weight_update"`, `"release"`, `"resume"`, ...) with the device's
reserved/allocated bytes at that moment. `dump_json(path)` writes the timeline that `tide memory-plot`
draws.

Bounded: the ledger keeps the newest `max_events` entries (releases and marks together); per-reason
release totals are running sums, so `totals()` stays exact however many entries were dropped.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

from tide.memory.observe import SOURCE_CPU_RSS, SOURCE_CUDA, device_memory_stats

TIMELINE_FORMAT = "tide.memory_timeline/1"
DEFAULT_MAX_EVENTS = 100_000
_SOURCE_NOTES = {
    SOURCE_CUDA: "reserved/allocated: torch.cuda.memory_reserved()/memory_allocated() of the "
                 "current device (the caching allocator's view)",
    SOURCE_CPU_RSS: "no CUDA context in this process: 'allocated' is the process resident set "
                    "size (RSS) and 'reserved' is 0",
}


@dataclass(frozen=True)
class ReleaseEvent:
    """One allocator release point (`empty_device_cache`). `time` is the wall clock when the release
    returned; it started `stall_s` earlier. `allocated_after`: bytes allocated right after."""

    reason: str
    stall_s: float
    reserved_before: int
    reserved_after: int
    time: float
    allocated_after: int = 0

    source = SOURCE_CUDA  # a device allocator's own figures

    @property
    def freed_bytes(self) -> int:
        return max(0, self.reserved_before - self.reserved_after)

    def to_dict(self) -> dict[str, Any]:
        return {"type": "release", "time": self.time, "start": self.time - self.stall_s,
                "reason": self.reason, "stall_s": self.stall_s,
                "reserved_before": self.reserved_before, "reserved_after": self.reserved_after,
                "allocated": self.allocated_after, "freed_bytes": self.freed_bytes,
                "source": self.source}


@dataclass(frozen=True)
class MemoryMark:
    """A lifecycle event (pause, continue, weight_update, release, resume, flush_cache, ...) with the
    device memory at that moment (see `source` for what the byte counts mean)."""

    kind: str
    detail: str
    reserved: int
    allocated: int
    time: float
    source: str = SOURCE_CUDA

    def to_dict(self) -> dict[str, Any]:
        return {"type": "mark", "time": self.time, "kind": self.kind, "detail": self.detail,
                "reserved": self.reserved, "allocated": self.allocated, "source": self.source}


TimelineEntry = ReleaseEvent | MemoryMark


class MemoryLedger:
    """Every allocator release point and lifecycle mark, in the order recorded (newest
    `max_events` kept); exact per-reason release totals. Thread-safe."""

    def __init__(self, max_events: int = DEFAULT_MAX_EVENTS) -> None:
        if not isinstance(max_events, int) or isinstance(max_events, bool) or max_events <= 0:
            raise ValueError(f"max_events must be a positive integer, got {max_events!r}")
        self.max_events = max_events
        self._entries: deque[TimelineEntry] = deque(maxlen=max_events)
        self._totals: dict[str, dict[str, float]] = {}
        self._mark_counts: dict[str, int] = {}
        self._dropped = 0
        self._lock = threading.Lock()

    # ---- recording
    def _append(self, entry: TimelineEntry) -> None:
        if len(self._entries) == self.max_events:
            self._dropped += 1
        self._entries.append(entry)

    def record(self, event: ReleaseEvent) -> None:
        """Record one allocator release (called by `empty_device_cache`)."""
        with self._lock:
            t = self._totals.setdefault(event.reason, {"count": 0, "stall_s": 0.0, "freed_bytes": 0})
            t["count"] += 1
            t["stall_s"] += event.stall_s
            t["freed_bytes"] += event.freed_bytes
            self._append(event)

    def mark(self, kind: str, detail: str = "") -> None:
        """Record a lifecycle event `kind` ("pause", "continue", "weight_update", "release",
        "resume", "flush_cache", ...) with the device's reserved/allocated bytes now."""
        if not kind or not isinstance(kind, str):
            raise ValueError("kind must be a non-empty string")
        stats = device_memory_stats()
        with self._lock:
            self._mark_counts[kind] = self._mark_counts.get(kind, 0) + 1
            self._append(MemoryMark(kind, str(detail), stats["reserved"], stats["allocated"],
                                    time.time(), stats["source"]))

    # ---- reading
    @property
    def events(self) -> list[ReleaseEvent]:
        """The release events still held, oldest first (a snapshot)."""
        with self._lock:
            return [e for e in self._entries if isinstance(e, ReleaseEvent)]

    @property
    def marks(self) -> list[MemoryMark]:
        """The lifecycle marks still held, oldest first (a snapshot)."""
        with self._lock:
            return [e for e in self._entries if isinstance(e, MemoryMark)]

    def timeline(self) -> list[TimelineEntry]:
        """Releases and marks still held, in the order recorded (a snapshot)."""
        with self._lock:
            return list(self._entries)

    @property
    def dropped(self) -> int:
        """Entries dropped (oldest first) to stay within `max_events`."""
        return self._dropped

    def totals(self) -> dict[str, dict[str, float]]:
        """Per release reason: count, stall_s, freed_bytes — over every release since start,
        dropped ones included."""
        with self._lock:
            return {reason: dict(t) for reason, t in self._totals.items()}

    def mark_counts(self) -> dict[str, int]:
        """How many marks of each kind since start (dropped ones included)."""
        with self._lock:
            return dict(self._mark_counts)

    # ---- JSON
    def to_dict(self) -> dict[str, Any]:
        """The timeline as JSON-ready data (what `dump_json` writes and `tide memory-plot` reads)."""
        with self._lock:
            entries = list(self._entries)
            totals = {reason: dict(t) for reason, t in self._totals.items()}
            counts = dict(self._mark_counts)
            dropped = self._dropped
        now = device_memory_stats()
        sources = sorted({e.source for e in entries} | {now["source"]})
        return {
            "format": TIMELINE_FORMAT,
            "pid": os.getpid(),
            "dumped_at": time.time(),
            "memory_source": now["source"],
            "notes": {s: _SOURCE_NOTES.get(s, "") for s in sources},
            "current": {"reserved": now["reserved"], "allocated": now["allocated"]},
            "max_events": self.max_events,
            "dropped_events": dropped,
            "release_totals": totals,
            "mark_counts": counts,
            "events": [e.to_dict() for e in entries],
        }

    def dump_json(self, path: str | os.PathLike[str]) -> str:
        """Write `to_dict()` to `path` (atomically: a temp file renamed over it); returns the path."""
        path = os.fspath(path)
        tmp = f"{path}.tmp-{os.getpid()}-{threading.get_ident()}"
        with open(tmp, "w") as f:
            json.dump(self.to_dict(), f)
        os.replace(tmp, path)
        return path

    @classmethod
    def from_dict(cls, data: dict[str, Any], max_events: int | None = None) -> MemoryLedger:
        """Rebuild a ledger from `to_dict()` output (totals and drop count included)."""
        events = check_timeline(data)
        ledger = cls(max_events or int(data.get("max_events") or DEFAULT_MAX_EVENTS))
        ledger._entries.extend(_entry_from_dict(e) for e in events)
        ledger._totals = {r: dict(t) for r, t in (data.get("release_totals") or {}).items()}
        ledger._mark_counts = dict(data.get("mark_counts") or {})
        ledger._dropped = int(data.get("dropped_events", 0))
        return ledger


def check_timeline(data: Any) -> list[dict[str, Any]]:
    """The events of timeline JSON `data`, or ValueError saying what is wrong with it."""
    if not isinstance(data, dict) or data.get("format") != TIMELINE_FORMAT:
        got = data.get("format") if isinstance(data, dict) else type(data).__name__
        raise ValueError(f"not a tide memory timeline (format {got!r}, expected "
                         f"{TIMELINE_FORMAT!r}); write one with Engine.dump_memory_timeline "
                         "or GET /dump_memory_timeline")
    events = data.get("events")
    if not isinstance(events, list):
        raise ValueError("memory timeline: 'events' must be a list")
    need = {"release": ("time", "reason", "stall_s", "reserved_before", "reserved_after"),
            "mark": ("time", "kind", "reserved", "allocated")}
    for i, e in enumerate(events):
        kind = e.get("type") if isinstance(e, dict) else None
        if kind not in need:
            raise ValueError(f"memory timeline: events[{i}] has type {kind!r}, expected "
                             "'release' or 'mark'")
        missing = [k for k in need[kind] if k not in e]
        if missing:
            raise ValueError(f"memory timeline: events[{i}] ({kind}) lacks {missing}")
    return events


def _entry_from_dict(e: dict[str, Any]) -> TimelineEntry:
    if e["type"] == "release":
        return ReleaseEvent(e["reason"], float(e["stall_s"]), int(e["reserved_before"]),
                            int(e["reserved_after"]), float(e["time"]), int(e.get("allocated", 0)))
    return MemoryMark(e["kind"], e.get("detail", ""), int(e["reserved"]), int(e["allocated"]),
                      float(e["time"]), e.get("source", SOURCE_CUDA))
