"""The per-forward description of a batch that the model and attention backends read."""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from tide.memory.host_copy import device_tensor

if TYPE_CHECKING:
    from tide.layers.attention.base import AttentionBackend
    from tide.memory.pools import MHATokenToKVPool, ReqToTokenPool
    from tide.memory.swa import SWAKVPool


class ForwardMode(enum.Enum):
    EXTEND = "extend"  # prefill, possibly on top of a cached prefix, possibly one chunk of a prompt
    DECODE = "decode"  # exactly one new token per request


@dataclass
class ForwardBatch:
    """Flat token layout: the new tokens of request i are `input_ids[extend_start[i]:...+extend_lens[i]]`.

    Invariants: `seq_lens[i] == prefix_lens[i] + extend_lens[i]` (decode: extend_lens == 1);
    `req_to_token[req_pool_indices[i], :seq_lens[i]]` holds the KV slots of request i once the KV of the
    new tokens is written at `out_cache_loc`.
    """

    mode: ForwardMode
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    req_pool_indices: torch.Tensor  # [B] int64
    seq_lens: torch.Tensor  # [B] int64, on device
    out_cache_loc: torch.Tensor  # [T] int64
    req_to_token_pool: "ReqToTokenPool"
    token_to_kv_pool: "MHATokenToKVPool | SWAKVPool"
    attn_backend: "AttentionBackend"
    # Host copies: the scheduler knows these, so reading them never syncs the device.
    seq_lens_cpu: list[int] = field(default_factory=list)
    prefix_lens_cpu: list[int] = field(default_factory=list)
    extend_lens_cpu: list[int] = field(default_factory=list)
    # Where the model writes its logits, in its own dtype (CUDA graphs share one buffer); None: new
    # fp32 logits.
    logits_out: torch.Tensor | None = None
    # Hybrid models: the SWA-pool slots (int32) of `out_cache_loc`, translated once per forward
    # (`SWAKVPool.translate`); sliding layers write there. None for a single pool.
    out_cache_loc_swa: torch.Tensor | None = None
    # Input logprobs: flat rows whose final hidden states the model keeps in `scored_hidden` (the
    # runner turns them into logits a piece at a time); None: none.
    score_rows: torch.Tensor | None = None
    scored_hidden: torch.Tensor | None = None

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def is_decode(self) -> bool:
        return self.mode is ForwardMode.DECODE

    def cache_loc(self, layer_id: int) -> torch.Tensor:
        """Where layer `layer_id` writes the new tokens' K/V: SWA slots for a sliding layer of a
        two-pool cache, full slots otherwise."""
        if self.out_cache_loc_swa is not None and self.token_to_kv_pool.is_swa_layer(layer_id):
            return self.out_cache_loc_swa
        return self.out_cache_loc

    def req_to_token_for(self, layer_id: int) -> torch.Tensor:
        """The request table layer `layer_id` reads its keys through: SWA slots for a sliding layer
        of a two-pool cache (`req_to_token_swa`), full slots otherwise."""
        pool = self.req_to_token_pool
        if pool.req_to_token_swa is not None and self.token_to_kv_pool.is_swa_layer(layer_id):
            return pool.req_to_token_swa
        return pool.req_to_token

    def record_decode_slots(self) -> None:
        """req_to_token[req, position] = the new token's KV slot, for every row of a decode batch
        (padded rows write slot 0 into the dummy row, which keeps it all zeros); the same for the SWA
        slots in `req_to_token_swa` (two-pool cache)."""
        table = self.req_to_token_pool.req_to_token
        index = (self.req_pool_indices, self.positions)
        table.index_put_(index, self.out_cache_loc.to(table.dtype))
        swa_table = self.req_to_token_pool.req_to_token_swa
        if swa_table is not None:
            if self.out_cache_loc_swa is None:
                raise ValueError("a two-pool decode batch needs out_cache_loc_swa")
            swa_table.index_put_(index, self.out_cache_loc_swa.to(swa_table.dtype))

    def keep_scored_hidden(self, hidden: torch.Tensor) -> None:
        """Keep the final hidden states of `score_rows` (models call this before they select the
        last tokens)."""
        if self.score_rows is not None:
            self.scored_hidden = hidden.index_select(0, self.score_rows)

    def last_token_indices(self) -> torch.Tensor:
        """Index in the flat token layout of each request's last new token."""
        if self.is_decode:
            return torch.arange(self.batch_size, device=self.input_ids.device)
        ends = list(itertools.accumulate(self.extend_lens_cpu))
        return device_tensor([e - 1 for e in ends], torch.int64, self.input_ids.device)
