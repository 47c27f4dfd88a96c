"""`Engine.generate`'s arguments into scheduler requests, and finished requests into its outputs.

Every item is validated before any request exists, so bad input raises `ValueError` (naming the
field) and the engine never sees it.
"""

from __future__ import annotations

import dataclasses
import uuid
from dataclasses import dataclass
from typing import Any, Required, TypedDict

from tide.grammar import grammar_of
from tide.sampling_params import SamplingParams
from tide.scheduler.request import Req
from tide.tokenizer import Tokenizer, decode

Prompt = str | list[str] | None
InputIds = list[int] | list[list[int]] | None
# A sampling-params dict is JSON-like: `SamplingParams` field names to values, checked by it.
SamplingParamsDict = dict[str, Any]


class GenerateOutput(TypedDict, total=False):
    """One item of `Engine.generate`'s output (sglang's shape); no `text` without a tokenizer."""

    text: str
    output_ids: Required[list[int]]
    meta_info: Required[dict[str, Any]]


# Sequences (prompts x n) one `generate` call may ask for, and prompt tokens over those sequences
# (each sequence holds its own copy of its prompt's ids): checked before any request is made.
MAX_SEQUENCES = 1 << 16
MAX_SEQUENCE_TOKENS = 1 << 26


@dataclass(frozen=True)
class InputLimits:
    """What a request must fit: the vocabulary, the context, the KV cache; and why there is no
    tokenizer when there is none (for the error of a text input or a stop string)."""

    vocab_size: int
    context_len: int
    max_total_tokens: int
    no_tokenizer_reason: str = "the checkpoint has no tokenizer files"
    grammar_backend: str = "xgrammar"
    eos_token_ids: tuple[int, ...] = ()


def build_requests(
    prompt: Prompt,
    input_ids: InputIds,
    sampling_params: SamplingParamsDict | list[SamplingParamsDict] | None,
    return_logprob: bool | list[bool],
    top_logprobs_num: int | list[int],
    rid: str | list[str] | None,
    tokenizer: Tokenizer | None,
    limits: InputLimits,
    logprob_start_len: int | list[int] = -1,
) -> tuple[bool, list[Req]]:
    """(whether one item was given, the requests: `n` per item, in order)."""
    single, token_lists = _token_lists(prompt, input_ids, tokenizer, limits)
    count = len(token_lists)
    params = _per_item(sampling_params, count, "sampling_params")
    logprob_flags = _per_item(return_logprob, count, "return_logprob")
    top_nums = _per_item(top_logprobs_num, count, "top_logprobs_num")
    starts = _per_item(logprob_start_len, count, "logprob_start_len")
    for start in starts:
        if not isinstance(start, int) or isinstance(start, bool) or start < -1:
            raise ValueError(f"logprob_start_len must be an integer >= -1 (-1: no input "
                             f"logprobs), got {start!r}")
    rids = _per_item(rid, count, "rid")
    for name, flags in (("return_logprob", logprob_flags),):
        if not all(isinstance(f, bool) for f in flags):
            raise ValueError(f"{name} must be a bool or a list of bools, one per prompt")
    if not all(r is None or isinstance(r, str) for r in rids):
        raise ValueError("rid must be a string or a list of strings, one per prompt")
    given = [r for r in rids if r]
    if len(set(given)) != len(given):
        raise ValueError("rid values must be unique")
    reqs: list[Req] = []
    sequences = tokens = 0
    for i, ids in enumerate(token_lists):
        sp = SamplingParams.from_dict(params[i])
        vocab = limits.vocab_size
        sp.check_vocab(vocab)
        sp.check_endings(vocab, limits.eos_token_ids)
        if sp.stop_strs and tokenizer is None:
            raise ValueError(f"stop strings need a tokenizer and this engine has none "
                             f"({limits.no_tokenizer_reason}); use stop_token_ids")
        grammar = grammar_of(sp)
        if grammar is not None and tokenizer is None:
            raise ValueError(f"{grammar[0]} needs a tokenizer and this engine has none "
                             f"({limits.no_tokenizer_reason})")
        if grammar is not None and limits.grammar_backend == "none":
            raise ValueError(f"{grammar[0]} needs constrained decoding, which this engine runs "
                             "without (grammar_backend='none')")
        _check_length(ids, sp, limits)
        top_n = top_nums[i]
        if not isinstance(top_n, int) or isinstance(top_n, bool) or not 0 <= top_n <= vocab:
            raise ValueError(f"top_logprobs_num must be an integer in [0, {vocab}], got {top_n!r}")
        wants_input = bool(logprob_flags[i]) or top_n > 0
        if wants_input and 0 <= starts[i] < len(ids):
            # Input logprob entries count against the same bound as the tokens' copies.
            tokens += sp.n * (len(ids) - starts[i]) * (1 + top_n)
        sequences += sp.n
        tokens += sp.n * len(ids)
        if sequences > MAX_SEQUENCES or tokens > MAX_SEQUENCE_TOKENS:
            raise ValueError(
                f"n: one generate call may ask for at most {MAX_SEQUENCES} sequences (prompts x n) "
                f"and {MAX_SEQUENCE_TOKENS} prompt tokens over them (input logprob entries "
                "included); split the batch")
        base = rids[i] or uuid.uuid4().hex
        for j in range(sp.n):
            # n copies of a seeded request draw different samples, reproducibly.
            sp_j = sp if j == 0 or sp.seed is None else dataclasses.replace(
                sp, seed=(sp.seed + j) % 2**63
            )
            reqs.append(Req(
                rid=base if sp.n == 1 else f"{base}-{j}",
                origin_input_ids=list(ids),
                sampling_params=sp_j,
                return_logprob=bool(logprob_flags[i]) or top_n > 0,
                top_logprobs_num=top_n,
                logprob_start_len=starts[i],
            ))
    return single, reqs


