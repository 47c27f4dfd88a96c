"""`tide.cluster.router`: least-outstanding choice, liveness, group ranks, merged replies (no
processes: the logic both `tide serve --dp-size` and `tide.cluster.ray` route with)."""

from __future__ import annotations

import threading

import pytest
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
