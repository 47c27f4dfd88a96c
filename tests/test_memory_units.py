"""Unit tests of the KV memory pieces: RadixCache, the pools, and the device-cache release point."""

from __future__ import annotations

import random
import re
import types
from pathlib import Path

import pytest
import torch

import tide
from tide.memory import empty_device_cache
from tide.memory.ledger import MemoryLedger
from tide.memory.pools import ReqToTokenPool, TokenToKVPoolAllocator
from tide.memory.radix_cache import RadixCache

SIZE = 64


@pytest.fixture
def alloc():
    return TokenToKVPoolAllocator(SIZE, "cpu")


@pytest.fixture
def cache(alloc):
    return RadixCache(ReqToTokenPool(4, 32, "cpu"), alloc)


def _insert(cache: RadixCache, alloc: TokenToKVPoolAllocator, key: list[int]) -> torch.Tensor:
    """Insert like the scheduler does: fresh slots for the key, duplicates of cached tokens freed."""
    value = alloc.alloc(len(key))
    assert value is not None
    cached = cache.insert(key, value)
    alloc.free(value[:cached])
    return value


def _check_sizes(cache: RadixCache, alloc: TokenToKVPoolAllocator) -> None:
    nodes = cache._nodes()
    assert cache.evictable_size() + cache.protected_size() == cache.total_size()
    assert cache.total_size() == sum(len(n.key) for n in nodes)
    assert cache.protected_size() == sum(len(n.key) for n in nodes if n.lock_ref > 0)
    for n in nodes:
        assert n.value is not None and n.value.numel() == len(n.key)
        assert n.parent.children[n.key[0]] is n
        if n.lock_ref > 0 and n.parent is not cache.root:
            assert n.parent.lock_ref >= n.lock_ref, "a locked node's ancestors must be locked"
    # Every slot is free or in the tree, exactly once.
    in_tree = torch.cat([n.value for n in nodes]) if nodes else torch.empty(0, dtype=torch.int64)
    free = alloc.all_free_slots()
    assert alloc.available_size() + cache.total_size() == alloc.size
    everything = torch.cat([free.to(torch.int64), in_tree.to(torch.int64)]).sort().values
    assert torch.equal(everything, torch.arange(1, alloc.size + 1))


# ---- RadixCache


def test_insert_and_match(cache, alloc):
    value = _insert(cache, alloc, [1, 2, 3, 4])
    idx, node = cache.match_prefix([1, 2, 3, 4, 5])
    assert torch.equal(idx, value)
    assert node.key == [1, 2, 3, 4]
    idx, node = cache.match_prefix([9, 1, 2])
    assert idx.numel() == 0 and node is cache.root
    idx, _ = cache.match_prefix([])
    assert idx.numel() == 0
    assert cache.total_size() == 4 and cache.evictable_size() == 4
    _check_sizes(cache, alloc)


def test_match_splits_node(cache, alloc):
    value = _insert(cache, alloc, [1, 2, 3, 4])
    idx, node = cache.match_prefix([1, 2, 9])
    assert torch.equal(idx, value[:2])
    assert node.key == [1, 2] and list(node.children) == [3]
    assert node.children[3].key == [3, 4]
    assert torch.equal(node.children[3].value, value[2:])
    # The full key still matches across the split.
    idx, node = cache.match_prefix([1, 2, 3, 4])
    assert torch.equal(idx, value) and node.key == [3, 4]
    assert cache.total_size() == 4
    _check_sizes(cache, alloc)


def test_insert_shared_prefix_returns_cached_len(cache, alloc):
    first = _insert(cache, alloc, [1, 2, 3, 4])
    before = alloc.available_size()
    value = alloc.alloc(4)
    cached = cache.insert([1, 2, 7, 8], value)
    assert cached == 2
    alloc.free(value[:cached])
    assert alloc.available_size() == before - 2
    idx, _ = cache.match_prefix([1, 2, 7, 8])
    assert torch.equal(idx, torch.cat([first[:2], value[2:]]))
    assert cache.total_size() == 6
    _check_sizes(cache, alloc)


def test_insert_fully_cached_key(cache, alloc):
    _insert(cache, alloc, [1, 2, 3, 4])
    value = alloc.alloc(3)
    assert cache.insert([1, 2, 3], value) == 3
    alloc.free(value)
    assert cache.total_size() == 4
    _check_sizes(cache, alloc)


