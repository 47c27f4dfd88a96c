"""`tide.cluster.router`: least-outstanding choice, liveness, group ranks, merged replies (no
processes: the logic both `tide serve --dp-size` and `tide.cluster.ray` route with)."""

from __future__ import annotations

import threading

import pytest
from tide.cluster.dp_controller import merge_load
from tide.cluster.router import (
    NoLiveReplicaError,
    ReplicaReply,
    Router,
    group_rank_offsets,
    merge_replies,
)


def test_least_outstanding_first_and_ties_round_robin():
    router = Router(3)
    assert [router.pick() for _ in range(3)] == [0, 1, 2]  # all idle: one each
    router.finish(1)
    assert router.pick() == 1  # the only one with room
    for index in (0, 1, 2):
        router.finish(index)
    # sequential traffic (each finishes before the next) still visits every replica in turn
    seen = []
    for _ in range(6):
        index = router.pick()
        seen.append(index)
        router.finish(index)
    assert sorted(seen) == [0, 0, 1, 1, 2, 2] and seen[:3] == seen[3:]
    assert [r["outstanding_requests"] for r in router.describe()] == [0, 0, 0]
    assert [r["requests_served"] for r in router.describe()] == [3, 4, 3]


def test_dead_replicas_are_never_picked():
    router = Router(2)
    assert router.mark_dead(1, "replica 1 exited with code -9")
    assert not router.mark_dead(1, "again")  # only the first report counts
    assert {router.pick() for _ in range(5)} == {0}
    assert router.describe()[1]["dead_reason"] == "replica 1 exited with code -9"
    router.mark_dead(0, "gone too")
    with pytest.raises(NoLiveReplicaError, match="replica 1 exited"):
        router.pick()


def test_picks_from_many_threads_keep_the_books():
    router = Router(4)
    picks: list[int] = []
    lock = threading.Lock()

    def work() -> None:
        for _ in range(250):
            index = router.pick()
            with lock:
                picks.append(index)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    counts = [picks.count(i) for i in range(4)]
    assert counts == [250] * 4  # never finished: least-outstanding keeps them level
    assert [r["outstanding_requests"] for r in router.describe()] == counts


@pytest.mark.parametrize("bad", [0, -1, True, 1.5])
def test_router_size_is_checked(bad):
    with pytest.raises(ValueError, match="num_replicas"):
        Router(bad)


def test_group_rank_offsets():
    assert group_rank_offsets(1, 3, 2) == [1, 2]
    # replica i owns ranks rank_offset + i * tp_size + tp_rank: no collisions
    offsets = group_rank_offsets(1, 1 + 3 * 2, 3, tp_size=2)
    assert offsets == [1, 3, 5]
    ranks = [o + t for o in offsets for t in range(2)]
    assert ranks == list(range(1, 7))
    with pytest.raises(ValueError, match="at least 7"):
        group_rank_offsets(1, 6, 3, tp_size=2)
    with pytest.raises(ValueError, match="rank_offset"):
        group_rank_offsets(0, 4, 2)


def test_merge_replies():
    same = merge_replies([
        ReplicaReply(0, True, "paused", {"num_paused_requests": 2, "weight_version": "v1",
                                         "released_bytes": {"kv_cache": 10}}),
        ReplicaReply(1, True, "paused", {"num_paused_requests": 3, "weight_version": "v1",
                                         "released_bytes": {"kv_cache": 5, "weights": 1}}),
    ])
    assert same.success and same.message == "paused"
    assert same.data["num_paused_requests"] == 5
    assert same.data["released_bytes"] == {"kv_cache": 15, "weights": 1}
    mixed = merge_replies([ReplicaReply(0, True, "ok"), ReplicaReply(1, False, "bad tensor x")],
                          skipped=[{"index": 2, "alive": False}])
    assert not mixed.success
    assert mixed.message == "replica 0: ok; replica 1: bad tensor x"
    assert mixed.data["dead_replicas"] == [{"index": 2, "alive": False}]
    split = merge_replies([ReplicaReply(0, True, "", {"weight_version": "a"}),
                           ReplicaReply(1, True, "", {"weight_version": "b"})])
    assert not split.success and "disagree on weight_version" in split.message
    assert not merge_replies([]).success


def _load(free_full: int, free_swa: int, allocated: tuple[int, int]) -> dict:
    """One replica's load reply as the scheduler sends it: hybrid two-pool KV and two TP ranks."""
    return {
        "num_running_reqs": 1, "max_total_tokens": 512, "kv_free_slots": free_full,
        "kv_used_slots": 512 - free_full, "invariants_ok": True,
        "kv_pools": {"full": {"capacity": 512, "free": free_full, "used": 512 - free_full,
                              "cached": 4, "evictable": 2},
                     "swa": {"capacity": 409, "free": free_swa, "used": 409 - free_swa,
                             "cached": 3, "evictable": 1}},
        "ranks": [{"rank": r, "reserved_bytes": 0, "allocated_bytes": allocated[r],
                   "released_bytes": {"kv_cache": 10 * (r + 1), "weights": 0},
                   "release_totals": {"release_memory": {"count": 1, "bytes": 7}}}
                  for r in range(2)],
    }


def test_merge_load_sums_kv_pools_and_rank_memory_over_replicas():
    """`/metrics` and `/get_server_info` of `tide serve --dp-size 2`: every pool count adds up over
    the replicas like `max_total_tokens` does, and TP rank r's memory is the replicas' rank r."""
    merged = merge_load([ReplicaReply(0, True, "", _load(500, 400, (100, 80))),
                         ReplicaReply(1, True, "", _load(490, 395, (110, 90)))])
    assert merged["max_total_tokens"] == 1024 and merged["kv_used_slots"] == 12 + 22
    assert merged["kv_pools"] == {
        "full": {"capacity": 1024, "free": 990, "used": 34, "cached": 8, "evictable": 4},
        "swa": {"capacity": 818, "free": 795, "used": 23, "cached": 6, "evictable": 2}}
    assert merged["kv_pools"]["full"]["capacity"] == merged["max_total_tokens"]
    assert [r["rank"] for r in merged["ranks"]] == [0, 1]
    assert [r["allocated_bytes"] for r in merged["ranks"]] == [210, 170]
    assert [r["released_bytes"]["kv_cache"] for r in merged["ranks"]] == [20, 40]
    assert merged["ranks"][1]["release_totals"] == {"release_memory": {"count": 2, "bytes": 14}}
    # One replica without tensor parallelism reports no ranks; nothing is invented.
    plain = {k: v for k, v in _load(500, 400, (0, 0)).items() if k != "ranks"}
    assert "ranks" not in merge_load([ReplicaReply(0, True, "", plain)])
    assert merge_load([]) == {}
