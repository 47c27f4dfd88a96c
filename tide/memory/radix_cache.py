"""Prefix cache over KV slots: a radix tree keyed by token ids (one KV slot per token).

Invariants:
- A node's `value` holds the KV slots of its `key` tokens; the tree owns those slots until evicted.
- `lock_ref > 0` on a node means a running request uses it (and so all its ancestors); locked nodes are
  never evicted. `evictable_size() + protected_size()` equals the number of slots the tree holds.
- With `disable=True` nothing is cached: requests free all their KV when they finish.
- A `retired` tree (its KV predates the current weights) takes no new entries: finishing requests
  free their own KV, and its nodes are freed as their last user lets go. It is never matched.
"""

from __future__ import annotations

import heapq
import itertools
from typing import Protocol

import torch

from tide.memory.pools import ReqToTokenPool, TokenToKVPoolAllocator

_clock = itertools.count()


class CachedReq(Protocol):
    """What the tree reads and updates on a request (the scheduler's `Req`): its request slot, how
    many of its tokens have KV, and the cached prefix it has locked."""

    req_pool_idx: int | None
    kv_len: int
    prefix_indices: torch.Tensor
    last_node: TreeNode | None

    def all_token_ids(self) -> list[int]: ...


class TreeNode:
    __slots__ = ("children", "parent", "key", "value", "lock_ref", "last_access")

    def __init__(self, parent: "TreeNode | None" = None) -> None:
        self.children: dict[int, TreeNode] = {}
        self.parent = parent
        self.key: list[int] = []
        self.value: torch.Tensor | None = None
        self.lock_ref = 0
        self.last_access = next(_clock)

    def __lt__(self, other: "TreeNode") -> bool:
        return self.last_access < other.last_access


class RadixCache:
    def __init__(
        self,
        req_to_token_pool: ReqToTokenPool,
        token_to_kv_allocator: TokenToKVPoolAllocator,
        disable: bool = False,
    ) -> None:
        self.req_to_token_pool = req_to_token_pool
        self.allocator = token_to_kv_allocator
        self.disable = disable
        self.retired = False
        self.reset()

    def reset(self) -> None:
        self.root = TreeNode()
        self.root.lock_ref = 1
        self._evictable = 0
        self._protected = 0

    # ---- sizes
    def evictable_size(self) -> int:
        return self._evictable

    def protected_size(self) -> int:
        return self._protected

    def total_size(self) -> int:
        return self._evictable + self._protected

    # ---- lookup and insert
    def match_prefix(self, key: list[int]) -> tuple[torch.Tensor, TreeNode]:
        """KV slots of the longest cached prefix of `key`, and the node that ends it."""
        empty = torch.empty(0, dtype=torch.int64, device=self.allocator.device)
        if self.disable or not key:
            return empty, self.root
        node = self.root
        values: list[torch.Tensor] = []
        while key and key[0] in node.children:
            child = node.children[key[0]]
            child.last_access = next(_clock)
            n = _common_len(child.key, key)
            if n < len(child.key):
                child = self._split(child, n)
            values.append(child.value)  # type: ignore[arg-type]
            node = child
            key = key[n:]
        return (torch.cat(values) if values else empty), node

    def insert(self, key: list[int], value: torch.Tensor) -> int:
        """Insert key -> value; returns how many leading tokens were already cached (their slots in
        `value` are duplicates the caller must free)."""
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
            node = node.parent

    # ---- eviction
    def evict(self, num_tokens: int) -> int:
        """Free at least `num_tokens` slots from unlocked leaves, least recently used first (or as many
        as possible). Returns the number freed."""
        if self.disable or num_tokens <= 0:
            return 0
        leaves = [n for n in self._nodes() if not n.children and n.lock_ref == 0]
        heapq.heapify(leaves)
        freed = 0
        while freed < num_tokens and leaves:
            leaf = heapq.heappop(leaves)
            parent = leaf.parent
            assert parent is not None and leaf.value is not None
            self.allocator.free(leaf.value)
            freed += len(leaf.key)
            self._evictable -= len(leaf.key)
            del parent.children[leaf.key[0]]
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(leaves, parent)
        return freed

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
        if self.disable:
            self.allocator.free(kv)
        elif self.retired or not insert:
            self.allocator.free(kv[prefix_len:])
            self.dec_lock_ref(req.last_node)
            if self.retired:
                self.evict(self.evictable_size())
        else:
            tokens = req.all_token_ids()[: req.kv_len]
            cached = self.insert(tokens, kv)
            self.allocator.free(kv[prefix_len:cached])
            self.dec_lock_ref(req.last_node)
        self.req_to_token_pool.free(slot)
        req.req_pool_idx = None
        req.prefix_indices = torch.empty(0, dtype=torch.int64)
        req.last_node = None

    def cache_unfinished_req(self, req: CachedReq) -> None:
        """After a prompt chunk: publish its KV in the tree and move the request's lock forward
        (in a retired tree the request simply keeps its KV)."""
        if self.disable or self.retired:
            return
        slot = req.req_pool_idx
        assert slot is not None
        tokens = req.all_token_ids()[: req.kv_len]
        kv = self.req_to_token_pool.req_to_token[slot, : req.kv_len].clone()
        prefix_len = len(req.prefix_indices)
        cached = self.insert(tokens, kv)
        self.allocator.free(kv[prefix_len:cached])
        indices, node = self.match_prefix(tokens)
        self.req_to_token_pool.write(slot, prefix_len, indices[prefix_len:])
        self.dec_lock_ref(req.last_node)
        self.inc_lock_ref(node)
        req.prefix_indices = indices
        req.last_node = node


def _common_len(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
