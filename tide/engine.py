"""In-process engine with an sglang-shaped offline API (`tide.Engine`)."""

from __future__ import annotations

import dataclasses
import logging
import os
import time
import uuid
from typing import Any, Sequence

import torch

from tide.config import EngineConfig
from tide.executor.model_runner import ModelRunner
from tide.model_config import ModelConfig
from tide.models import get_model_class
from tide.sampling_params import SamplingParams
from tide.scheduler.request import Req
from tide.scheduler.scheduler import Scheduler

logger = logging.getLogger(__name__)


class Engine:
    """Load a model and generate.

    `Engine(model_path=None, **options)`: options are `EngineConfig` fields; unknown ones raise
    `ValueError`. With no `model_path` the built-in demo model is used.
    """

    def __init__(self, model_path: str | None = None, **kwargs: Any) -> None:
        self.config = EngineConfig.from_kwargs(model_path=model_path, **kwargs)
        logging.getLogger("tide").setLevel(self.config.log_level.upper())
        torch.manual_seed(self.config.seed)
        self.model_config = ModelConfig.from_dir(self.config.model_path)
        get_model_class(self.model_config.architecture)  # unknown architecture -> ValueError early
        self.tokenizer = load_tokenizer(self.config)
        eos = set(self.model_config.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            eos.add(int(self.tokenizer.eos_token_id))
        self.eos_token_ids = tuple(sorted(eos))
        self.model_runner = ModelRunner(self.config, self.model_config)
        self.scheduler = Scheduler(
            self.config,
            self.model_runner,
            self.eos_token_ids,
            self._decode if self.tokenizer is not None else None,
        )
        self.context_len = self.model_runner.context_len

    # ---- generation
    def generate(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        return_logprob: bool | list[bool] = False,
        top_logprobs_num: int | list[int] = 0,
        rid: str | list[str] | None = None,
    ) -> dict[str, Any] | list[dict[str, Any]]:
        """Generate for one item (returns a dict) or a list of items (returns a list of dicts).

        Every item is validated before any is submitted, so bad input raises `ValueError` and leaves
        the engine as it was.
        """
        single, token_lists = self._normalize_prompts(prompt, input_ids)
        count = len(token_lists)
        params = _per_item(sampling_params, count, "sampling_params")
        logprob_flags = _per_item(return_logprob, count, "return_logprob")
        top_nums = _per_item(top_logprobs_num, count, "top_logprobs_num")
        rids = _per_item(rid, count, "rid")
        reqs: list[Req] = []
        for i, ids in enumerate(token_lists):
            sp = SamplingParams.from_dict(params[i])
            self._check_length(ids, sp)
            top_n = top_nums[i]
            vocab = self.model_config.vocab_size
            if not isinstance(top_n, int) or isinstance(top_n, bool) or not 0 <= top_n <= vocab:
                raise ValueError(f"top_logprobs_num must be an integer in [0, {vocab}], got {top_n!r}")
            base = rids[i] or uuid.uuid4().hex
            for j in range(sp.n):
                # n copies of a seeded request draw different samples, reproducibly.
                sp_j = sp if j == 0 or sp.seed is None else dataclasses.replace(
                    sp, seed=(sp.seed + j) % 2**63
                )
                reqs.append(
                    Req(
                        rid=base if sp.n == 1 else f"{base}-{j}",
                        origin_input_ids=list(ids),
                        sampling_params=sp_j,
                        return_logprob=bool(logprob_flags[i]) or top_n > 0,
                        top_logprobs_num=top_n,
                    )
                )
        start = time.perf_counter()
        for req in reqs:
            self.scheduler.add_request(req)
        pending = {id(r) for r in reqs if not r.finished}
        while pending:
            if not self.scheduler.has_work():
                raise RuntimeError("scheduler went idle with requests still pending")
            for req in self.scheduler.step():
                if req.finished:
                    pending.discard(id(req))
        latency = time.perf_counter() - start
        outputs = [self._make_output(r, latency) for r in reqs]
        return outputs[0] if single and len(outputs) == 1 else outputs

    def _normalize_prompts(
        self, prompt: Any, input_ids: Any
    ) -> tuple[bool, list[list[int]]]:
        if (prompt is None) == (input_ids is None):
            raise ValueError("exactly one of prompt or input_ids must be given")
        if prompt is not None:
            single = isinstance(prompt, str)
            prompts = [prompt] if single else prompt
            if not isinstance(prompts, list) or not prompts:
                raise ValueError("prompt must be a non-empty string or a non-empty list of strings")
            lists = []
            for p in prompts:
                if not isinstance(p, str) or not p:
                    raise ValueError("prompt must be a non-empty string (got an empty prompt)")
                if self.tokenizer is None:
                    raise ValueError("prompt needs a tokenizer; this model has none, pass input_ids")
                lists.append(self.tokenizer.encode(p))
            return single, lists
        if not isinstance(input_ids, list) or not input_ids:
            raise ValueError("input_ids must be a non-empty list of token ids or of lists of them")
        single = not isinstance(input_ids[0], list)
        lists = [input_ids] if single else input_ids
        vocab = self.model_config.vocab_size
        for ids in lists:
            if not isinstance(ids, list) or not ids:
                raise ValueError("input_ids must not be empty")
            if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in ids):
                raise ValueError(f"input_ids must be integers in [0, {vocab})")
        return single, lists

    def _check_length(self, ids: list[int], sp: SamplingParams) -> None:
        total = len(ids) + sp.max_new_tokens
        if total > self.context_len:
            raise ValueError(
                f"prompt ({len(ids)} tokens) + max_new_tokens ({sp.max_new_tokens}) = {total} exceeds "
                f"the context length {self.context_len}"
            )
        capacity = self.scheduler.max_total_tokens
        if total > capacity:
            raise ValueError(
                f"prompt ({len(ids)} tokens) + max_new_tokens ({sp.max_new_tokens}) = {total} exceeds "
                f"the KV cache capacity of {capacity} tokens (max_total_tokens)"
            )

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)  # type: ignore[union-attr]

    def _make_output(self, req: Req, latency: float) -> dict[str, Any]:
        text = None
        if self.tokenizer is not None:
            text = self.tokenizer.decode(
                req.output_ids, skip_special_tokens=req.sampling_params.skip_special_tokens
            )
            matched = (req.finished_reason or {}).get("matched")
            if isinstance(matched, str) and matched in text:
                text = text[: text.index(matched)]
        meta: dict[str, Any] = {
            "id": req.rid,
            "finish_reason": req.finished_reason,
            "prompt_tokens": len(req.origin_input_ids),
            "completion_tokens": len(req.output_ids),
            "cached_tokens": req.cached_tokens,
            "e2e_latency": latency,
        }
        if req.return_logprob:
            meta["output_token_logprobs"] = list(req.output_token_logprobs)
            if req.top_logprobs_num > 0:
                meta["output_top_logprobs"] = list(req.output_top_logprobs)
        return {"text": text, "output_ids": list(req.output_ids), "meta_info": meta}

    # ---- cache and lifecycle
    def flush_cache(self) -> bool:
        """Reset radix cache, request pool and KV allocator when idle; False (with a log line giving
        the queued/running counts) otherwise."""
        ok, message = self.scheduler.flush_cache()
        if not ok:
            logger.warning(message)
        return ok

    def get_server_info(self) -> dict[str, Any]:
        return {
            "model_path": self.config.model_path,
            "max_total_tokens": self.scheduler.max_total_tokens,
            "context_length": self.context_len,
            "device": str(self.model_runner.device),
            "dtype": str(self.model_runner.dtype).replace("torch.", ""),
        }

    def shutdown(self) -> None:
        self.scheduler.abort(message="engine shutdown")

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def _per_item(value: Any, count: int, name: str) -> list[Any]:
    if isinstance(value, list):
        if len(value) != count:
            raise ValueError(f"{name} has {len(value)} entries but there are {count} prompts")
        return list(value)
    return [value] * count


def load_tokenizer(config: EngineConfig) -> Any:
    from transformers import AutoTokenizer

    path = config.tokenizer_path or config.model_path
    has_files = any(
        os.path.isfile(os.path.join(path, n)) for n in ("tokenizer.json", "tokenizer_config.json")
    )
    if not has_files:
        if config.load_format == "dummy":
            return None
        raise ValueError(f"model_path {path!r} has no tokenizer files (tokenizer.json)")
    return AutoTokenizer.from_pretrained(path)
