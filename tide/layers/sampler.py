"""Turns last-token logits into next tokens, per-request parameters applied row by row.

Order: logit bias -> penalties -> temperature -> top_k / top_p / min_p -> draw. Greedy rows take the
argmax. A draw is `argmax(probs / E)` with E ~ Exp(1): for a request with a `seed`, E comes from a
generator on the logits' device seeded by (seed, output position), so its tokens do not depend on
what else is in the batch. Every step runs on that device; results leave it through `DeviceSample`.

On CUDA, a row with no logit bias, no penalties and no top logprobs (greedy, or temperature sampling
with or without top-k / top-p / min-p, as an RL rollout draws) takes `triton_ops.sample_rows`
instead: one pass over its logits that draws by the Gumbel-max rule (the same distribution,
argmax(log p - log E)) with E from Philox keyed by (seed, output position), or by a per-step seed
from the sampler's own generator when the request has none, and computes the token's logprob on the
way. The other path reads and writes the vocabulary-wide rows about ten times (cast, scale, softmax,
noise, divide, argmax, log_softmax), and sorts them to truncate. Truncated rows first find, without
sorting, the order-key floor and min score of their kept tokens (`triton_ops.truncation_bounds`: 8
more passes for bf16 logits, 11 for fp32), and the draw skips the rest. Which path a row takes
depends on its own parameters only, so a seeded row's tokens still do not depend on its batch; the
two paths draw from different random streams.

Returned logprobs are `log_softmax` of the logits after logit bias, penalties and temperature
(temperature 0 counts as 1) and before any truncation: the distribution the model proposed at that
temperature.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

import torch

from tide.grammar import GrammarMasks, apply_bitmask
from tide.layers import batch_invariant
from tide.memory.host_copy import device_tensor
from tide.sampling_params import SamplingParams

_SEED_MIX = 0x9E3779B97F4A7C15
_STREAM_MIX = 0xD1B54A32D192ED03  # odd: distinct streams give distinct seeds (mod 2**63)


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
    # Tokens each row has generated beyond `output_ids` (1 while the overlap scheduler still has the
    # previous step's token on the device): a seeded row draws with output position
    # len(output_ids[i]) + output_offset. Penalties need the tokens themselves and never overlap.
    output_offset: int = 0
    # Per row, the tokens that would end it (eos unless ignored, its stop_token_ids), given where it
    # asks for `min_new_tokens`: they are banned while its output is shorter (empty: none given).
    ending_ids: list[tuple[int, ...]] = field(default_factory=list)
    # Constrained decoding: row i may draw only the tokens its grammar allows (`tide.grammar`;
    # every token for rows without one). None: no row has one.
    grammar: GrammarMasks | None = None

    @property
    def size(self) -> int:
        return len(self.params)

    def output_position(self, i: int) -> int:
        return len(self.output_ids[i]) + self.output_offset

    def bans_endings(self, i: int) -> bool:
        """Whether row i's ending tokens are banned at this step (`min_new_tokens` not reached)."""
        return (i < len(self.ending_ids) and bool(self.ending_ids[i])
                and self.output_position(i) < self.params[i].min_new_tokens)

    def edits_row(self, i: int) -> bool:
        """Whether row i's logits are changed before sampling at this step."""
        return self.params[i].edits_logits or self.bans_endings(i)

    def row(self, i: int) -> SamplingBatchInfo:
        """Row i alone."""
        return self.select([i])

    def select(self, rows: list[int]) -> SamplingBatchInfo:
        """The rows `rows`, in that order."""
        return SamplingBatchInfo([self.params[i] for i in rows], [self.output_ids[i] for i in rows],
                                 [self.prompt_ids[i] for i in rows],
                                 [self.return_logprob[i] for i in rows],
                                 [self.top_logprobs_num[i] for i in rows],
                                 output_offset=self.output_offset,
                                 ending_ids=[self.ending_ids[i] for i in rows]
                                 if self.ending_ids else [],
                                 grammar=None if self.grammar is None
                                 else self.grammar.select(rows))


ARGMAX_ONLY = SamplingBatchInfo([], [], [], [], [], argmax_only=True)


