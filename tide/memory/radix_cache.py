"""Prefix cache over KV slots: a radix tree keyed by token ids (one KV slot per token).

Invariants:
- A node's `value` holds the KV slots of its `key` tokens; the tree owns those slots until evicted.
- `lock_ref > 0` on a node means a running request uses it (and so all its ancestors); locked nodes are
  never evicted. `evictable_size() + protected_size()` equals the number of slots the tree holds.
- With `disable=True` nothing is cached: requests free all their KV when they finish.
- A `retired` tree (its KV predates the current weights) takes no new entries: finishing requests
  free their own KV, and its nodes are freed as their last user lets go. It is never matched.

Two-pool cache (`window` set, the allocator a `SWATokenToKVPoolAllocator`): a node's first
`swa_freed` tokens have lost their sliding-window K/V (their SWA slots are back in the SWA pool);
the rest still have it. A match of length m is usable only if tokens max(0, m - window + 1) .. m - 1
all still have it (the next query, at position m, sees exactly those); `match_prefix` shortens a
match until that holds, so sliding layers never read a freed SWA slot. `swa_evictable_size() +
swa_protected_size()` equals the SWA slots the tree holds. Eviction for the SWA pool frees the SWA
slots no match can need before whole nodes.
"""

from __future__ import annotations

import heapq
import itertools
from typing import Protocol

import torch

from tide.memory.pools import ReqToTokenPool, TokenToKVPoolAllocator
from tide.memory.swa import SWATokenToKVPoolAllocator

_clock = itertools.count()


class CachedReq(Protocol):
    """What the tree reads and updates on a request (the scheduler's `Req`): its request slot, how
    many of its tokens have KV, and the cached prefix it has locked."""

    req_pool_idx: int | None
    kv_len: int
    prefix_indices: torch.Tensor
    last_node: TreeNode | None
    swa_evicted_len: int  # two-pool cache: SWA K/V before this position is given up

    def all_token_ids(self) -> list[int]: ...


class TreeNode:
    __slots__ = ("children", "parent", "key", "value", "lock_ref", "last_access", "swa_freed")

    def __init__(self, parent: "TreeNode | None" = None) -> None:
        self.children: dict[int, TreeNode] = {}
        self.parent = parent
        self.key: list[int] = []
        self.value: torch.Tensor | None = None
        self.lock_ref = 0
        self.last_access = next(_clock)
        self.swa_freed = 0  # leading tokens of `key` whose SWA slots are freed (two-pool cache)

    @property
    def swa_len(self) -> int:
        """Tokens of this node that still hold an SWA slot."""
        return len(self.key) - self.swa_freed

    def __lt__(self, other: "TreeNode") -> bool:
        return self.last_access < other.last_access