def test_lock_protects_from_eviction(cache, alloc):
    a = _insert(cache, alloc, [1, 2, 3, 4])
    _insert(cache, alloc, [1, 2, 7, 8])
    _insert(cache, alloc, [5, 6])
    _, node = cache.match_prefix([1, 2, 3, 4])
    cache.inc_lock_ref(node)
    assert cache.protected_size() == 4  # [1,2] and [3,4]
    assert cache.evictable_size() == 4  # [7,8] and [5,6]
    _check_sizes(cache, alloc)
    freed = cache.evict(100)
    assert freed == 4
    assert cache.total_size() == 4 and cache.evictable_size() == 0
    idx, _ = cache.match_prefix([1, 2, 3, 4])
    assert torch.equal(idx, a)
    assert cache.match_prefix([5, 6])[0].numel() == 0
    assert cache.match_prefix([1, 2, 7, 8])[0].numel() == 2
    _check_sizes(cache, alloc)
    cache.dec_lock_ref(node)
    assert cache.protected_size() == 0 and cache.evictable_size() == 4
    assert cache.evict(100) == 4
    assert cache.total_size() == 0
    assert alloc.available_size() == SIZE
    _check_sizes(cache, alloc)


def test_lock_on_inner_node_keeps_it_and_ancestors(cache, alloc):
    _insert(cache, alloc, [1, 2, 3, 4, 5, 6])
    _, mid = cache.match_prefix([1, 2, 3])  # splits [1,2,3] | [4,5,6]
    cache.inc_lock_ref(mid)
    assert cache.evict(100) == 3  # only the unlocked leaf
    assert cache.match_prefix([1, 2, 3, 4])[0].numel() == 3
    cache.dec_lock_ref(mid)
    _check_sizes(cache, alloc)


def test_split_of_locked_node_keeps_lock(cache, alloc):
    _insert(cache, alloc, [1, 2, 3, 4])
    _, leaf = cache.match_prefix([1, 2, 3, 4])
    cache.inc_lock_ref(leaf)
    cache.match_prefix([1, 2, 9])  # splits the locked node
    _check_sizes(cache, alloc)
    assert cache.protected_size() == 4
    assert cache.evict(100) == 0
    cache.dec_lock_ref(leaf)  # walks through the new parent as well
    assert cache.protected_size() == 0 and cache.evictable_size() == 4
    _check_sizes(cache, alloc)


def test_unbalanced_unlock_raises(cache, alloc):
    _insert(cache, alloc, [1, 2])
    _, node = cache.match_prefix([1, 2])
    with pytest.raises(RuntimeError):
        cache.dec_lock_ref(node)


def test_lru_eviction_order(cache, alloc):
    _insert(cache, alloc, [10, 11, 12])  # A
    _insert(cache, alloc, [20, 21, 22])  # B
    _insert(cache, alloc, [30, 31, 32])  # C
    cache.match_prefix([10, 11, 12])  # touch A: B is now least recently used
    assert cache.evict(1) == 3
    assert cache.match_prefix([20, 21, 22])[0].numel() == 0
    assert cache.match_prefix([10, 11, 12])[0].numel() == 3
    assert cache.match_prefix([30, 31, 32])[0].numel() == 3
    # A and C were just touched in that order: A goes next.
    assert cache.evict(1) == 3
    assert cache.match_prefix([10, 11, 12])[0].numel() == 0
    assert cache.match_prefix([30, 31, 32])[0].numel() == 3
    _check_sizes(cache, alloc)


def test_evict_cascades_to_parent_when_it_becomes_leaf(cache, alloc):
    _insert(cache, alloc, [1, 2, 3, 4])
    _insert(cache, alloc, [1, 2, 7, 8])
    assert cache.evict(6) == 6  # both leaves, then their shared parent
    assert cache.total_size() == 0 and not cache.root.children
    assert alloc.available_size() == SIZE


def test_evict_zero_and_empty(cache, alloc):
    assert cache.evict(5) == 0
    _insert(cache, alloc, [1, 2])
    assert cache.evict(0) == 0
    assert cache.total_size() == 2


def test_common_len_matches_a_token_by_token_walk():
    """`_common_len` (slice comparisons and a bisection) against the plain definition, for equal
    keys, one key a prefix of the other, and a first difference at every position of long keys."""
    from tide.memory.radix_cache import _common_len

    def walk(a: list[int], b: list[int]) -> int:
        i = 0
        while i < min(len(a), len(b)) and a[i] == b[i]:
            i += 1
        return i

    rng = random.Random(0)
    base = [rng.randrange(50) for _ in range(300)]
    cases = [([], []), ([], [1]), ([1], []), (base, base), (base, base[:17]), (base[:200], base)]
    for pos in range(300):
        other = list(base)
        other[pos] = -1
        cases.append((base, other))
        cases.append((other[: pos + 5], base))
    for _ in range(200):
        n = rng.randrange(80)
        a = [rng.randrange(3) for _ in range(n)]
        cases.append((a, [rng.randrange(3) for _ in range(rng.randrange(80))]))
    for a, b in cases:
        assert _common_len(a, b) == walk(a, b), (a, b)