@dataclass
class PromptScoring:
    """Input logprobs an extend forward computes: flat token `rows` of the batch, row i scored
    against `targets[i]` (the prompt token after it) at `temperatures[i]` (the request's; greedy
    counts as 1, as for output logprobs), with the `top` best tokens of each row (the most any of
    them asks for; 0: none). The runner fills `logprobs` [rows] and, with `top`, `top_vals` /
    `top_ids` [rows, top], on the device."""

    rows: list[int]
    targets: list[int]
    temperatures: list[float]
    top: int = 0
    logprobs: torch.Tensor | None = None
    top_vals: torch.Tensor | None = None
    top_ids: torch.Tensor | None = None

    def to_host(self) -> tuple[list[float], list[list[tuple[float, int]]] | None]:
        """(logprob of each row's target, each row's `top` best (logprob, token id) or None)."""
        if self.logprobs is None:
            raise RuntimeError("the forward has not scored these rows")
        logprobs = self.logprobs.tolist()
        if self.top_vals is None or self.top_ids is None:
            return logprobs, None
        return logprobs, [list(zip(v, t)) for v, t in zip(self.top_vals.tolist(),
                                                           self.top_ids.tolist())]


def score_logits(logits: torch.Tensor, targets: torch.Tensor, temperatures: torch.Tensor,
                 top: int, deterministic: bool = False
                 ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """`log_softmax(logits / temperature)` of each row at its target, and its `top` best values and
    token ids: the same arithmetic as an output token's logprob (`Sampler`)."""
    scaled = logits.float() / temperatures.unsqueeze(1)
    logp = (batch_invariant.log_softmax(scaled) if deterministic
            else torch.log_softmax(scaled, dim=-1))
    picked = logp.gather(1, targets.unsqueeze(1)).squeeze(1)
    if top <= 0:
        return picked, None, None
    vals, ids = logp.topk(top, dim=-1)
    return picked, vals, ids


@dataclass
class SampleOutput:
    """Row i's next token, and its logprob and top logprobs when any row asked for them. `failed`:
    rows that could not be sampled (their entries are placeholders), with the error.
    `input_logprobs`: an extend batch's `PromptScoring` results (the logprob of each scored row's
    target, and its top logprobs), in the order of its rows."""

    next_ids: list[int]
    logprobs: list[float] | None
    top_logprobs: list[list[tuple[float, int]]] | None
    failed: dict[int, str] | None = None
    input_logprobs: tuple[list[float], list[list[tuple[float, int]]] | None] | None = None


@dataclass
class DeviceSample:
    """A batch's sampled tokens (and logprobs) still on the device. `copy_to_host()` starts their
    copy into pinned host memory behind an event, so the next step can be launched before
    `to_output()` waits for exactly this step's results (the one host sync of a step)."""

    next_ids: torch.Tensor  # [B] int64
    logprobs: torch.Tensor | None = None  # [B] fp32
    top_vals: torch.Tensor | None = None  # [B, k]
    top_ids: torch.Tensor | None = None  # [B, k]
    top_logprobs_num: list[int] | None = None
    _host: list[torch.Tensor | None] | None = None
    _copied: torch.cuda.Event | None = None

    def _tensors(self) -> list[torch.Tensor | None]:
        return [self.next_ids, self.logprobs, self.top_vals, self.top_ids]

    def copy_to_host(self) -> None:
        """Start the device-to-host copies (CUDA only; elsewhere `to_output` reads directly)."""
        if not self.next_ids.is_cuda or self._host is not None:
            return
        host: list[torch.Tensor | None] = []
        for t in self._tensors():
            if t is None:
                host.append(None)
                continue
            buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            buf.copy_(t, non_blocking=True)
            host.append(buf)
        self._host = host
        self._copied = torch.cuda.Event()
        self._copied.record()

    def to_output(self) -> SampleOutput:
        """The host lists (waits for this sample's copies, or syncs on them if none started)."""
        if self._host is not None:
            assert self._copied is not None
            self._copied.synchronize()
            ids, lps, vals, top_ids = self._host
        else:
            ids, lps, vals, top_ids = self._tensors()
        logprobs = top = None
        if lps is not None:
            logprobs = lps.tolist()
        if vals is not None and top_ids is not None and self.top_logprobs_num is not None:
            vals_l, ids_l = vals.tolist(), top_ids.tolist()
            top = [list(zip(vals_l[i][:n], ids_l[i][:n]))
                   for i, n in enumerate(self.top_logprobs_num)]
        assert ids is not None
        return SampleOutput(ids.tolist(), logprobs, top)


class Sampler:
    def __init__(self, seed: int = 0, deterministic: bool = False,
                 one_pass: bool | None = None, stream: int = 0) -> None:
        """`deterministic` (`enable_deterministic_inference`): on CUDA, log_softmax and the draw's
        probabilities come from the one-program-per-row kernel and top-k/top-p/min-p truncation runs
        row by row, so a row's logprob and (seeded) draw do not depend on the batch; its logprobs
        are the bits `tide.rl.logprobs` computes, so it keeps the general path. `one_pass`: whether
        rows that can take `triton_ops.sample_rows` do (None: on CUDA outside deterministic mode;
        True elsewhere needs triton's CPU interpreter, for tests). `stream` (the engine's
        `dp_rank`): unseeded rows draw from noise of this stream's own, seeded from `seed` and
        `stream` (stream 0: from `seed` alone); seeded rows do not depend on it."""
        self.seed = seed if stream == 0 else (seed + stream * _STREAM_MIX) % 2**63
        self.deterministic = deterministic
        self.one_pass = one_pass
        self._generators: dict[torch.device, torch.Generator] = {}
        # Per-step Philox keys of the one-pass path's unseeded rows.
        self._keys = random.Random(self.seed)

    def _generator(self, device: torch.device) -> torch.Generator:
        gen = self._generators.get(device)
        if gen is None:
            gen = torch.Generator(device=device).manual_seed(self.seed)
            self._generators[device] = gen
        return gen

    def _one_pass_on(self, device: torch.device) -> bool:
        """Whether rows of logits on `device` that can take the one-pass kernels do."""
        if self.one_pass is None:
            return device.type == "cuda" and not self.deterministic
        return self.one_pass

    def warmup(self, vocab_size: int, dtypes: tuple[torch.dtype, ...],
               device: torch.device) -> None:
        """Compile the one-pass kernels for this model's logits ([rows, `vocab_size`] on `device`,
        in each of `dtypes`), with and without logprobs, now rather than in the first sampled steps
        of a rollout (on an empty Triton cache, each compile takes about a second). Nothing on CPU."""
        if device.type != "cuda" or not self._one_pass_on(device):
            return
        from tide.layers import triton_ops

        rows = torch.zeros(1, dtype=torch.int64, device=device)
        temps = torch.ones(1, dtype=torch.float32, device=device)
        seeds = torch.zeros(1, dtype=torch.int64, device=device)
        for dtype in dict.fromkeys(dtypes):
            logits = torch.zeros(1, vocab_size, dtype=dtype, device=device)
            for logprobs in (False, True):
                triton_ops.sample_rows(logits, rows, temps, seeds, logprobs)

    def __call__(self, logits: torch.Tensor, info: SamplingBatchInfo,
                 greedy_ids: torch.Tensor | None = None) -> SampleOutput:
        """Next token of every row of `logits` [B, vocab] (row i sampled with entry i of `info`).
        `greedy_ids`, when given, is each row's argmax of `logits` already computed (the decode graph
        leaves it); it is used when `info.argmax_only`."""
        return self.sample(logits, info, greedy_ids).to_output()

    @torch.no_grad()
    def sample(self, logits: torch.Tensor, info: SamplingBatchInfo,
               greedy_ids: torch.Tensor | None = None) -> DeviceSample:
        """As `__call__`, leaving the results on the device (no host sync): every step of the draw,
        seeded noise included, runs on the logits' device."""
        if info.argmax_only:
            # `greedy_ids` is a view of the decode graphs' shared buffer: whatever reads it (the host
            # copy, the next step's inputs) is queued before the next replay overwrites it.
            ids = greedy_ids if greedy_ids is not None else logits.float().argmax(dim=-1)
            return DeviceSample(ids)
        if not self._one_pass_on(logits.device):
            return self._sample_rows(logits, info)
        one_pass = [i for i in range(info.size) if _one_pass(info, i)]
        if len(one_pass) == info.size:
            return self._one_pass(logits, info, None)
        if not one_pass:
            return self._sample_rows(logits, info)
        chosen = set(one_pass)
        rest = [i for i in range(info.size) if i not in chosen]
        fast = device_tensor(one_pass, torch.int64, logits.device)
        slow = device_tensor(rest, torch.int64, logits.device)
        a = self._one_pass(logits, info.select(one_pass), fast)
        b = self._sample_rows(logits.index_select(0, slow), info.select(rest))
        return _merge(info, (fast, a), (slow, b))

    def _one_pass(self, logits: torch.Tensor, info: SamplingBatchInfo,
                  rows: torch.Tensor | None) -> DeviceSample:
        """`triton_ops.sample_rows` over the rows `rows` (int64, on the logits' device; None: all)
        of `logits`, described by `info`."""
        from tide.layers import triton_ops

        temps: list[float] = []
        keys: list[int] = []
        for i, p in enumerate(info.params):
            temps.append(p.temperature or 1.0)
            if p.is_greedy:
                keys.append(-1)
            elif p.seed is None:
                keys.append(self._keys.getrandbits(63))
            else:
                keys.append((p.seed * _SEED_MIX + info.output_position(i)) % (2**63))
        device = logits.device
        index = rows if rows is not None else torch.arange(info.size, device=device)
        temps_t = device_tensor(temps, torch.float32, device)
        bounds = None
        kept = [_truncates(p) for p in info.params]
        if any(kept):
            bounds = triton_ops.truncation_bounds(
                logits, index, temps_t,
                [p.top_k if t else -1 for p, t in zip(info.params, kept)],
                [p.top_p if t else 1.0 for p, t in zip(info.params, kept)],
                [p.min_p if t else 0.0 for p, t in zip(info.params, kept)])
        ids, logp = triton_ops.sample_rows(
            logits, index, temps_t, device_tensor(keys, torch.int64, device),
            any(info.return_logprob), bounds)
        return DeviceSample(ids, logp)

    def _sample_rows(self, logits: torch.Tensor, info: SamplingBatchInfo) -> DeviceSample:
        """Every row of `logits` through the general path (logit bias, penalties, banned ending
        tokens, truncation, top logprobs)."""
        logits = logits.float()
        params = info.params
        if any(info.edits_row(i) for i in range(info.size)):
            logits = edit_logits(logits, info)
        temps = device_tensor([p.temperature or 1.0 for p in params], torch.float32,
                              logits.device).unsqueeze(1)
        scaled = logits / temps

        greedy = [p.is_greedy for p in params]
        if not any(greedy):  # every row draws (an RL rollout batch): no row index
            next_ids = self._draw(scaled, list(params),
                                  [info.output_position(i) for i in range(len(params))])
        else:
            next_ids = scaled.argmax(dim=-1)
        if any(greedy) and not all(greedy):
            rows = [i for i, g in enumerate(greedy) if not g]
            index = device_tensor(rows, torch.int64, logits.device)
            sampled = self._draw(scaled.index_select(0, index), [params[i] for i in rows],
                                 [info.output_position(i) for i in rows])
            next_ids.index_copy_(0, index, sampled)

        out = DeviceSample(next_ids)
        if any(info.return_logprob):
            logp = self._log_softmax(scaled)
            out.logprobs = logp.gather(1, next_ids.unsqueeze(1)).squeeze(1)
            k = max(info.top_logprobs_num)
            if k > 0:
                out.top_vals, out.top_ids = logp.topk(k, dim=-1)
                out.top_logprobs_num = list(info.top_logprobs_num)
        return out

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
        if all(p.seed is None for p in params):  # one launch for the batch, not one per row
            noise.exponential_(generator=self._generator(probs.device))
            return (probs / noise).argmax(dim=-1)
        for i, p in enumerate(params):
            if p.seed is None:
                noise[i].exponential_(generator=self._generator(probs.device))
            else:  # a generator of its own on the logits' device: no host draw, no copy
                step_seed = (p.seed * _SEED_MIX + positions[i]) % (2**63)
                gen = torch.Generator(device=probs.device).manual_seed(step_seed)
                noise[i].exponential_(generator=gen)
        return (probs / noise).argmax(dim=-1)

    def _log_softmax(self, scaled: torch.Tensor) -> torch.Tensor:
        if self.deterministic:
            return batch_invariant.log_softmax(scaled)
        return torch.log_softmax(scaled, dim=-1)


def _one_pass(info: SamplingBatchInfo, i: int) -> bool:
    """Whether row i may take `triton_ops.sample_rows` at this step: no logit edit (bias,
    penalties, banned ending tokens) and no top logprobs (greedy, temperature, top-k, top-p and
    min-p rows do)."""
    return not info.edits_row(i) and info.top_logprobs_num[i] == 0


def _truncates(p: SamplingParams) -> bool:
    """Whether a drawn row's top-k, top-p or min-p excludes any token."""
    return not p.is_greedy and (p.top_k != -1 or p.top_p < 1.0 or p.min_p > 0.0)


def _merge(info: SamplingBatchInfo, *parts: tuple[torch.Tensor, DeviceSample]) -> DeviceSample:
    """One batch's sample from samples of disjoint row subsets, each given with its rows' batch
    indices (int64, on the device). Top logprobs come from the parts that have them (the general
    path's; the engine turns `return_logprob` on wherever top logprobs are asked for)."""
    first = parts[0][1].next_ids
    device = first.device
    ids = torch.empty(info.size, dtype=torch.int64, device=device)
    logp = (torch.zeros(info.size, dtype=torch.float32, device=device)
            if any(info.return_logprob) else None)
    k = max(info.top_logprobs_num, default=0)
    top_vals = torch.zeros(info.size, k, dtype=torch.float32, device=device) if k else None
    top_ids = torch.zeros(info.size, k, dtype=torch.int64, device=device) if k else None
    for index, part in parts:
        ids.index_copy_(0, index, part.next_ids)
        if logp is not None and part.logprobs is not None:
            logp.index_copy_(0, index, part.logprobs)
        if top_vals is not None and top_ids is not None and part.top_vals is not None \
                and part.top_ids is not None:
            top_vals[:, : part.top_vals.shape[1]].index_copy_(0, index, part.top_vals)
            top_ids[:, : part.top_ids.shape[1]].index_copy_(0, index, part.top_ids)
    out = DeviceSample(ids, logp, top_vals, top_ids)
    if k:
        out.top_logprobs_num = list(info.top_logprobs_num)
    return out


def truncate(probs: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Zero the probabilities that top_k, top_p or min_p exclude (the top token always survives)."""
    if all(p.top_k == -1 and p.top_p == 1.0 and p.min_p == 0.0 for p in params):
        return probs
    device = probs.device
    vocab = probs.shape[1]
    sorted_p, order = probs.sort(dim=-1, descending=True)
    rank = torch.arange(vocab, device=device).unsqueeze(0)
    top_k = device_tensor([p.top_k if p.top_k > 0 else vocab for p in params], torch.int64, device)
    # top_p = 1 keeps every token: the sums' fp32 rounding may carry the mass before a tail token
    # above 1 (another row of the batch truncating brings this row here).
    top_p = device_tensor([p.top_p if p.top_p < 1.0 else math.inf for p in params], torch.float32,
                          device)
    min_p = device_tensor([p.min_p for p in params], torch.float32, device)
    drop = rank >= top_k.unsqueeze(1)
    drop |= (sorted_p.cumsum(dim=-1) - sorted_p) > top_p.unsqueeze(1)
    drop |= sorted_p < (sorted_p[:, :1] * min_p.unsqueeze(1))
    drop[:, 0] = False
    sorted_p = sorted_p.masked_fill(drop, 0.0)
    return torch.zeros_like(probs).scatter_(1, order, sorted_p)


def edit_logits(logits: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
    """An edited copy of `logits`: the tokens a row's grammar does not allow and those that would
    end it before its `min_new_tokens` set to -inf, then each row's logit bias added, then
    frequency/presence penalties over its output, then the repetition penalty over its prompt and
    output."""
    logits = logits.clone()
    vocab = logits.shape[1]
    constrained = info.grammar.rows() if info.grammar is not None else []
    if constrained:  # (a free row sampled alone after a failed batch never fills the masks)
        apply_bitmask(logits, info.grammar.bitmask(), constrained)  # type: ignore[union-attr]
    # The whole batch's bans, then its biases, each in one indexed write (two copies to the
    # device, not two a row): -inf stays -inf under the bias and the penalties.
    banned_rows: list[int] = []
    banned: list[int] = []
    biased_rows: list[int] = []
    biased: list[int] = []
    biases: list[float] = []
    for i, p in enumerate(info.params):
        if info.bans_endings(i):
            banned_rows.extend([i] * len(info.ending_ids[i]))
            banned.extend(info.ending_ids[i])
        if p.logit_bias:
            biased_rows.extend([i] * len(p.logit_bias))
            biased.extend(p.logit_bias)
            biases.extend(p.logit_bias.values())
    if banned:
        where = device_tensor(banned_rows + banned, torch.int64, logits.device).view(2, -1)
        logits.index_put_((where[0], where[1]), torch.tensor(-math.inf, dtype=logits.dtype,
                                                             device=logits.device))
    if biased:
        where = device_tensor(biased_rows + biased, torch.int64, logits.device).view(2, -1)
        values = device_tensor(biases, torch.float32, logits.device).to(logits.dtype)
        # Each (row, token) once: the accumulation adds each bias once, in the logits' dtype.
        logits.index_put_((where[0], where[1]), values, accumulate=True)
    for i, p in enumerate(info.params):
        if not p.has_penalties:
            continue
        if p.frequency_penalty or p.presence_penalty:
            out = device_tensor(info.output_ids[i], torch.int64, logits.device)
            counts = torch.bincount(out, minlength=vocab)[:vocab].float()
            logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).float()
        if p.repetition_penalty != 1.0:
            seen = device_tensor(info.prompt_ids[i] + info.output_ids[i], torch.int64,
                                 logits.device)
            vals = logits[i, seen]
            logits[i, seen] = torch.where(
                vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty
            )
    return logits
