"""One step's batch: the requests the scheduler chose, and what a worker needs to run them."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tide.executor.forward_batch import ForwardMode
from tide.grammar import GrammarMasks
from tide.layers.sampler import ARGMAX_ONLY, PromptScoring, SamplingBatchInfo
from tide.scheduler.request import Req


@dataclass(slots=True, eq=False)
class ScheduleBatch:
    """`Scheduler.schedule()` picks `mode`, `reqs` and `extend_lens` (new tokens per request; 1 each
    for decode); `Scheduler.prepare()` gives the new tokens KV slots (`out_cache_loc`, in request
    order) and fills the model inputs; the worker runs it; `Scheduler.process_results()` applies the
    sampled tokens.

    Model inputs, flat over the new tokens: `input_ids`, `positions`; per request: `req_pool_indices`,
    `prefix_lens` (KV length before this step). `sample_rows`: the requests that get a token (extend:
    those whose prompt completes in this step; None: every request), `sampling` their arguments.
    `num_decode` (mixed chunk): the last `num_decode` requests of an extend batch are running
    requests decoding one token each alongside the prefill.
    `input_ids_device` (overlap schedule, decode only): the input ids as a device tensor, the
    previous step's sampled tokens that never went to the host; `input_ids` is then empty.
    `score` (extend only): the prompt rows whose input logprobs this step computes.
    """

    mode: ForwardMode
    reqs: list[Req]
    extend_lens: list[int]
    out_cache_loc: torch.Tensor | None = None
    input_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    req_pool_indices: list[int] = field(default_factory=list)
    prefix_lens: list[int] = field(default_factory=list)
    sample_rows: list[int] | None = None
    sampling: SamplingBatchInfo = ARGMAX_ONLY
    input_ids_device: torch.Tensor | None = None
    num_decode: int = 0
    # Input logprobs this extend computes (None: none), and how many of its rows belong to each
    # request, in request order.
    score: PromptScoring | None = None
    score_counts: list[int] = field(default_factory=list)

    @property
    def is_decode(self) -> bool:
        return self.mode is ForwardMode.DECODE

    def sampled_reqs(self) -> list[Req]:
        """The requests that get a token from this step, in the order of the sampled rows."""
        if self.sample_rows is None:
            return self.reqs
        return [self.reqs[i] for i in self.sample_rows]


def sampling_info(reqs: list[Req], output_offset: int = 0) -> SamplingBatchInfo:
    """The sampler's arguments for `reqs` (the shared `ARGMAX_ONLY` when each takes the argmax).
    `output_offset`: tokens each request has generated beyond its `output_ids` (see
    `SamplingBatchInfo`)."""
    if all(r.argmax_only for r in reqs):
        return ARGMAX_ONLY
    return SamplingBatchInfo(
        params=[r.sampling_params for r in reqs],
        output_ids=[r.output_ids for r in reqs],
        prompt_ids=[r.origin_input_ids for r in reqs],
        return_logprob=[r.return_logprob for r in reqs],
        top_logprobs_num=[r.top_logprobs_num for r in reqs],
        output_offset=output_offset,
        ending_ids=[r.ending_ids for r in reqs],
        grammar=_grammar_masks(reqs),
    )


def _grammar_masks(reqs: list[Req]) -> GrammarMasks | None:
    """The rows' allowed next tokens under their grammars (filled when the sampler asks), or None
    when no request has a grammar."""
    constrained = [(i, r.grammar) for i, r in enumerate(reqs) if r.grammar is not None]
    return GrammarMasks(len(reqs), constrained) if constrained else None