def test_disabled_cache(alloc):
    cache = RadixCache(ReqToTokenPool(2, 8, "cpu"), alloc, disable=True)
    value = alloc.alloc(3)
    assert cache.insert([1, 2, 3], value) == 0
    idx, node = cache.match_prefix([1, 2, 3])
    assert idx.numel() == 0 and node is cache.root
    assert cache.total_size() == 0 and cache.evict(10) == 0


def test_reset(cache, alloc):
    _insert(cache, alloc, [1, 2, 3])
    cache.reset()
    assert cache.total_size() == 0 and cache.match_prefix([1, 2, 3])[0].numel() == 0


def test_random_operations_keep_invariants(alloc):
    cache = RadixCache(ReqToTokenPool(2, 8, "cpu"), alloc)
    rng = random.Random(0)
    locks: list = []
    for step in range(400):
        op = rng.random()
        if op < 0.45:
            key = [rng.randrange(4) for _ in range(rng.randrange(1, 7))]
            if alloc.available_size() < len(key):
                cache.evict(len(key) - alloc.available_size())
            if alloc.available_size() >= len(key):
                _insert(cache, alloc, key)
        elif op < 0.65:
            key = [rng.randrange(4) for _ in range(rng.randrange(1, 7))]
            idx, node = cache.match_prefix(key)
            assert idx.numel() <= len(key)
            if idx.numel():
                cache.inc_lock_ref(node)
                locks.append(node)
        elif op < 0.85 and locks:
            cache.dec_lock_ref(locks.pop(rng.randrange(len(locks))))
        else:
            protected = cache.protected_size()
            cache.evict(rng.randrange(1, 10))
            assert cache.protected_size() == protected, "eviction touched locked nodes"
        _check_sizes(cache, alloc)
    for node in locks:
        cache.dec_lock_ref(node)
    assert cache.protected_size() == 0
    cache.evict(SIZE)
    assert cache.total_size() == 0 and alloc.available_size() == SIZE


def test_matched_values_are_the_inserted_slots(alloc):
    """What match_prefix returns for any prefix is exactly the slots inserted for those tokens."""
    cache = RadixCache(ReqToTokenPool(2, 8, "cpu"), alloc)
    rng = random.Random(1)
    truth: dict[tuple[int, ...], int] = {}  # prefix -> slot of its last token
    for _ in range(12):
        key = [rng.randrange(3) for _ in range(rng.randrange(1, 5))]
        value = alloc.alloc(len(key))
        if value is None:
            break
        cached = cache.insert(key, value)
        alloc.free(value[:cached])
        for i in range(cached, len(key)):
            truth[tuple(key[: i + 1])] = int(value[i])
    for prefix, slot in truth.items():
        idx, _ = cache.match_prefix(list(prefix))
        assert idx.numel() == len(prefix)
        assert int(idx[-1]) == slot
        assert [int(s) for s in idx] == [truth[prefix[: i + 1]] for i in range(len(prefix))]


# ---- TokenToKVPoolAllocator / ReqToTokenPool


def test_allocator_never_hands_out_slot_zero(alloc):
    got = alloc.alloc(SIZE)
    assert got is not None and got.numel() == SIZE
    assert 0 not in got.tolist()
    assert sorted(got.tolist()) == list(range(1, SIZE + 1))
    assert alloc.available_size() == 0
    assert alloc.alloc(1) is None


def test_allocator_alloc_free_round_trip(alloc):
    a = alloc.alloc(10)
    b = alloc.alloc(20)
    assert alloc.available_size() == SIZE - 30
    assert not set(a.tolist()) & set(b.tolist())
    alloc.free(a)
    assert alloc.available_size() == SIZE - 20
    c = alloc.alloc(SIZE - 20)  # needs the freed slots back
    assert c is not None
    assert set(c.tolist()) | set(b.tolist()) == set(range(1, SIZE + 1))
    assert alloc.alloc(1) is None
    alloc.free(b)
    alloc.free(c)
    alloc.free(torch.empty(0, dtype=torch.int64))
    assert alloc.available_size() == SIZE
    assert sorted(alloc.all_free_slots().tolist()) == list(range(1, SIZE + 1))