class RadixCache:
    def __init__(
        self,
        req_to_token_pool: ReqToTokenPool,
        token_to_kv_allocator: "TokenToKVPoolAllocator | SWATokenToKVPoolAllocator",
        disable: bool = False,
        window: int | None = None,
    ) -> None:
        """`window`: the largest sliding window of a two-pool cache (its allocator frees SWA slots
        alone with `free_swa`); None for one pool."""
        if window is not None and not isinstance(token_to_kv_allocator, SWATokenToKVPoolAllocator):
            raise ValueError("a radix cache with a window needs a SWATokenToKVPoolAllocator")
        self.req_to_token_pool = req_to_token_pool
        self.allocator = token_to_kv_allocator
        self.disable = disable
        self.window = window
        self.retired = False
        self.reset()

    def reset(self) -> None:
        self.root = TreeNode()
        self.root.lock_ref = 1
        self._evictable = 0
        self._protected = 0
        self._swa_evictable = 0
        self._swa_protected = 0

    # ---- sizes
    def evictable_size(self) -> int:
        return self._evictable

    def protected_size(self) -> int:
        return self._protected

    def total_size(self) -> int:
        return self._evictable + self._protected

    def swa_evictable_size(self) -> int:
        """SWA slots held by unlocked nodes (0 for one pool)."""
        return self._swa_evictable

    def swa_protected_size(self) -> int:
        return self._swa_protected

    def swa_total_size(self) -> int:
        return self._swa_evictable + self._swa_protected

    # ---- lookup and insert
    def match_prefix(self, key: list[int]) -> tuple[torch.Tensor, TreeNode]:
        """KV slots of the longest usable cached prefix of `key`, and the node that ends it (with a
        window: shortened until its last window - 1 tokens all hold SWA slots)."""
        empty = torch.empty(0, dtype=torch.int64, device=self.allocator.device)
        if self.disable or not key:
            return empty, self.root
        node = self.root
        values: list[torch.Tensor] = []
        path: list[TreeNode] = []
        while key and key[0] in node.children:
            child = node.children[key[0]]
            child.last_access = next(_clock)
            n = _common_len(child.key, key)
            if n < len(child.key):
                child = self._split(child, n)
            values.append(child.value)  # type: ignore[arg-type]
            path.append(child)
            node = child
            key = key[n:]
        if self.window is not None and path:
            usable = self._usable_len(path)
            matched = sum(len(p.key) for p in path)
            if usable < matched:
                return self._cut(path, usable)
        return (torch.cat(values) if values else empty), node

    def _usable_len(self, path: list[TreeNode]) -> int:
        """The longest m <= len(path's tokens) whose last window - 1 tokens all hold SWA slots."""
        assert self.window is not None
        freed: list[tuple[int, int]] = []  # [start, end) of each node's freed tokens, by position
        pos = 0
        for node in path:
            if node.swa_freed:
                freed.append((pos, pos + node.swa_freed))
            pos += len(node.key)
        m = pos
        if self.window <= 1:
            return m
        for start, end in reversed(freed):
            last = min(end, m) - 1  # the last freed position before m
            if start >= m:
                continue
            if last < m - self.window + 1:
                return m
            m = start  # a match ending inside or after this run would need a freed token
        return m

    def _cut(self, path: list[TreeNode], length: int) -> tuple[torch.Tensor, TreeNode]:
        """The first `length` tokens of a matched path (splitting the node it ends in)."""
        values: list[torch.Tensor] = []
        node = self.root
        done = 0
        for child in path:
            if done >= length:
                break
            n = min(len(child.key), length - done)
            if n < len(child.key):
                child = self._split(child, n)
            values.append(child.value)  # type: ignore[arg-type]
            node = child
            done += n
        empty = torch.empty(0, dtype=torch.int64, device=self.allocator.device)
        return (torch.cat(values) if values else empty), node

    def insert(self, key: list[int], value: torch.Tensor, swa_freed: int = 0) -> int:
        """Insert key -> value; returns how many leading tokens were already cached (their slots in
        `value` are duplicates the caller must free). `swa_freed`: tokens before this position of
        `key` have no SWA slot any more (two-pool cache)."""
        if self.disable:
            return 0
        node = self.root
        done = 0
        while done < len(key):
            first = key[done]
            child = node.children.get(first)
            if child is None:
                leaf = TreeNode(node)
                leaf.key = list(key[done:])
                leaf.value = value[done:].clone()
                if self.window is not None:
                    leaf.swa_freed = min(len(leaf.key), max(0, swa_freed - done))
                    self._swa_evictable += leaf.swa_len
                node.children[first] = leaf
                self._evictable += len(leaf.key)
                return done
            child.last_access = next(_clock)
            n = _common_len(child.key, key[done:])
            if n < len(child.key):
                child = self._split(child, n)
            done += n
            node = child
        return done

    def _split(self, child: TreeNode, n: int) -> TreeNode:
        """Split `child` so that its first n tokens become a new parent node; returns that node."""
        assert child.parent is not None and child.value is not None
        mid = TreeNode(child.parent)
        mid.key = child.key[:n]
        mid.value = child.value[:n]
        mid.lock_ref = child.lock_ref
        mid.swa_freed = min(child.swa_freed, n)
        child.swa_freed = max(0, child.swa_freed - n)
        mid.children = {child.key[n]: child}
        child.parent.children[mid.key[0]] = mid
        child.parent = mid
        child.key = child.key[n:]
        child.value = child.value[n:]
        return mid

    # ---- locking
    def inc_lock_ref(self, node: TreeNode | None) -> None:
        """Lock `node` and its ancestors (None or the root: nothing to lock)."""
        while node is not self.root and node is not None:
            if node.lock_ref == 0:
                self._evictable -= len(node.key)
                self._protected += len(node.key)
                if self.window is not None:
                    self._swa_evictable -= node.swa_len
                    self._swa_protected += node.swa_len
            node.lock_ref += 1
            node = node.parent

    def dec_lock_ref(self, node: TreeNode | None) -> None:
        """Release a lock `inc_lock_ref(node)` took."""
        while node is not self.root and node is not None:
            if node.lock_ref <= 0:
                raise RuntimeError("radix cache lock released more often than taken")
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._evictable += len(node.key)
                self._protected -= len(node.key)
                if self.window is not None:
                    self._swa_evictable += node.swa_len
                    self._swa_protected -= node.swa_len
            node = node.parent

    # ---- eviction
    def evict(self, num_tokens: int, swa_tokens: int = 0) -> int:
        """Free at least `num_tokens` full slots (and, two-pool cache, `swa_tokens` SWA slots) from
        unlocked leaves, least recently used first (or as many as possible). Returns the number of
        full slots freed. SWA slots no match can read are freed first (`evict_swa`)."""
        if self.disable:
            return 0
        if swa_tokens > 0 and self.window is not None:
            swa_tokens -= self.evict_swa(swa_tokens)
        if num_tokens <= 0 and swa_tokens <= 0:
            return 0
        leaves = [n for n in self._nodes() if not n.children and n.lock_ref == 0]
        heapq.heapify(leaves)
        freed = swa_freed = 0
        while (freed < num_tokens or swa_freed < swa_tokens) and leaves:
            leaf = heapq.heappop(leaves)
            parent = leaf.parent
            assert parent is not None and leaf.value is not None
            self._free_kv(leaf.value, leaf.swa_freed)
            freed += len(leaf.key)
            self._evictable -= len(leaf.key)
            if self.window is not None:
                swa_freed += leaf.swa_len
                self._swa_evictable -= leaf.swa_len
            del parent.children[leaf.key[0]]
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(leaves, parent)
        return freed

    def evict_swa(self, num_tokens: int) -> int:
        """Two-pool cache: free up to `num_tokens` SWA slots of unlocked nodes that only a match
        ending inside the node could read (all but each node's last window - 1 tokens), least
        recently used first. Full slots stay cached. Returns the SWA slots freed."""
        if self.window is None or num_tokens <= 0:
            return 0
        keep = self.window - 1
        nodes = sorted(n for n in self._nodes() if n.lock_ref == 0 and n.swa_len > keep)
        freed = 0
        for node in nodes:
            if freed >= num_tokens:
                break
            upto = min(len(node.key) - keep, node.swa_freed + num_tokens - freed)
            freed += self._free_node_swa(node, upto)
        return freed

    def _free_node_swa(self, node: TreeNode, upto: int) -> int:
        """Free the SWA slots of `node`'s tokens swa_freed .. upto - 1; returns how many."""
        n = upto - node.swa_freed
        if n <= 0:
            return 0
        assert node.value is not None and isinstance(self.allocator, SWATokenToKVPoolAllocator)
        self.allocator.free_swa(node.value[node.swa_freed : upto])
        node.swa_freed = upto
        if node.lock_ref == 0:
            self._swa_evictable -= n
        else:
            self._swa_protected -= n
        return n

    def _free_kv(self, slots: torch.Tensor, swa_freed: int) -> None:
        """Free full slots (and, two-pool cache, their SWA slots but for the first `swa_freed`,
        which gave theirs back already: host-side knowledge, so nothing reads the device)."""
        if isinstance(self.allocator, SWATokenToKVPoolAllocator):
            self.allocator.free(slots, swa_freed)
        else:
            self.allocator.free(slots)

    def release_swa_before(self, node: TreeNode | None, position: int) -> None:
        """Two-pool cache: a request whose cached prefix ends at `node` no longer needs SWA K/V
        before `position`; free it in the nodes of that path no other request holds (lock_ref 1).
        Keeps a long (chunked) prompt from holding the SWA slots of its whole prefix."""
        if self.window is None or node is None or node is self.root:
            return
        path = []
        while node is not None and node is not self.root:
            path.append(node)
            node = node.parent
        start = 0
        for n in reversed(path):
            end = start + len(n.key)
            if start >= position:
                break
            if n.lock_ref == 1:
                self._free_node_swa(n, min(end, position) - start)
            start = end

    def _nodes(self) -> list[TreeNode]:
        out, stack = [], [self.root]
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            if node is not self.root:
                out.append(node)
        return out

    # ---- request lifecycle
    def cache_finished_req(self, req: CachedReq, insert: bool = True) -> None:
        """Hand a finished (or retracted) request's KV to the tree, free its request slot. With
        `insert=False` (KV computed with weights since replaced) the request's own KV is freed."""
        slot = req.req_pool_idx
        assert slot is not None
        kv = self.req_to_token_pool.req_to_token[slot, : req.kv_len].clone()
        prefix_len = len(req.prefix_indices)
        own_swa_freed = req.swa_evicted_len - prefix_len  # own tokens that gave their SWA slot back
        if self.disable:
            self._free_kv(kv, req.swa_evicted_len)
        elif self.retired or not insert:
            self._free_kv(kv[prefix_len:], own_swa_freed)
            self.dec_lock_ref(req.last_node)
            if self.retired:
                self.evict(self.evictable_size())
        else:
            tokens = req.all_token_ids()[: req.kv_len]
            cached = self.insert(tokens, kv, req.swa_evicted_len)
            self._free_kv(kv[prefix_len:cached], own_swa_freed)
            self.dec_lock_ref(req.last_node)
        self.req_to_token_pool.free(slot)
        req.req_pool_idx = None
        req.prefix_indices = torch.empty(0, dtype=torch.int64)
        req.last_node = None
        req.swa_evicted_len = 0

    def cache_unfinished_req(self, req: CachedReq) -> None:
        """After a prompt chunk: publish its KV in the tree and move the request's lock forward
        (in a retired tree the request simply keeps its KV). Two-pool cache: the SWA K/V the next
        chunk cannot see is freed, and if the tree's copy of these tokens has lost SWA K/V the next
        chunk needs, the request keeps its own KV instead."""
        if self.disable or self.retired:
            return
        slot = req.req_pool_idx
        assert slot is not None
        tokens = req.all_token_ids()[: req.kv_len]
        if self.window is not None and self._lacks_swa(tokens, req.kv_len - self.window + 1):
            return
        kv = self.req_to_token_pool.req_to_token[slot, : req.kv_len].clone()
        prefix_len = len(req.prefix_indices)
        cached = self.insert(tokens, kv, req.swa_evicted_len)
        self._free_kv(kv[prefix_len:cached], req.swa_evicted_len - prefix_len)
        indices, node = self.match_prefix(tokens)
        self.req_to_token_pool.write(slot, prefix_len, indices[prefix_len:])
        self.dec_lock_ref(req.last_node)
        self.inc_lock_ref(node)
        req.prefix_indices = indices
        req.last_node = node
        if self.window is not None:
            dead = max(0, req.kv_len - self.window + 1)
            self.release_swa_before(node, dead)
            req.swa_evicted_len = max(req.swa_evicted_len, dead)

    def _lacks_swa(self, key: list[int], start: int) -> bool:
        """Has a cached node lost the SWA slot of a token of `key` at a position >= `start`?"""
        node, pos = self.root, 0
        while pos < len(key) and key[pos] in node.children:
            node = node.children[key[pos]]
            n = _common_len(node.key, key[pos:])
            if node.swa_freed and pos + min(node.swa_freed, n) > start:
                return True
            pos += n
            if n < len(node.key):
                break
        return False


def _common_len(a: list[int], b: list[int]) -> int:
    """Length of the common prefix of `a` and `b`. List slices compare in C: a whole-key match (the
    common case: a request walking the nodes of its own prompt) costs one comparison, a mismatch
    a bisection over slices and at most 32 single steps."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo]; the first difference lies before hi
    while hi - lo > 32:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    while a[lo] == b[lo]:
        lo += 1
    return lo
