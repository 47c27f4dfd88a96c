"""Turns last-token logits into next tokens, per-request parameters applied row by row.

Order: penalties -> temperature -> top_k / top_p / min_p -> draw. Greedy rows take the argmax. A draw
is `argmax(probs / E)` with E ~ Exp(1): for a request with a `seed`, E comes from a generator seeded by
(seed, output position), so its tokens do not depend on what else is in the batch.

Returned logprobs are `log_softmax` of the logits after penalties and temperature (temperature 0 counts
as 1) and before any truncation: the distribution the model proposed at that temperature.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tide.layers import batch_invariant
from tide.sampling_params import SamplingParams

_SEED_MIX = 0x9E3779B97F4A7C15


@dataclass(frozen=True, slots=True)
class SamplingBatchInfo:
    """The sampling arguments of a batch of logits rows: entry i of every list belongs to row i.

    `argmax_only`: every row is greedy, without penalties or logprobs, so the sampler takes the argmax
    and reads nothing else (`ARGMAX_ONLY` is that batch, with empty lists, shared by every step).
    `output_ids[i]` / `prompt_ids[i]` are row i's generated tokens so far and its prompt (penalties; a
    seeded row draws with its output position). The lists are read, never changed.
    """

    params: list[SamplingParams]
    output_ids: list[list[int]]
    prompt_ids: list[list[int]]
    return_logprob: list[bool]
    top_logprobs_num: list[int]
    argmax_only: bool = False

    @property
    def size(self) -> int:
        return len(self.params)

    def row(self, i: int) -> SamplingBatchInfo:
        """Row i alone."""
        return SamplingBatchInfo([self.params[i]], [self.output_ids[i]], [self.prompt_ids[i]],
                                 [self.return_logprob[i]], [self.top_logprobs_num[i]])


ARGMAX_ONLY = SamplingBatchInfo([], [], [], [], [], argmax_only=True)


@dataclass
class SampleOutput:
    """Row i's next token, and its logprob and top logprobs when any row asked for them. `failed`:
    rows that could not be sampled (their entries are placeholders), with the error."""

    next_ids: list[int]
    logprobs: list[float] | None
    top_logprobs: list[list[tuple[float, int]]] | None
    failed: dict[int, str] | None = None


class Sampler:
    def __init__(self, seed: int = 0, deterministic: bool = False) -> None:
        """`deterministic` (`enable_deterministic_inference`): on CUDA, log_softmax and the draw's
        probabilities come from the one-program-per-row kernel and top-k/top-p/min-p truncation runs
        row by row, so a row's logprob and (seeded) draw do not depend on the batch."""
        self.seed = seed
        self.deterministic = deterministic
        self._generators: dict[torch.device, torch.Generator] = {}

    def _generator(self, device: torch.device) -> torch.Generator:
        gen = self._generators.get(device)
        if gen is None:
            gen = torch.Generator(device=device).manual_seed(self.seed)
            self._generators[device] = gen
        return gen

    @torch.no_grad()
    def __call__(self, logits: torch.Tensor, info: SamplingBatchInfo,
                 greedy_ids: torch.Tensor | None = None) -> SampleOutput:
        """Next token of every row of `logits` [B, vocab] (row i sampled with entry i of `info`).
        `greedy_ids`, when given, is each row's argmax of `logits` already computed (the decode graph
        leaves it); it is used when `info.argmax_only`."""
        logits = logits.float()
        if info.argmax_only:
            ids = greedy_ids if greedy_ids is not None else logits.argmax(dim=-1)
            return SampleOutput(ids.tolist(), None, None)
        params = info.params
        if any(p.has_penalties for p in params):
            logits = apply_penalties(logits, info)
        temps = torch.tensor([p.temperature or 1.0 for p in params], device=logits.device).unsqueeze(1)
        scaled = logits / temps

        greedy = [p.is_greedy for p in params]
        next_ids = scaled.argmax(dim=-1)
        if not all(greedy):
            rows = [i for i, g in enumerate(greedy) if not g]
            sampled = self._draw(scaled[rows], [params[i] for i in rows],
                                 [len(info.output_ids[i]) for i in rows])
            next_ids[rows] = sampled

        logprobs = top = None
        if any(info.return_logprob):
            logp = self._log_softmax(scaled)
            logprobs = logp.gather(1, next_ids.unsqueeze(1)).squeeze(1).tolist()
            k = max(info.top_logprobs_num)
            if k > 0:
                vals, ids = logp.topk(k, dim=-1)
                vals_l, ids_l = vals.tolist(), ids.tolist()
                top = [list(zip(vals_l[i][:n], ids_l[i][:n]))
                       for i, n in enumerate(info.top_logprobs_num)]
        return SampleOutput(next_ids.tolist(), logprobs, top)

    def _draw(self, scaled: torch.Tensor, params: list[SamplingParams],
              positions: list[int]) -> torch.Tensor:
        """One draw per row; a seeded row draws with (seed, `positions[i]`: its output position)."""
        if self.deterministic and scaled.is_cuda:
            probs = self._log_softmax(scaled).exp()
            probs = torch.cat([truncate(probs[i : i + 1], params[i : i + 1])
                               for i in range(len(params))])
        else:
            probs = truncate(torch.softmax(scaled, dim=-1), params)
        noise = torch.empty_like(probs)
        for i, p in enumerate(params):
            if p.seed is None:
                noise[i].exponential_(generator=self._generator(probs.device))
            else:
                step_seed = (p.seed * _SEED_MIX + positions[i]) % (2**63)
                gen = torch.Generator(device="cpu").manual_seed(step_seed)
                row = torch.empty(probs.shape[1]).exponential_(generator=gen)
                noise[i].copy_(row)
        return (probs / noise).argmax(dim=-1)


    def _log_softmax(self, scaled: torch.Tensor) -> torch.Tensor:
        if self.deterministic:
            return batch_invariant.log_softmax(scaled)
        return torch.log_softmax(scaled, dim=-1)


def truncate(probs: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Zero the probabilities that top_k, top_p or min_p exclude (the top token always survives)."""
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


def apply_penalties(logits: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
    """A penalised copy of `logits`: frequency/presence over each row's output, then repetition
    over its prompt and output."""
    logits = logits.clone()
    vocab = logits.shape[1]
    for i, p in enumerate(info.params):
        if not p.has_penalties:
            continue
        if p.frequency_penalty or p.presence_penalty:
            out = torch.tensor(info.output_ids[i], dtype=torch.int64, device=logits.device)
            counts = torch.bincount(out, minlength=vocab)[:vocab].float()
            logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).float()
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(info.prompt_ids[i] + info.output_ids[i], dtype=torch.int64,
                                device=logits.device)
            vals = logits[i, seen]
            logits[i, seen] = torch.where(
                vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty
            )
    return logits