def test_allocator_accepts_int32_slots(alloc):
    a = alloc.alloc(5)
    alloc.free(a.to(torch.int32))  # req_to_token rows may be int32
    b = alloc.alloc(SIZE)
    assert b is not None and b.dtype == torch.int64 and 0 not in b.tolist()


def test_allocator_clear(alloc):
    alloc.alloc(40)
    alloc.clear()
    assert alloc.available_size() == SIZE
    assert alloc.alloc(SIZE) is not None


def test_req_to_token_pool_slots():
    pool = ReqToTokenPool(3, 16, "cpu")
    slots = [pool.alloc() for _ in range(3)]
    assert sorted(slots) == [0, 1, 2]
    assert pool.alloc() is None and pool.available_size() == 0
    pool.free(slots[1])
    with pytest.raises(RuntimeError):
        pool.free(slots[1])
    with pytest.raises(RuntimeError):
        pool.free(3)
    pool.write(slots[0], 2, torch.tensor([7, 8, 9]))
    assert pool.req_to_token[slots[0], :5].tolist() == [0, 0, 7, 8, 9]
    pool.clear()
    assert pool.available_size() == 3


# ---- device cache release point


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only contract")
def test_empty_device_cache_is_noop_on_cpu():
    ledger = MemoryLedger()
    assert empty_device_cache(reason="test", ledger=ledger) is False
    assert ledger.events == []


def test_empty_device_cache_requires_reason():
    with pytest.raises(ValueError, match="reason"):
        empty_device_cache(reason="", ledger=None)
    fake = types.SimpleNamespace(empty_cache=lambda: None)
    with pytest.raises(ValueError, match="reason"):
        empty_device_cache(fake, reason="", ledger=None)


def test_empty_device_cache_calls_backend_and_records():
    calls = []
    reserved = iter([1000, 400])
    fake = types.SimpleNamespace(
        empty_cache=lambda: calls.append(1),
        is_available=lambda: True,
        memory_reserved=lambda: next(reserved),
    )
    ledger, other = MemoryLedger(), MemoryLedger()
    assert empty_device_cache(fake, reason="unit-test-release", ledger=ledger) is True
    assert calls == [1]
    [event] = ledger.events
    assert event.reason == "unit-test-release"
    assert (event.reserved_before, event.reserved_after) == (1000, 400)
    assert ledger.totals()["unit-test-release"]["freed_bytes"] == 600
    assert other.events == []  # a release is recorded only in the ledger it was given


def test_empty_device_cache_skips_unavailable_or_missing_backend():
    calls = []
    unavailable = types.SimpleNamespace(empty_cache=lambda: calls.append(1), is_available=lambda: False)
    assert empty_device_cache(unavailable, reason="x", ledger=None) is False
    assert empty_device_cache(types.SimpleNamespace(), reason="x", ledger=None) is False
    assert calls == []


_EMPTY_CACHE_CALL = re.compile(r"\.empty_cache\s*\(")


def test_only_the_release_module_empties_the_cache():
    root = Path(tide.__file__).parent
    allowed = root / "memory" / "release.py"
    offenders = []
    for path in sorted(root.rglob("*.py")):
        if path == allowed:
            continue
        for lineno, line in enumerate(path.read_text().splitlines(), 1):
            if _EMPTY_CACHE_CALL.search(line):
                offenders.append(f"{path.relative_to(root.parent)}:{lineno}: {line.strip()}")
    assert not offenders, "call tide.memory.empty_device_cache instead:\n" + "\n".join(offenders)
    assert any(root.rglob("*.py")) and allowed.is_file()


def test_allocator_pending_frees_stay_bounded_and_counted():
    """Thousands of small frees (a hybrid model's SWA slots, step after step): the count stays exact
    and the list of waiting tensors never exceeds MAX_PENDING."""
    from tide.memory.pools import TokenToKVPoolAllocator

    alloc = TokenToKVPoolAllocator(4096, "cpu")
    held = [alloc.alloc(3) for _ in range(1000)]
    assert alloc.available_size() == 4096 - 3000
    for i, slots in enumerate(held):
        alloc.free(slots[:1])
        alloc.free(slots[1:])
        assert len(alloc._pending) < alloc.MAX_PENDING
        assert alloc.available_size() == 4096 - 3000 + 3 * (i + 1)
    free = alloc.all_free_slots()
    assert sorted(free.tolist()) == list(range(1, 4097))
