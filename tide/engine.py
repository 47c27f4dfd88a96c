"""In-process engine with an sglang-shaped offline API (`tide.Engine`)."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import threading
import time
import uuid
from typing import Any, Callable, Iterator

import torch

from tide.config import EngineConfig
from tide.executor.model_runner import ModelRunner
from tide.memory.device import MEMORY_LEDGER, empty_device_cache
from tide.memory.occupation import MemoryOccupation, parse_tags
from tide.model_config import ModelConfig
from tide.models import get_model_class
from tide.sampling_params import SamplingParams
from tide.scheduler.request import Req
from tide.scheduler.scheduler import Scheduler
from tide.weights.update import LOAD_FORMATS, WeightUpdateOptions, WeightUpdater

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
        self.weight_updater = WeightUpdater(self.model_runner.model, self.model_runner.device)
        self.memory_occupation = MemoryOccupation(self.model_runner, self.config.enable_cpu_backup)
        # One lock for the scheduler and the model: generate() from several threads, and pause /
        # update / continue from another, interleave only between steps.
        self._cond = threading.Condition(threading.RLock())
        # Control calls waiting for the lock; a stepping thread yields to them between steps (a
        # plain lock is not fair: the stepping thread would re-take it before anyone else).
        self._controls_waiting = 0
        self._controls_lock = threading.Lock()
        MEMORY_LEDGER.mark("engine_ready", f"{self.model_config.architecture} on {self.model_runner.device}")

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
        blocked = self.scheduler.memory_block_reason
        if blocked is not None:
            raise ValueError(blocked)
        single, token_lists = self._normalize_prompts(prompt, input_ids)
        count = len(token_lists)
        params = _per_item(sampling_params, count, "sampling_params")
        logprob_flags = _per_item(return_logprob, count, "return_logprob")
        top_nums = _per_item(top_logprobs_num, count, "top_logprobs_num")
        rids = _per_item(rid, count, "rid")
        reqs: list[Req] = []
        for i, ids in enumerate(token_lists):
            sp = SamplingParams.from_dict(params[i])
            vocab = self.model_config.vocab_size
            sp.check_vocab(vocab)
            if sp.stop_strs and self.tokenizer is None:
                raise ValueError(f"stop strings need a tokenizer and this engine has none "
                                 f"({self._no_tokenizer_reason()}); use stop_token_ids")
            self._check_length(ids, sp)
            top_n = top_nums[i]
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
        with self._cond:
            for req in reqs:
                self.scheduler.add_request(req)
        self._run_until_finished(reqs)
        latency = time.perf_counter() - start
        outputs = [self._make_output(r, latency) for r in reqs]
        return outputs[0] if single and len(outputs) == 1 else outputs

    @contextlib.contextmanager
    def _control(self) -> Iterator[None]:
        """Hold the engine lock for a control operation, ahead of any stepping thread."""
        with self._controls_lock:
            self._controls_waiting += 1
        try:
            self._cond.acquire()
        finally:
            with self._controls_lock:
                self._controls_waiting -= 1
        try:
            yield
        finally:
            self._cond.notify_all()
            self._cond.release()

    def _run_until_finished(self, reqs: list[Req]) -> None:
        """Step the scheduler until every request in `reqs` has finished. Any thread that holds the
        lock steps for everyone; while paused (or while a weight update drains), wait."""
        while True:
            with self._cond:
                if all(r.finished for r in reqs):
                    return
                sched = self.scheduler
                if (
                    self._controls_waiting
                    or sched.paused is not None
                    or sched.memory_block_reason is not None
                    or (sched.admission_blocked and not sched.running)
                ):
                    self._cond.wait(timeout=0.05)
                    continue
                if not sched.has_work():
                    raise RuntimeError("scheduler went idle with requests still pending")
                sched.step()
                self._cond.notify_all()

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
                try:
                    p.encode("utf-8")
                except UnicodeEncodeError:
                    raise ValueError("prompt must be valid Unicode (it holds a lone surrogate)") from None
                if self.tokenizer is None:
                    raise ValueError(f"prompt needs a tokenizer and this engine has none "
                                     f"({self._no_tokenizer_reason()}); pass input_ids")
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

    def _no_tokenizer_reason(self) -> str:
        if self.config.skip_tokenizer_init:
            return "skip_tokenizer_init=True"
        return "the checkpoint has no tokenizer files"

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)  # type: ignore[union-attr]

    def _make_output(self, req: Req, latency: float) -> dict[str, Any]:
        """sglang's output dict; without a tokenizer there is no `text` key (ids only)."""
        out: dict[str, Any] = {}
        if self.tokenizer is not None:
            text = self.tokenizer.decode(
                req.output_ids, skip_special_tokens=req.sampling_params.skip_special_tokens
            )
            matched = (req.finished_reason or {}).get("matched")
            if isinstance(matched, str) and matched in text:
                text = text[: text.index(matched)]
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
        out.update(output_ids=list(req.output_ids), meta_info=meta)
        return out

    # ---- cache and lifecycle
    def flush_cache(self, empty_cache: bool = True) -> bool:
        """Reset radix cache, request pool and KV allocator when fully idle (and, if `empty_cache`,
        empty the device allocator cache); False with a log line of the queued/running counts
        otherwise."""
        with self._control():
            ok, message = self.scheduler.flush_cache(empty_cache)
            if ok:
                MEMORY_LEDGER.mark("flush_cache", f"empty_cache={empty_cache}")
        if not ok:
            logger.warning(message)
        return ok

    # ---- training <-> rollout handover (sglang's names, bodies and defaults)
    def pause_generation(self, mode: str = "abort") -> dict[str, Any]:
        """`abort`, `retract` or `in_place` (see `Scheduler.pause_generation`). Requests submitted
        while paused queue until `continue_generation`."""
        with self._control():
            try:
                count = self.scheduler.pause_generation(mode)
            except ValueError as e:
                return _result(False, str(e))
            MEMORY_LEDGER.mark("pause", f"mode={mode}, {count} request(s)")
        return _result(True, f"paused ({mode}); {count} request(s) affected", count)

    def continue_generation(self, torch_empty_cache: bool = True) -> dict[str, Any]:
        """Resume. With `torch_empty_cache`, empty the allocator cache first, while still paused
        (the one release point that undoes fragmentation from in-place updates)."""
        with self._control():
            if torch_empty_cache:
                before = _reserved_bytes()
                empty_device_cache(reason="continue_generation")
                logger.info("continue_generation: reserved %.1f MiB -> %.1f MiB",
                            before / 2**20, _reserved_bytes() / 2**20)
            self.scheduler.continue_generation()
            MEMORY_LEDGER.mark("continue", f"torch_empty_cache={torch_empty_cache}")
        return _result(True, "continued")

    def update_weights_from_disk(
        self,
        model_path: str,
        load_format: str | None = None,
        abort_all_requests: bool = False,
        weight_version: str | None = None,
        flush_cache: bool = True,
        torch_empty_cache: bool = False,
    ) -> dict[str, Any]:
        """Load an HF safetensors directory (same names as the initial load) into the live model."""
        opts = WeightUpdateOptions(flush_cache, torch_empty_cache, abort_all_requests, weight_version)

        def prepare() -> Callable[[], int]:
            if load_format not in (None, "auto", "safetensors"):
                raise ValueError(f"load_format {load_format!r} is not supported for disk updates")
            if not isinstance(model_path, str) or not os.path.isdir(model_path):
                raise ValueError(f"model_path {model_path!r} is not a directory")
            return self.weight_updater.prepare_from_disk(model_path)

        return self._update_weights(opts, prepare)

    def update_weights_from_tensor(
        self,
        named_tensors: Any = None,
        serialized_named_tensors: str | bytes | list[str] | None = None,
        load_format: str | None = None,
        flush_cache: bool = True,
        abort_all_requests: bool = False,
        weight_version: str | None = None,
        torch_empty_cache: bool = False,
    ) -> dict[str, Any]:
        """In-process tensors: `named_tensors` as [(name, tensor), ...], or with
        `load_format="flattened_bucket"` a `FlattenedBucket` (or a list, one per dtype). From another
        process: `serialized_named_tensors` made by `tide.weights.serialize_named_tensors`."""
        opts = WeightUpdateOptions(flush_cache, torch_empty_cache, abort_all_requests, weight_version)

        def prepare() -> Callable[[], int]:
            if load_format not in LOAD_FORMATS:
                raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {load_format!r}")
            if (named_tensors is None) == (serialized_named_tensors is None):
                raise ValueError("give exactly one of named_tensors or serialized_named_tensors")
            if serialized_named_tensors is not None:
                payload = serialized_named_tensors
                if isinstance(payload, list):
                    if len(payload) != 1:
                        raise ValueError("serialized_named_tensors must hold one payload per rank (1)")
                    payload = payload[0]
                return self.weight_updater.prepare_serialized(payload, load_format)
            if load_format == "flattened_bucket":
                return self.weight_updater.prepare_buckets(named_tensors)
            return self.weight_updater.prepare_named_tensors(named_tensors)

        return self._update_weights(opts, prepare)

    def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str = "weight_update_group",
        backend: str = "nccl",
        timeout: float = 120.0,
    ) -> dict[str, Any]:
        """Join the trainer's broadcast group as rank `rank_offset` (the trainer is rank 0); fails
        (and keeps nothing of the attempt) if the trainer has not joined within `timeout` seconds
        (at most 600)."""
        try:
            self.weight_updater.init_group(
                master_address, master_port, rank_offset, world_size, group_name, backend, timeout
            )
        except (ValueError, RuntimeError) as e:
            return _result(False, f"init_weights_update_group failed: {e}")
        return _result(True, f"joined {group_name} as rank {rank_offset} of {world_size}")

    def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> dict[str, Any]:
        try:
            self.weight_updater.destroy_group(group_name)
        except ValueError as e:
            return _result(False, str(e))
        return _result(True, f"destroyed {group_name}")

    def update_weights_from_distributed(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        group_name: str = "weight_update_group",
        load_format: str | None = None,
        flush_cache: bool = True,
        abort_all_requests: bool = False,
        weight_version: str | None = None,
        torch_empty_cache: bool = False,
    ) -> dict[str, Any]:
        """Receive the tensors the trainer (rank 0) broadcasts, in `names` order (one broadcast per
        tensor, or per dtype with `load_format="flattened_bucket"`)."""
        opts = WeightUpdateOptions(flush_cache, torch_empty_cache, abort_all_requests, weight_version)

        def prepare() -> Callable[[], int]:
            if load_format not in LOAD_FORMATS:
                raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {load_format!r}")
            # Validation happens while receiving: the trainer's broadcasts must be drained anyway.
            return lambda: self.weight_updater.load_from_distributed(
                names, dtypes, shapes, group_name, load_format
            )

        return self._update_weights(opts, prepare)

    def update_weights_from_ipc(
        self,
        serialized_buckets: str | bytes,
        flush_cache: bool = True,
        abort_all_requests: bool = False,
        weight_version: str | None = None,
        torch_empty_cache: bool = False,
    ) -> dict[str, Any]:
        """A colocated trainer's bucket buffers, shared as CUDA IPC handles
        (`serialize_named_tensors(flatten_by_dtype(...))`); copied in, then the handles released."""
        opts = WeightUpdateOptions(flush_cache, torch_empty_cache, abort_all_requests, weight_version)
        return self._update_weights(opts, lambda: self.weight_updater.prepare_from_ipc(serialized_buckets))

    def get_weights_by_name(self, name: str, truncate_size: int = 100) -> list[float]:
        """The first `truncate_size` values of checkpoint tensor `name`, flattened."""
        with self._control():
            return self.weight_updater.get_weights_by_name(name, truncate_size)

    def update_weight_version(self, new_version: str, abort_all_requests: bool = True) -> dict[str, Any]:
        if not isinstance(new_version, str) or not new_version:
            return _result(False, "new_version must be a non-empty string")
        with self._control():
            if abort_all_requests:
                self.scheduler.abort(message="aborted by update_weight_version")
            self.scheduler.weight_version = new_version
        return _result(True, f"weight version is {new_version}")

    def _update_weights(
        self, opts: WeightUpdateOptions, prepare: Callable[[], Callable[[], int]]
    ) -> dict[str, Any]:
        """Shared by every path: validate (a bad request changes nothing, aborts nothing), then wait
        for in-flight work (or abort it), write, set the version, flush."""
        with self._control():
            sched = self.scheduler
            try:
                load = prepare()
            except (ValueError, TypeError) as e:
                return _result(False, str(e), self._num_paused())
            if opts.abort_all_requests:
                sched.abort(message="aborted by weight update")
            sched.admission_blocked = True
            try:
                while not sched.can_update_weights():
                    sched.step()  # drain the running batch; new requests wait behind the update
                    self._cond.notify_all()
                start = time.perf_counter()
                try:
                    count = load()
                except (ValueError, TypeError) as e:
                    return _result(False, str(e), self._num_paused())
                if opts.weight_version is not None:
                    sched.weight_version = opts.weight_version
                occ = self.memory_occupation
                if occ.weights_need_refill and self.weight_updater.coverage_complete():
                    occ.weights_need_refill = False
                    sched.memory_block_reason = self._memory_block_reason()
                sched.flush_cache_after_weight_update(opts.flush_cache, opts.torch_empty_cache)
                elapsed = time.perf_counter() - start
                MEMORY_LEDGER.mark("weight_update", f"{count} tensors, {elapsed * 1e3:.1f} ms, "
                                                    f"version={sched.weight_version}")
            finally:
                sched.admission_blocked = False
            return _result(True, f"updated {count} tensors in {elapsed * 1e3:.1f} ms", self._num_paused())

    # ---- memory occupation (colocated trainer)
    def release_memory_occupation(self, tags: list[str] | None = None) -> dict[str, Any]:
        """Give back the memory of `tags` (None: kv_cache, weights, cuda_graph). Needs
        `enable_memory_saver`, and the engine idle or paused with no request holding KV for
        `kv_cache` (whose release also flushes the radix cache)."""
        with self._control():
            try:
                tags = self._memory_saver_tags("release_memory_occupation", tags)
            except ValueError as e:
                return _result(False, str(e))
            sched = self.scheduler
            if sched.paused is None and sched.has_work():
                return _result(False, f"engine is busy ({sched.num_queued()} queued, "
                                      f"{sched.num_running()} running): pause_generation first")
            if "kv_cache" in tags and sched.num_holding_kv():
                return _result(False, f"{sched.num_holding_kv()} request(s) paused in place hold KV; "
                                      "pause with mode='retract' or 'abort' to release kv_cache")
            if "kv_cache" in tags and not self.memory_occupation.is_released("kv_cache"):
                sched.reset_kv_state()
            freed = self.memory_occupation.release(tags)
            if "weights" in tags:
                self.weight_updater.reset_coverage()
            sched.memory_block_reason = self._memory_block_reason()
            MEMORY_LEDGER.mark("release", f"{tags}: {freed / 2**20:.1f} MiB")
        return _result(True, f"released {tags}: {freed / 2**20:.1f} MiB")

    def resume_memory_occupation(self, tags: list[str] | None = None) -> dict[str, Any]:
        """Take the memory of `tags` again; `weights` first lets the trainer push into them before
        `kv_cache` returns. Without a CPU backup, weights come back zeroed and generation is refused
        until updates have covered every parameter."""
        with self._control():
            try:
                tags = self._memory_saver_tags("resume_memory_occupation", tags)
            except ValueError as e:
                return _result(False, str(e))
            self.memory_occupation.resume(tags)
            self.scheduler.memory_block_reason = self._memory_block_reason()
            MEMORY_LEDGER.mark("resume", str(tags))
        return _result(True, f"resumed {tags}")

    def dump_memory_timeline(self, path: str) -> None:
        """Write the memory ledger (release points and lifecycle marks) as JSON for
        `tide memory-plot`."""
        MEMORY_LEDGER.dump_json(path)

    def _memory_saver_tags(self, op: str, tags: list[str] | None) -> list[str]:
        if not self.config.enable_memory_saver:
            raise ValueError(f"{op} needs enable_memory_saver=True")
        return parse_tags(tags)

    def _memory_block_reason(self) -> str | None:
        occ = self.memory_occupation
        released = [t for t in ("kv_cache", "weights") if occ.is_released(t)]
        if released:
            return f"memory of {released} is released; call resume_memory_occupation first"
        if occ.weights_need_refill:
            return ("weights were resumed without a CPU backup; push new weights "
                    "(update_weights_*) covering every parameter first")
        return None

    def _num_paused(self) -> int:
        sched = self.scheduler
        return sched.num_holding_kv() + sched.num_queued() if sched.paused is not None else 0

    def get_server_info(self) -> dict[str, Any]:
        return {
            "model_path": self.config.model_path,
            "max_total_tokens": self.scheduler.max_total_tokens,
            "context_length": self.context_len,
            "device": str(self.model_runner.device),
            "dtype": str(self.model_runner.dtype).replace("torch.", ""),
        }

    def shutdown(self) -> None:
        with self._control():
            self.scheduler.abort(message="engine shutdown")
            for name in list(self.weight_updater.groups):
                self.weight_updater.destroy_group(name)

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def _result(success: bool, message: str, num_paused_requests: int = 0) -> dict[str, Any]:
    return {"success": success, "message": message, "num_paused_requests": num_paused_requests}


def _reserved_bytes() -> int:
    return torch.cuda.memory_reserved() if torch.cuda.is_available() else 0


def _per_item(value: Any, count: int, name: str) -> list[Any]:
    if isinstance(value, list):
        if len(value) != count:
            raise ValueError(f"{name} has {len(value)} entries but there are {count} prompts")
        return list(value)
    return [value] * count


def load_tokenizer(config: EngineConfig) -> Any:
    """The HF tokenizer of `config`; None with `skip_tokenizer_init` (or a dummy model without
    tokenizer files)."""
    from transformers import AutoTokenizer

    if config.skip_tokenizer_init:
        return None
    path = config.tokenizer_path or config.model_path
    has_files = any(
        os.path.isfile(os.path.join(path, n)) for n in ("tokenizer.json", "tokenizer_config.json")
    )
    if not has_files:
        if config.load_format == "dummy":
            return None
        raise ValueError(f"model_path {path!r} has no tokenizer files (tokenizer.json); pass "
                         "skip_tokenizer_init=True (--skip-tokenizer-init) to serve token ids only")
    return AutoTokenizer.from_pretrained(path)
