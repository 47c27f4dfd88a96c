"""Turns last-token logits into next tokens, per-request parameters applied row by row.

Order: penalties -> temperature -> top_k / top_p / min_p -> draw. Greedy rows take the argmax. A draw
is `argmax(probs / E)` with E ~ Exp(1): for a request with a `seed`, E comes from a generator seeded by
(seed, output position), so its tokens do not depend on what else is in the batch.

Returned logprobs are `log_softmax` of the logits after penalties and temperature (temperature 0 counts
as 1) and before any truncation: the distribution the model proposed at that temperature.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from tide.scheduler.request import Req

_SEED_MIX = 0x9E3779B97F4A7C15


@dataclass
class SampleOutput:
    next_ids: list[int]
    logprobs: list[float] | None
    top_logprobs: list[list[tuple[float, int]]] | None


class Sampler:
    def __init__(self, seed: int = 0) -> None:
        self.seed = seed
        self._generators: dict[torch.device, torch.Generator] = {}

    def _generator(self, device: torch.device) -> torch.Generator:
        gen = self._generators.get(device)
        if gen is None:
            gen = torch.Generator(device=device).manual_seed(self.seed)
            self._generators[device] = gen
        return gen

    @torch.no_grad()
    def __call__(self, logits: torch.Tensor, reqs: Sequence[Req],
                 greedy_ids: torch.Tensor | None = None) -> SampleOutput:
        """`greedy_ids`, when given, is each row's argmax of `logits` already computed (the decode
        graph leaves it); it is used when every row is greedy without penalties or logprobs."""
        logits = logits.float()
        if all(r.sampling_params.is_greedy and not r.return_logprob
               and not r.sampling_params.has_penalties for r in reqs):
            ids = greedy_ids if greedy_ids is not None else logits.argmax(dim=-1)
            return SampleOutput(ids.tolist(), None, None)
        if any(r.sampling_params.has_penalties for r in reqs):
            logits = apply_penalties(logits, reqs)
        temps = torch.tensor(
            [r.sampling_params.temperature or 1.0 for r in reqs], device=logits.device
        ).unsqueeze(1)
        scaled = logits / temps

        greedy = [r.sampling_params.is_greedy for r in reqs]
        next_ids = scaled.argmax(dim=-1)
        if not all(greedy):
            rows = [i for i, g in enumerate(greedy) if not g]
            sampled = self._draw(scaled[rows], [reqs[i] for i in rows])
            next_ids[rows] = sampled

        want_logprobs = any(r.return_logprob for r in reqs)
        logprobs = top = None
        if want_logprobs:
            logp = torch.log_softmax(scaled, dim=-1)
            logprobs = logp.gather(1, next_ids.unsqueeze(1)).squeeze(1).tolist()
            k = max(r.top_logprobs_num for r in reqs)
            if k > 0:
                vals, ids = logp.topk(k, dim=-1)
                vals_l, ids_l = vals.tolist(), ids.tolist()
                top = [
                    list(zip(vals_l[i][: r.top_logprobs_num], ids_l[i][: r.top_logprobs_num]))
                    for i, r in enumerate(reqs)
                ]
        return SampleOutput(next_ids.tolist(), logprobs, top)

    def _draw(self, scaled: torch.Tensor, reqs: list[Req]) -> torch.Tensor:
        probs = torch.softmax(scaled, dim=-1)
        probs = truncate(probs, reqs)
        noise = torch.empty_like(probs)
        for i, req in enumerate(reqs):
            seed = req.sampling_params.seed
            if seed is None:
                noise[i].exponential_(generator=self._generator(probs.device))
            else:
                step_seed = (seed * _SEED_MIX + len(req.output_ids)) % (2**63)
                gen = torch.Generator(device="cpu").manual_seed(step_seed)
                row = torch.empty(probs.shape[1]).exponential_(generator=gen)
                noise[i].copy_(row)
        return (probs / noise).argmax(dim=-1)


def truncate(probs: torch.Tensor, reqs: list[Req]) -> torch.Tensor:
    """Zero the probabilities that top_k, top_p or min_p exclude (the top token always survives)."""
    params = [r.sampling_params for r in reqs]
    if all(p.top_k == -1 and p.top_p == 1.0 and p.min_p == 0.0 for p in params):
        return probs
    device = probs.device
    vocab = probs.shape[1]
    sorted_p, order = probs.sort(dim=-1, descending=True)
    rank = torch.arange(vocab, device=device).unsqueeze(0)
    top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params], device=device)
    top_p = torch.tensor([p.top_p for p in params], device=device)
    min_p = torch.tensor([p.min_p for p in params], device=device)
    drop = rank >= top_k.unsqueeze(1)
    drop |= (sorted_p.cumsum(dim=-1) - sorted_p) > top_p.unsqueeze(1)
    drop |= sorted_p < (sorted_p[:, :1] * min_p.unsqueeze(1))
    drop[:, 0] = False
    sorted_p = sorted_p.masked_fill(drop, 0.0)
    return torch.zeros_like(probs).scatter_(1, order, sorted_p)


def apply_penalties(logits: torch.Tensor, reqs: Sequence[Req]) -> torch.Tensor:
    logits = logits.clone()
    vocab = logits.shape[1]
    for i, req in enumerate(reqs):
        p = req.sampling_params
        if not p.has_penalties:
            continue
        if p.frequency_penalty or p.presence_penalty:
            out = torch.tensor(req.output_ids, dtype=torch.int64, device=logits.device)
            counts = torch.bincount(out, minlength=vocab)[:vocab].float()
            logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).float()
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(req.all_token_ids(), dtype=torch.int64, device=logits.device)
            vals = logits[i, seen]
            logits[i, seen] = torch.where(
                vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty
            )
    return logits
