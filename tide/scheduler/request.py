"""One generation request as the scheduler sees it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from tide.sampling_params import SamplingParams

if TYPE_CHECKING:
    from concurrent.futures import Future

    from tide.detokenizer import IncrementalDetokenizer
    from tide.grammar import RequestGrammar
    from tide.memory.radix_cache import RadixCache, TreeNode

# Why a request ended (sglang's shape): {"type": "stop", "matched": token id or stop string},
# {"type": "length", "length": n}, or {"type": "abort", "message": why}.
FinishReason = dict[str, str | int]


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
    # Input logprobs (sglang's `logprob_start_len`) from this prompt position on; -1: none. With
    # `return_logprob`, the prompt's tokens at positions >= it get their logprob under the model's
    # prediction from the tokens before them (the first prompt token has none: None).
    logprob_start_len: int = -1
    output_ids: list[int] = field(default_factory=list)
    finished_reason: FinishReason | None = None
    # KV state
    req_pool_idx: int | None = None
    prefix_indices: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))
    last_node: TreeNode | None = None
    tree: RadixCache | None = None  # the tree that holds `last_node` (it may have been retired since)
    kv_epoch: int = 0  # the scheduler's KV epoch when this request's KV was started
    kv_len: int = 0
    # Two-pool KV cache: the SWA K/V of positions before this is given back (out of every future
    # query's window); the request's own SWA slots are kv_len - max(len(prefix_indices), this).
    swa_evicted_len: int = 0
    # accounting
    cached_tokens: int = 0
    weight_version: str | None = None  # the engine's weight version when the request finished
    num_retractions: int = 0
    output_token_logprobs: list[tuple[float, int]] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)
    # One entry per prompt position from `logprob_start_len` on, filled as the prefill runs.
    input_token_logprobs: list[tuple[float | None, int]] = field(default_factory=list)
    input_top_logprobs: list[list[tuple[float, int]] | None] = field(default_factory=list)
    # Decodes the output as it grows, to find stop strings (set by the scheduler when there are any).
    stop_detokenizer: IncrementalDetokenizer | None = None
    # The tokens that would end it (eos unless ignored, its stop_token_ids), banned until it has
    # `min_new_tokens` (set by the scheduler where that is > 0; empty otherwise).
    ending_ids: tuple[int, ...] = ()
    # Constrained decoding: its grammar compiling (while it waits in the scheduler's
    # `grammar_queue`), then its matcher, which every sampled token advances.
    grammar_future: Future | None = None
    grammar_deadline: float = 0.0  # time.monotonic() by which it must have compiled
    grammar: RequestGrammar | None = None

    def all_token_ids(self) -> list[int]:
        return self.origin_input_ids + self.output_ids

    @property
    def seq_len(self) -> int:
        return len(self.origin_input_ids) + len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.finished_reason is not None

    @property
    def argmax_only(self) -> bool:
        """Its next token is the argmax of the logits: greedy, no logit edits, no logprobs (and
        no ending token banned: none to ban, or `min_new_tokens` reached)."""
        p = self.sampling_params
        return (p.is_greedy and not p.edits_logits and not self.return_logprob
                and (not self.ending_ids or len(self.output_ids) >= p.min_new_tokens))

    @property
    def wants_input_logprobs(self) -> bool:
        return self.return_logprob and 0 <= self.logprob_start_len < len(self.origin_input_ids)

    def input_score_first(self) -> int | None:
        """The first prompt position whose logits the prefill must still score (its prediction of
        the next prompt token), or None when no input logprob is pending. Entries come in position
        order, so this moves on as chunks are scored."""
        if not self.wants_input_logprobs:
            return None
        start = self.logprob_start_len
        # Entries cover positions start, start+1, ...; the entry for position p comes from the
        # logits at p - 1 (position 0 has none: its entry is None and needs no logits).
        next_position = start + len(self.input_token_logprobs)
        if next_position >= len(self.origin_input_ids):
            return None
        return max(next_position, 1) - 1

    def remaining_new_tokens(self) -> int:
        return self.sampling_params.max_new_tokens - len(self.output_ids)

    def reset_for_retract(self) -> None:
        self.kv_len = 0
        self.swa_evicted_len = 0
        self.num_retractions += 1
        if self.input_score_first() is not None:
            # Retracted mid-prompt: its prompt is recomputed, maybe with new weights (a pause that
            # retracts, then an update), so its input logprobs are all scored again.
            self.input_token_logprobs.clear()
            self.input_top_logprobs.clear()
