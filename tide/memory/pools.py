"""KV memory: request slots, token slots, and the per-layer K/V buffers.

Invariants:
- `ReqToTokenPool`: a request slot is either free or owned by exactly one live request; row `r` maps the
  positions of that request to KV slots.
- `TokenToKVPoolAllocator`: slots are 1..size; slot 0 is never handed out (padded writes go there). Every
  slot is in exactly one place: the free list, a running request, or the radix cache.
- `MHATokenToKVPool`: K/V of KV slot `s` for layer `l` live at `k_buffer[l][s]` / `v_buffer[l][s]`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from tide.memory.vmm import VmmRegion

# Largest finite float8_e4m3fn value: an fp8 KV cache saturates there (the Triton store does the same).
FP8_E4M3_MAX = 448.0


def to_kv_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`x` as the KV cache stores it: cast to `dtype`, saturating at +-448 for float8_e4m3fn."""
    if dtype == torch.float8_e4m3fn:
        x = x.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)
    return x.to(dtype)


class ReqToTokenPool:
    """`size` request slots plus one reserved dummy row (index `size`, all zeros: every position maps
    to KV slot 0) that padded batch rows point at. With `region`, the table is a view of that
    address-stable region (released and re-taken with the KV cache).

    With `swa=True` (a two-pool KV cache, see memory/swa.py) a second table, `req_to_token_swa`,
    holds the SWA-pool slot of every position, written with the first (`write`, and the decode step's
    `ForwardBatch.record_decode_slots`) through the registered full→SWA mapping, so sliding layers read
    SWA slots as full layers read full ones. Positions whose SWA slot was given back keep a stale
    entry there: no query's window reaches them."""

    def __init__(self, size: int, max_context_len: int, device: torch.device | str,
                 region: "VmmRegion | None" = None, swa: bool = False) -> None:
        self.size = size
        self.dummy_slot = size
        self.max_context_len = max_context_len
        self.device = torch.device(device)
        shape = (size + 1, max_context_len)

        def table() -> torch.Tensor:
            if region is None:
                return torch.zeros(shape, dtype=torch.int32, device=device)
            return region.tensor(shape, torch.int32).zero_()

        self.req_to_token = table()
        self.req_to_token_swa = table() if swa else None
        self._swa_mapping: torch.Tensor | None = None
        self.free_slots: list[int] = list(range(size))

    def register_swa_mapping(self, mapping: torch.Tensor) -> None:
        """The allocator's full→SWA slot map (int32), used by `write` to fill `req_to_token_swa`."""
        if self.req_to_token_swa is None:
            raise ValueError("register_swa_mapping needs a pool made with swa=True")
        self._swa_mapping = mapping

    def available_size(self) -> int:
        return len(self.free_slots)

    def alloc(self) -> int | None:
        return self.free_slots.pop() if self.free_slots else None

    def free(self, slot: int) -> None:
        if slot in self.free_slots or not 0 <= slot < self.size:
            raise RuntimeError(f"request slot {slot} freed twice or out of range")
        self.free_slots.append(slot)

    def write(self, slot: int, start: int, kv_slots: torch.Tensor) -> None:
        """Positions start.. of request slot `slot` live in full slots `kv_slots` (and in their SWA
        slots, two-pool cache: one gather through the mapping)."""
        end = start + kv_slots.numel()
        self.req_to_token[slot, start:end] = kv_slots
        if self.req_to_token_swa is not None:
            if self._swa_mapping is None:
                raise RuntimeError("ReqToTokenPool: register_swa_mapping before the first write")
            self.req_to_token_swa[slot, start:end] = self._swa_mapping[kv_slots.to(torch.int64)]

    def clear(self) -> None:
        self.free_slots = list(range(self.size))


class TokenToKVPoolAllocator:
    """Hands out KV slots. Free slots live in a device tensor so allocation never syncs the device.
    Freed slots wait in a short list of tensors that is folded into the free tensor (one device
    concatenation, no sync) when an allocation runs short or the list reaches `MAX_PENDING`
    tensors, so the host cost of counting and the list itself stay bounded however long the
    server runs (a hybrid model frees a few SWA slots per request every decode step)."""

    MAX_PENDING = 256

    def __init__(self, size: int, device: torch.device | str) -> None:
        self.size = size
        self.device = torch.device(device)
        self.clear()

    def clear(self) -> None:
        self.free_slots = torch.arange(1, self.size + 1, dtype=torch.int64, device=self.device)
        self._pending: list[torch.Tensor] = []
        self._pending_count = 0

    def available_size(self) -> int:
        return self.free_slots.numel() + self._pending_count

    def alloc(self, n: int) -> torch.Tensor | None:
        if n > self.free_slots.numel():
            self._merge_pending()
            if n > self.free_slots.numel():
                return None
        out = self.free_slots[:n]
        self.free_slots = self.free_slots[n:]
        return out

    def free(self, slots: torch.Tensor) -> None:
        if slots.numel():
            self._pending.append(slots.to(torch.int64))
            self._pending_count += slots.numel()
            if len(self._pending) >= self.MAX_PENDING:
                self._merge_pending()

    def _merge_pending(self) -> None:
        if self._pending:
            self.free_slots = torch.cat([self.free_slots, *self._pending])
            self._pending = []
            self._pending_count = 0

    def all_free_slots(self) -> torch.Tensor:
        self._merge_pending()
        return self.free_slots


class MHATokenToKVPool:
    def __init__(
        self,
        size: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        region: "VmmRegion | None" = None,
    ) -> None:
        """With `region`, the buffers are views of that address-stable region (see memory/vmm.py)."""
        self.size = size
        self.dtype = dtype
        self.device = torch.device(device)
        self.region = region
        shape = (size + 1, num_kv_heads, head_dim)

        def buffer() -> torch.Tensor:
            if region is None:
                return torch.zeros(shape, dtype=dtype, device=device)
            return region.tensor(shape, dtype).zero_()

        self.k_buffer = [buffer() for _ in range(num_layers)]
        self.v_buffer = [buffer() for _ in range(num_layers)]

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * dtype.itemsize

    def is_swa_layer(self, layer_id: int) -> bool:
        """One pool: no layer lives in a separate sliding-window pool (see memory/swa.py)."""
        return False

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        return self.k_buffer[layer_id]

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        return self.v_buffer[layer_id]

    def set_kv_buffer(
        self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        self.k_buffer[layer_id][loc] = to_kv_dtype(k, self.dtype)
        self.v_buffer[layer_id][loc] = to_kv_dtype(v, self.dtype)