def make_output(req: Req, tokenizer: Tokenizer | None, latency: float) -> GenerateOutput:
    """sglang's `generate` output of a finished request: text (cut before a matched stop string; no
    `text` key without a tokenizer: ids only), output ids and meta info."""
    out: GenerateOutput = {"output_ids": list(req.output_ids), "meta_info": {}}
    if tokenizer is not None:
        params = req.sampling_params
        skip = params.skip_special_tokens
        matched = (req.finished_reason or {}).get("matched")
        # A matched stop token (the last) or stop string stays out of the text, as sglang's does,
        # unless `no_stop_trim`.
        trim = not params.no_stop_trim
        ids = req.output_ids[:-1] if trim and isinstance(matched, int) else req.output_ids
        spaces = params.spaces_between_special_tokens
        text = decode(tokenizer, ids, skip, spaces)
        if trim and isinstance(matched, str):
            # The match ends in the text of a token after the min_new_tokens-th: an occurrence
            # before that was passed over.
            minimum = params.min_new_tokens
            start = 0
            if minimum > 0:
                # Without a character the minimum-th token leaves unfinished: the decoders hold
                # it back, so the token that finishes it (after the minimum) may complete a stop.
                before = decode(tokenizer, req.output_ids[:minimum], skip, spaces)
                start = max(0, len(before.rstrip("\ufffd")) - len(matched) + 1)
            pos = text.find(matched, start)
            if pos >= 0:
                text = text[:pos]
        out["text"] = text
    meta: dict[str, Any] = {
        "id": req.rid,
        "finish_reason": req.finished_reason,
        "weight_version": req.weight_version,
        "prompt_tokens": len(req.origin_input_ids),
        "completion_tokens": len(req.output_ids),
        "cached_tokens": req.cached_tokens,
        "e2e_latency": latency,
    }
    if req.return_logprob:
        meta["output_token_logprobs"] = list(req.output_token_logprobs)
        if req.top_logprobs_num > 0:
            meta["output_top_logprobs"] = list(req.output_top_logprobs)
        if req.wants_input_logprobs and req.input_score_first() is None:  # complete (not aborted)
            meta["input_token_logprobs"] = list(req.input_token_logprobs)
            if req.top_logprobs_num > 0:
                meta["input_top_logprobs"] = list(req.input_top_logprobs)
    out["meta_info"] = meta
    return out


def _token_lists(prompt: Prompt, input_ids: InputIds, tokenizer: Tokenizer | None,
                 limits: InputLimits) -> tuple[bool, list[list[int]]]:
    if (prompt is None) == (input_ids is None):
        raise ValueError("exactly one of prompt or input_ids must be given")
    if prompt is not None:
        single = isinstance(prompt, str)
        prompts = [prompt] if single else prompt
        if not isinstance(prompts, list) or not prompts:
            raise ValueError("prompt must be a non-empty string or a non-empty list of strings")
        lists: list[list[int]] = []
        for p in prompts:
            if not isinstance(p, str):
                raise ValueError(f"prompt must be a string or a list of strings, got an item of "
                                 f"type {type(p).__name__}")
            if not p:
                raise ValueError("prompt must be a non-empty string (got an empty prompt)")
            try:
                p.encode("utf-8")
            except UnicodeEncodeError:
                raise ValueError("prompt must be valid Unicode (it holds a lone surrogate)") from None
            if tokenizer is None:
                raise ValueError(f"prompt needs a tokenizer and this engine has none "
                                 f"({limits.no_tokenizer_reason}); pass input_ids")
            lists.append(tokenizer.encode(p))
        return single, lists
    if not isinstance(input_ids, list) or not input_ids:
        raise ValueError("input_ids must be a non-empty list of token ids or of lists of them")
    single = not isinstance(input_ids[0], list)
    candidates: list[Any] = [input_ids] if single else input_ids  # checked item by item below
    vocab = limits.vocab_size
    lists = []
    for k, ids in enumerate(candidates):
        if not isinstance(ids, list):
            raise ValueError(f"input_ids.{k} must be a list of token ids (input_ids mixes lists "
                             "and ids)")
        if not ids:
            raise ValueError("input_ids must not be empty" if single else
                             f"input_ids.{k} must not be empty")
        # By the set of the ids' types, then min and max (C loops; half the time of a per-id check).
        if (not all(issubclass(kind, int) and kind is not bool for kind in set(map(type, ids)))
                or min(ids) < 0 or max(ids) >= vocab):
            raise ValueError(f"input_ids must be integers in [0, {vocab})")
        lists.append(ids)
    return single, lists


def _check_length(ids: list[int], sp: SamplingParams, limits: InputLimits) -> None:
    total = len(ids) + sp.max_new_tokens
    what = f"prompt ({len(ids)} tokens) + max_new_tokens ({sp.max_new_tokens}) = {total}"
    if total > limits.context_len:
        raise ValueError(f"{what} exceeds the context length {limits.context_len}")
    if total > limits.max_total_tokens:
        raise ValueError(f"{what} exceeds the KV cache capacity of {limits.max_total_tokens} "
                         "tokens (max_total_tokens)")


def _per_item(value: object, count: int, name: str) -> list[Any]:
    if isinstance(value, list):
        if len(value) != count:
            raise ValueError(f"{name} has {len(value)} entries but there are {count} prompts")
        return list(value)
    return [value] * count
