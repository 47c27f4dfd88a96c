"""Two-pool KV cache for hybrid models (full-attention layers next to sliding-window layers).

Full-attention layers keep every token's K/V, so they live in the full pool (one slot per token, the
slot numbers the scheduler, the request table and the radix cache speak). Sliding-window layers only
ever read the last `window` tokens of a sequence, so they live in a smaller SWA pool; each full slot
that has SWA K/V maps to its SWA slot through `full_to_swa_index_mapping`, a device tensor (int32,
entry 0 and every freed entry are 0: SWA slot 0 is the reserved dummy slot, never handed out).

Invariants:
- `SWATokenToKVPoolAllocator.alloc(n)` takes n slots from both pools at once and records the mapping;
  `free(full_slots, swa_freed)` gives back both (the SWA slot of all but the first `swa_freed`),
  `free_swa` gives back only the SWA slots of tokens no query can see any more and zeroes their
  mapping.
- Which full slots still hold an SWA slot is known on the host (`Req.swa_evicted_len`,
  `TreeNode.swa_freed`: always a prefix of a request's own tokens or of a node), and the callers
  pass it in; freeing never reads the device (no boolean mask, `.item()`, `nonzero`: each would wait
  for the GPU, which the overlap schedule keeps a step ahead). A wrong count shows as a free/held
  mismatch in `Scheduler.check_invariants`; `check_consistency` (tests) reads the device to verify
  every slot.
- Every SWA slot is in exactly one place: the SWA free list, a live request's window, or a
  radix-cache node's window (`RadixCache` with `window` set counts them).
- `SWAKVPool.k_buffer[l]` / `v_buffer[l]` hold layer l's K/V: full-pool rows for full layers,
  SWA-pool rows for sliding layers. A sliding layer writes at SWA slots translated once per forward
  (`ForwardBatch.out_cache_loc_swa`) and reads through `ReqToTokenPool.req_to_token_swa`, the request
  table in SWA slots (filled as the first table is written); nothing translates per layer.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from tide.memory.pools import TokenToKVPoolAllocator, to_kv_dtype

if TYPE_CHECKING:
    from tide.memory.vmm import VmmRegion


def swa_page(window: int) -> int:
    """Out-of-window SWA slots are given back in runs of this many tokens, so a decoding request
    holds at most window + swa_page(window) of them."""
    return max(1, min(64, window // 8))


def min_swa_tokens(window: int) -> int:
    """The smallest SWA pool that always lets one request make progress (its window, one run of
    out-of-window slots not yet given back, and the token being computed)."""
    return window + swa_page(window) + 1


def swa_pool_sizes(budget_bytes: float, full_bytes_per_token: int, swa_bytes_per_token: int,
                   swa_full_tokens_ratio: float) -> tuple[int, int]:
    """(full tokens, SWA tokens) that fit `budget_bytes` when the SWA pool holds
    `swa_full_tokens_ratio` slots per full slot. `*_bytes_per_token`: K+V bytes of one token over
    all full (resp. sliding) layers."""
    if not 0.0 < swa_full_tokens_ratio <= 1.0:
        raise ValueError(f"swa_full_tokens_ratio must be in (0, 1], got {swa_full_tokens_ratio}")
    per_full_token = full_bytes_per_token + swa_full_tokens_ratio * swa_bytes_per_token
    full = int(budget_bytes // per_full_token) if per_full_token > 0 else 0
    return full, int(full * swa_full_tokens_ratio)


class SWATokenToKVPoolAllocator:
    """Hands out full slots, each with an SWA slot behind it (see the module invariants).

    Speaks the `TokenToKVPoolAllocator` interface in full-slot numbers, so the scheduler and the radix
    cache use it unchanged; `available_size()` is what both pools can still give (the smaller)."""

    def __init__(self, size: int, size_swa: int, device: torch.device | str) -> None:
        if size_swa < 1:
            raise ValueError(f"the SWA pool needs at least one slot, got {size_swa}")
        self.size = size
        self.size_swa = size_swa
        self.device = torch.device(device)
        self.full = TokenToKVPoolAllocator(size, device)
        self.swa = TokenToKVPoolAllocator(size_swa, device)
        self.full_to_swa_index_mapping = torch.zeros(size + 1, dtype=torch.int32, device=device)

    def clear(self) -> None:
        self.full.clear()
        self.swa.clear()
        self.full_to_swa_index_mapping.zero_()

    def available_size(self) -> int:
        return min(self.full.available_size(), self.swa.available_size())

    def full_available_size(self) -> int:
        return self.full.available_size()

    def swa_available_size(self) -> int:
        return self.swa.available_size()

    def alloc(self, n: int) -> torch.Tensor | None:
        """n full slots (int64), each mapped to a fresh SWA slot; None if either pool is short."""
        if n > self.full.available_size() or n > self.swa.available_size():
            return None
        full = self.full.alloc(n)
        swa = self.swa.alloc(n)
        if full is None or swa is None:  # cannot happen after the size check
            raise RuntimeError("KV allocator sizes out of step")
        self.full_to_swa_index_mapping[full] = swa.to(torch.int32)
        return full

    def free(self, slots: torch.Tensor, swa_freed: int = 0) -> None:
        """Give back full slots and their SWA slots. The first `swa_freed` of `slots` already gave
        their SWA slot back (`free_swa`); every later one must still hold one. Never syncs."""
        if not slots.numel():
            return
        self.free_swa(slots[max(0, swa_freed):])
        self.full.free(slots)

    def free_swa(self, slots: torch.Tensor) -> None:
        """Give back the SWA slots of these full slots, each of which must still hold one (the
        caller knows which do from host-side bookkeeping). One device gather and one scatter,
        queued on the stream: nothing waits for the device, so the overlap schedule may call it
        while a step is in flight (the freed slots are reused only by a later forward)."""
        if not slots.numel():
            return
        slots = slots.to(torch.int64)
        self.swa.free(self.full_to_swa_index_mapping[slots].to(torch.int64))
        # index_fill_ takes the 0 as a kernel argument: `mapping[slots] = 0` would first copy a
        # host scalar tensor to the device, which waits for the stream.
        self.full_to_swa_index_mapping.index_fill_(0, slots, 0)

    def check_consistency(self) -> None:
        """Raise unless every SWA slot is exactly once either free or mapped from one full slot, no
        free list holds slot 0 or a slot twice, and no free full slot keeps a mapping. Reads the
        whole mapping back from the device: for tests, never on the serving path."""
        for name, pool, size in (("full", self.full, self.size), ("swa", self.swa, self.size_swa)):
            free = pool.all_free_slots().cpu()
            if free.numel() and (int(free.min()) < 1 or int(free.max()) > size):
                raise RuntimeError(f"{name} free list holds a slot outside 1..{size}")
            if torch.unique(free).numel() != free.numel():
                raise RuntimeError(f"{name} free list holds a slot twice")
        mapping = self.full_to_swa_index_mapping.cpu().to(torch.int64)
        if int(mapping[0]) != 0:
            raise RuntimeError("full slot 0 maps to an SWA slot")
        if int(mapping[self.full.all_free_slots().cpu()].abs().sum()) != 0:
            raise RuntimeError("a free full slot still maps to an SWA slot")
        mapped = mapping[mapping != 0]
        owners = torch.cat([mapped, self.swa.all_free_slots().cpu()])
        if torch.unique(owners).numel() != owners.numel() or owners.numel() != self.size_swa:
            raise RuntimeError(
                f"SWA slots: {mapped.numel()} mapped + {self.swa.available_size()} free != "
                f"{self.size_swa} distinct slots (one freed twice, leaked, or mapped twice)")


class SWAKVPool:
    """Per-layer K/V of a hybrid model: full layers in `size + 1` rows, sliding layers in
    `size_swa + 1` rows (row 0 of each is the dummy slot padded writes go to).

    `translate` (the registered full→SWA mapping) turns full slots into SWA slots; the model runner
    calls it once per forward, for the new tokens (`ForwardBatch.out_cache_loc_swa`)."""

    def __init__(self, size: int, size_swa: int, sliding: Sequence[bool], num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device | str,
                 region: "VmmRegion | None" = None) -> None:
        self.size = size
        self.size_swa = size_swa
        self.dtype = dtype
        self.device = torch.device(device)
        self.region = region
        self.swa_layer_ids = tuple(i for i, s in enumerate(sliding) if s)
        self.full_layer_ids = tuple(i for i, s in enumerate(sliding) if not s)
        self._sliding = [bool(s) for s in sliding]
        self._mapping: torch.Tensor | None = None
        self.num_translations = 0  # translate() calls (tests check: once per forward, not per layer)

        def buffer(rows: int) -> torch.Tensor:
            shape = (rows, num_kv_heads, head_dim)
            if region is None:
                return torch.zeros(shape, dtype=dtype, device=device)
            return region.tensor(shape, dtype).zero_()

        rows = [size_swa + 1 if s else size + 1 for s in self._sliding]
        self.k_buffer = [buffer(r) for r in rows]
        self.v_buffer = [buffer(r) for r in rows]

    @staticmethod
    def layer_shapes(size: int, size_swa: int, sliding: Sequence[bool], num_kv_heads: int,
                     head_dim: int, dtype: torch.dtype) -> list[tuple[tuple[int, ...], torch.dtype]]:
        """The shapes of every K and V buffer, in allocation order (for sizing a VMM region)."""
        shapes: list[tuple[tuple[int, ...], torch.dtype]] = [
            ((size_swa + 1 if s else size + 1, num_kv_heads, head_dim), dtype) for s in sliding]
        return shapes * 2

    def register_mapping(self, mapping: torch.Tensor) -> None:
        """Use the allocator's device-side full→SWA mapping (must be done before any forward and
        before CUDA-graph capture)."""
        if mapping.dtype != torch.int32 or mapping.numel() != self.size + 1:
            raise ValueError("full_to_swa mapping must be int32 with size + 1 entries")
        self._mapping = mapping

    def is_swa_layer(self, layer_id: int) -> bool:
        return self._sliding[layer_id]

    def translate(self, full_slots: torch.Tensor) -> torch.Tensor:
        """SWA slots (int32) of full slots, one device gather; 0 where none is mapped."""
        if self._mapping is None:
            raise RuntimeError("SWAKVPool: register_mapping must be called before a forward")
        self.num_translations += 1
        return self._mapping[full_slots.to(torch.int64)]

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        return self.k_buffer[layer_id]

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        return self.v_buffer[layer_id]

    def set_kv_buffer(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor,
                      v: torch.Tensor) -> None:
        """`loc`: slots of this layer's pool (SWA slots for a sliding layer)."""
        self.k_buffer[layer_id][loc] = to_kv_dtype(k, self.dtype)
        self.v_buffer[layer_id][loc] = to_kv_dtype(v, self.dtype)
