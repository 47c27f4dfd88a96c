"""Data-parallel routing over N engine replicas, independent of how replicas are reached.

`Router` is shared by `tide serve --dp-size N` (replicas are scheduler processes behind zmq,
`tide.cluster.dp_controller`) and by `tide.cluster.ray` (replicas are Ray actors). It decides two
things and keeps the books for both:

- **which replica runs a request**: the live replica with the fewest outstanding requests; ties go
  round-robin, so requests that arrive one at a time (each finishing before the next) still spread;
- **which replicas are alive**: a replica marked dead (its process exited, its actor died) is never
  picked again, and `describe()` reports it with the reason.

Handover calls (pause/continue, weight updates, flush, release/resume, versions) go to every live
replica; `merge_replies` folds their answers into one reply of the single-engine shape, and
`group_rank_offsets` gives each replica its ranks in one trainer broadcast group: replica `i` with
`tp_size` ranks takes `rank_offset + i * tp_size + tp_rank`, so the group's world size is
`rank_offset + replicas * tp_size` (`1 + replicas * tp_size` with the trainer alone at rank 0).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any


class NoLiveReplicaError(RuntimeError):
    """Every replica has died: nothing can serve the request."""


@dataclass
class ReplicaStatus:
    """The router's view of one replica."""

    index: int
    alive: bool = True
    outstanding: int = 0  # requests sent to it and not finished
    served: int = 0  # requests ever sent to it
    dead_reason: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"index": self.index, "alive": self.alive, "outstanding_requests": self.outstanding,
                "requests_served": self.served, "dead_reason": self.dead_reason}


class Router:
    """Least-outstanding-requests choice over `num_replicas` replicas, and their liveness.

    Thread-safe: `pick` / `finish` / `mark_dead` may be called from several threads (the Ray group
    serves `generate` from any thread)."""

    def __init__(self, num_replicas: int) -> None:
        if isinstance(num_replicas, bool) or not isinstance(num_replicas, int) or num_replicas < 1:
            raise ValueError(f"num_replicas must be a positive integer, got {num_replicas!r}")
        self.replicas = [ReplicaStatus(i) for i in range(num_replicas)]
        self._next = 0  # round-robin cursor among equally loaded replicas
        self._lock = threading.Lock()

    @property
    def num_replicas(self) -> int:
        return len(self.replicas)

    def pick(self) -> int:
        """The live replica to send one request to; counts the request as outstanding there.
        Raises `NoLiveReplicaError` when every replica has died."""
        with self._lock:
            live = [r for r in self.replicas if r.alive]
            if not live:
                raise NoLiveReplicaError(f"all {len(self.replicas)} replicas have died: "
                                         + "; ".join(self._reasons()))
            n = len(self.replicas)
            best = min(live, key=lambda r: (r.outstanding, (r.index - self._next) % n))
            self._next = (best.index + 1) % n
            best.outstanding += 1
            best.served += 1
            return best.index

    def finish(self, index: int, count: int = 1) -> None:
        """`count` requests sent to replica `index` have finished (or failed)."""
        with self._lock:
            replica = self.replicas[index]
            replica.outstanding = max(0, replica.outstanding - count)

    def mark_dead(self, index: int, reason: str) -> bool:
        """Replica `index` is gone; True if this call is the one that found out."""
        with self._lock:
            replica = self.replicas[index]
            if not replica.alive:
                return False
            replica.alive = False
            replica.dead_reason = reason
            replica.outstanding = 0
            return True

    def is_alive(self, index: int) -> bool:
        return self.replicas[index].alive

    def live_indices(self) -> list[int]:
        with self._lock:
            return [r.index for r in self.replicas if r.alive]

    def describe(self) -> list[dict[str, Any]]:
        """One dict per replica: index, alive, outstanding requests, requests served, why dead."""
        with self._lock:
            return [r.to_dict() for r in self.replicas]

    def _reasons(self) -> list[str]:
        return [f"replica {r.index}: {r.dead_reason}" for r in self.replicas if not r.alive]


def group_rank_offsets(rank_offset: int, world_size: int, num_replicas: int,
                       tp_size: int = 1) -> list[int]:
    """Each replica's `rank_offset` in one trainer broadcast group (replica `i` takes ranks
    `rank_offset + i * tp_size + tp_rank`). ValueError naming the field when the group cannot hold
    them all."""
    for name, value, low in (("rank_offset", rank_offset, 1), ("world_size", world_size, 2),
                             ("tp_size", tp_size, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    needed = rank_offset + num_replicas * tp_size
    if world_size < needed:
        raise ValueError(
            f"world_size {world_size} cannot hold {num_replicas} replicas x tp_size {tp_size} "
            f"ranks from rank_offset {rank_offset}: it must be at least {needed} "
            f"(1 + replicas x tp_size with the trainer alone at rank 0)")
    return [rank_offset + i * tp_size for i in range(num_replicas)]


@dataclass
class ReplicaReply:
    """One replica's answer to a fanned-out handover call."""

    index: int
    success: bool
    message: str = ""
    data: dict[str, Any] = field(default_factory=dict)


# Reply fields that add up over replicas (each replica's requests and bytes are its own).
_SUMMED = frozenset({"num_paused_requests", "num_aborted"})
_SUMMED_BY_KEY = frozenset({"released_bytes"})


def merge_replies(replies: list[ReplicaReply], skipped: list[dict[str, Any]] | None = None
                  ) -> ReplicaReply:
    """Fold the replies of every replica called into one reply (index -1).

    `success` only if every replica succeeded; the message is the common one, or each replica's
    prefixed with its index when they differ; counts (`num_paused_requests`, `num_aborted`) and
    per-tag `released_bytes` add up; other fields come from the first reply, and
    `weight_version` disagreeing across replicas is a failure saying so. `skipped` (dead replicas
    that were not called) is reported as `data["dead_replicas"]`."""
    if not replies:
        return ReplicaReply(-1, False, "no live replica to call", {"dead_replicas": skipped or []})
    success = all(r.success for r in replies)
    messages = [r.message for r in replies]
    if len(set(messages)) == 1:
        message = messages[0]
    else:
        message = "; ".join(f"replica {r.index}: {r.message or ('ok' if r.success else 'failed')}"
                            for r in replies)
    data: dict[str, Any] = {}
    for reply in replies:
        for key, value in reply.data.items():
            if key in _SUMMED and isinstance(value, int) and not isinstance(value, bool):
                data[key] = data.get(key, 0) + value
            elif key in _SUMMED_BY_KEY and isinstance(value, dict):
                total = data.setdefault(key, {})
                for tag, amount in value.items():
                    total[tag] = total.get(tag, 0) + amount
            else:
                data.setdefault(key, value)
    versions = {r.data["weight_version"] for r in replies if "weight_version" in r.data}
    if len(versions) > 1:
        success = False
        message += " | replicas disagree on weight_version: " + ", ".join(
            f"replica {r.index}: {r.data.get('weight_version')!r}" for r in replies)
    if skipped:
        data["dead_replicas"] = skipped
    return ReplicaReply(-1, success, message, data)
