"""One generation request as the scheduler sees it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from tide.sampling_params import SamplingParams


@dataclass(eq=False)
class Req:
    """KV state invariant: positions [0, kv_len) of `all_token_ids()` have KV in the pool at
    `req_to_token[req_pool_idx, :kv_len]`; the first `len(prefix_indices)` of those belong to the radix
    cache (locked through `last_node`), the rest to this request."""

    rid: str
    origin_input_ids: list[int]
    sampling_params: SamplingParams
    return_logprob: bool = False
    top_logprobs_num: int = 0
    output_ids: list[int] = field(default_factory=list)
    finished_reason: dict[str, Any] | None = None
    # KV state
    req_pool_idx: int | None = None
    prefix_indices: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))
    last_node: Any = None
    tree: Any = None  # the RadixCache that holds `last_node` (it may have been retired since)
    kv_epoch: int = 0  # the scheduler's KV epoch when this request's KV was started
    kv_len: int = 0
    # accounting
    cached_tokens: int = 0
    weight_version: str | None = None  # the engine's weight version when the request finished
    stop_check_offset: int = 0  # output text before this offset was already searched for stops
    num_retractions: int = 0
    output_token_logprobs: list[tuple[float, int]] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)

    def all_token_ids(self) -> list[int]:
        return self.origin_input_ids + self.output_ids

    @property
    def seq_len(self) -> int:
        return len(self.origin_input_ids) + len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.finished_reason is not None

    def remaining_new_tokens(self) -> int:
        return self.sampling_params.max_new_tokens - len(self.output_ids)

    def reset_for_retract(self) -> None:
        self.kv_len = 0
        self.num_retractions += 1
