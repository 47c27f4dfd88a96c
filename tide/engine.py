"""In-process engine with an sglang-shaped offline API (`tide.Engine`).

A thin driver over the scheduler side (`tide.scheduler.create_scheduler`): it turns `generate`
arguments into requests, steps the scheduler until they finish, and forwards every handover call to
the scheduler's `Handover`. It alone holds the lock that lets `generate` run from several threads
while another pauses, updates or continues: those interleave only between steps. `async_generate`
awaits instead: a background thread steps while any such call waits (`tide.async_calls`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import time
from collections.abc import Iterator
from typing import Any

from tide.async_calls import AsyncCall, AsyncCalls
from tide.config import EngineConfig
from tide.engine_io import (
    GenerateOutput,
    InputLimits,
    SamplingParamsDict,
    build_requests,
    make_output,
)
from tide.executor.model_runner import ModelRunner
from tide.io_struct import ENGINE_UNUSED_ARGS, WeightUpdateOptions, check_unused_args
from tide.memory.ledger import MemoryLedger
from tide.scheduler.handover import (
    DiskUpdate,
    DistributedUpdate,
    HandoverReply,
    HandoverResult,
    IPCUpdate,
    TensorUpdate,
    WeightUpdate,
)
from tide.scheduler.profile import ProfileOptions
from tide.scheduler.request import Req
from tide.scheduler.scheduler import create_scheduler
from tide.scheduler.worker import ModelWorker
from tide.weights.update import TensorPayload

logger = logging.getLogger(__name__)

# Values of the `WeightUpdateOptions` keyword arguments (`flush_cache`, `torch_empty_cache`,
# `abort_all_requests`, `weight_version`) that every `update_weights_*` method takes.
UpdateOption = bool | str | None


class Engine:
    """Load a model and generate.

    `Engine(model_path=None, **options)`: options are `EngineConfig` fields; unknown ones raise
    `ValueError`. With no `model_path` the built-in demo model is used.
    """

    def __init__(self, model_path: str | None = None, **kwargs: Any) -> None:
        self.config = EngineConfig.from_kwargs(model_path=model_path, **kwargs)
        logging.getLogger("tide").setLevel(self.config.log_level.upper())
        self.scheduler = create_scheduler(self.config)
        self.handover = self.scheduler.handover
        self.tokenizer = self.scheduler.tokenizer
        self.eos_token_ids = tuple(sorted(self.scheduler.eos_token_ids))
        self.context_len = self.worker.context_len
        model_config = self.scheduler.model_config
        assert model_config is not None  # create_scheduler always sets it
        self.model_config = model_config
        self._limits = InputLimits(
            model_config.vocab_size, self.context_len, self.worker.max_total_tokens,
            "skip_tokenizer_init=True" if self.config.skip_tokenizer_init
            else "the checkpoint has no tokenizer files", self.config.grammar_backend,
            self.eos_token_ids)
        # One lock for the scheduler and the model: generate() from several threads, and pause /
        # update / continue from another, interleave only between steps.
        self._cond = threading.Condition(threading.RLock())
        # Control calls waiting for the lock; a stepping thread yields to them between steps (a
        # plain lock is not fair: the stepping thread would re-take it before anyone else).
        self._controls_waiting = 0
        self._controls_lock = threading.Lock()
        self._shut_down = False
        self._async = AsyncCalls(self, self.model_runner.device)  # async_generate's calls

    @property
    def worker(self) -> ModelWorker:
        """The in-process worker, or with `tp_size > 1` the group of rank workers."""
        return self.scheduler.worker

    @property
    def model_runner(self) -> ModelRunner:
        """Rank 0's model runner (the only one with `tp_size == 1`)."""
        runner = getattr(self.worker, "model_runner", None)
        assert isinstance(runner, ModelRunner)  # both workers have one
        return runner

    @property
    def memory_ledger(self) -> MemoryLedger:
        """This engine's release points and lifecycle marks."""
        return self.scheduler.ledger

    # ---- generation
    def generate(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: SamplingParamsDict | list[SamplingParamsDict] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        return_logprob: bool | list[bool] = False,
        top_logprobs_num: int | list[int] = 0,
        rid: str | list[str] | None = None,
        logprob_start_len: int | list[int] = -1,
        **unused: Any,
    ) -> GenerateOutput | list[GenerateOutput]:
        """Generate for one item (returns a dict) or a list of items (returns a list of dicts).

        With `return_logprob`, `logprob_start_len` >= 0 (sglang's name) also scores the prompt:
        `meta_info["input_token_logprobs"]` holds (logprob, token id) for every prompt position
        from it on (None for position 0, which nothing predicts), and with `top_logprobs_num`
        `input_top_logprobs` the best alternatives. They use the request's temperature, as output
        logprobs do (penalties are not applied), so scoring prompt + output gives the logprobs the
        output was generated with. `max_new_tokens=0` only scores. The scored positions are
        computed even when the prompt's prefix is cached.

        Every item is validated before any is submitted, so bad input raises `ValueError` and leaves
        the engine as it was.
        """
        single, reqs = self._build(prompt, sampling_params, input_ids, return_logprob,
                                   top_logprobs_num, rid, logprob_start_len, unused)
        start = time.perf_counter()
        with self._cond:
            if self._shut_down:  # shut down since `_build` looked
                raise RuntimeError("the engine is shut down")
            for req in reqs:
                self.scheduler.add_request(req)
        self._run_until_finished(reqs)
        return self._outputs(reqs, single, start)

    async def async_generate(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: SamplingParamsDict | list[SamplingParamsDict] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        return_logprob: bool | list[bool] = False,
        top_logprobs_num: int | list[int] = 0,
        rid: str | list[str] | None = None,
        logprob_start_len: int | list[int] = -1,
        **unused: Any,
    ) -> GenerateOutput | list[GenerateOutput]:
        """`generate` for asyncio code (sglang's name), with the same arguments and outputs. The
        requests join the running batch, and the call returns when they have finished: the
        requests of many concurrent calls (an agent loop's trajectories) decode together. A
        background thread submits them and steps the scheduler while any call waits
        (`tide.async_calls`); the event loop never takes the engine lock. Bad input raises
        `ValueError` before anything is submitted. Cancelling the awaiting task aborts the call's
        unfinished requests (those very requests: another call's with the same rid runs on)."""
        single, reqs = self._build(prompt, sampling_params, input_ids, return_logprob,
                                   top_logprobs_num, rid, logprob_start_len, unused)
        loop = asyncio.get_running_loop()
        start = time.perf_counter()
        call = AsyncCall(reqs, loop.create_future(), loop,
                         lambda done: self._outputs(done, single, start))
        self._async.submit(call)
        try:
            return await call.future
        except asyncio.CancelledError:
            call.cancelled = True  # the thread aborts its requests between steps
            raise

    def _build(self, prompt: Any, sampling_params: Any, input_ids: Any, return_logprob: Any,
               top_logprobs_num: Any, rid: Any, logprob_start_len: Any,
               unused: dict[str, Any]) -> tuple[bool, list[Req]]:
        """`generate`'s arguments as requests, every one validated (ValueError) before any is
        submitted; `unused`: sglang's arguments for what tide lacks (`check_unused_args`)."""
        check_unused_args(unused, ENGINE_UNUSED_ARGS)
        if self._shut_down:
            raise RuntimeError("the engine is shut down")
        blocked = self.handover.memory_block_reason
        if blocked is not None:
            raise ValueError(blocked)
        return build_requests(prompt, input_ids, sampling_params, return_logprob,
                              top_logprobs_num, rid, self.tokenizer, self._limits,
                              logprob_start_len)

    def _outputs(self, reqs: list[Req], single: bool, start: float
                 ) -> GenerateOutput | list[GenerateOutput]:
        latency = time.perf_counter() - start
        outputs = [make_output(r, self.tokenizer, latency) for r in reqs]
        return outputs[0] if single and len(outputs) == 1 else outputs

    def _run_until_finished(self, reqs: list[Req]) -> None:
        """Step the scheduler until every request in `reqs` has finished. Any thread that holds the
        lock steps for everyone; while paused (or while a weight update drains), wait."""
        while True:
            with self._cond:
                if all(r.finished for r in reqs):
                    return
                sched = self.scheduler
                if self._controls_waiting or sched.is_blocked():
                    self._cond.wait(timeout=0.05)
                    continue
                if not sched.has_work():
                    raise RuntimeError("scheduler went idle with requests still pending")
                sched.step()
                self._cond.notify_all()

    @contextlib.contextmanager
    def _open(self) -> Iterator[None]:
        """`_control` for an operation on a live engine (RuntimeError once it is shut down)."""
        with self._control():
            if self._shut_down:
                raise RuntimeError("the engine is shut down")
            yield

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

    # ---- cache
    def flush_cache(self, empty_cache: bool = True) -> bool:
        """Reset radix cache, request pool and KV allocator when fully idle (and, if `empty_cache`,
        empty the device allocator cache); False with a log line of the queued/running counts
        otherwise."""
        _check_flag(empty_cache, "empty_cache")
        with self._control():  # also after shutdown: the accounting can still be checked
            ok, message = self.scheduler.flush_cache(empty_cache)
        if not ok:
            logger.warning(message)
        return ok

    # ---- profiling (sglang's names; tide/scheduler/profile.py)
    def start_profile(self, output_dir: str | None = None, num_steps: int | None = None,
                      activities: list[str] | None = None, record_shapes: bool = False,
                      with_stack: bool = False, profile_id: str | None = None) -> None:
        """Start torch.profiler on every rank: forwards from now on, until `stop_profile()` or,
        with `num_steps`, that many forwards. Each rank writes `{profile_id}-TP-{rank}.trace.json`
        and `.kernels.json` into `output_dir` (default `$TIDE_TORCH_PROFILER_DIR`, else
        `{tempdir}/tide-profile-{uid}`). ValueError for a bad option; RuntimeError if a profile is
        running or the directory is not private to this user."""
        options = ProfileOptions(
            output_dir=output_dir or "", num_steps=num_steps,
            activities=None if activities is None else tuple(activities),
            record_shapes=record_shapes, with_stack=with_stack, profile_id=profile_id or "")
        with self._open():
            self.scheduler.start_profile(options)

    def stop_profile(self) -> list[str]:
        """Stop the running profile; the files every rank wrote. RuntimeError if none is running
        (a profile with `num_steps` stops by itself)."""
        with self._open():
            return self.scheduler.stop_profile()

    # ---- training <-> rollout handover (sglang's names, bodies and defaults; see Handover)
    def pause_generation(self, mode: str = "abort") -> HandoverReply:
        """`abort`, `retract` or `in_place`. Requests submitted while paused queue until
        `continue_generation`."""
        with self._open():
            return self.handover.pause_generation(mode).to_dict()

    def continue_generation(self, torch_empty_cache: bool = True) -> HandoverReply:
        """Resume; with `torch_empty_cache`, empty the allocator cache first, while still paused."""
        _check_flag(torch_empty_cache, "torch_empty_cache")
        with self._open():
            return self.handover.continue_generation(torch_empty_cache).to_dict()

    def update_weights_from_disk(self, model_path: str, load_format: str | None = None,
                                 **options: UpdateOption) -> HandoverReply:
        """Load an HF safetensors directory (same names as the initial load) into the live model.
        `options`: `WeightUpdateOptions` fields, here and in every `update_weights_*`."""
        if isinstance(model_path, os.PathLike):
            model_path = os.fspath(model_path)
        if not isinstance(model_path, str):
            raise ValueError(f"model_path must be a path (str or os.PathLike), got "
                             f"{type(model_path).__name__}")
        return self._update_weights(DiskUpdate(model_path, load_format), options)

    def update_weights_from_tensor(
        self,
        named_tensors: TensorPayload | None = None,
        serialized_named_tensors: str | bytes | list[str] | None = None,
        load_format: str | None = None,
        **options: UpdateOption,
    ) -> HandoverReply:
        """In-process tensors: `named_tensors` as [(name, tensor), ...], or with
        `load_format="flattened_bucket"` a `FlattenedBucket` (or a list, one per dtype). From another
        process: `serialized_named_tensors` made by `tide.weights.serialize_named_tensors`."""
        return self._update_weights(
            TensorUpdate(named_tensors, serialized_named_tensors, load_format), options)

    def update_weights_from_distributed(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        group_name: str = "weight_update_group",
        load_format: str | None = None,
        **options: UpdateOption,
    ) -> HandoverReply:
        """Receive the tensors the trainer (rank 0) broadcasts, in `names` order."""
        return self._update_weights(
            DistributedUpdate(names, dtypes, shapes, group_name, load_format), options)

    def update_weights_from_ipc(self, serialized_buckets: str | bytes | list[str | bytes],
                                **options: UpdateOption) -> HandoverReply:
        """A colocated trainer's bucket buffers, shared as CUDA IPC handles (with `tp_size > 1`,
        one payload every rank maps, or a list of one per rank)."""
        return self._update_weights(IPCUpdate(serialized_buckets), options)

    def _update_weights(self, update: WeightUpdate, options: dict[str, UpdateOption]
                        ) -> HandoverReply:
        """Validate (a bad request changes nothing), wait for in-flight work (stepping it here) or
        abort it, then write, set the version, flush."""
        opts = WeightUpdateOptions.from_kwargs(options)
        results: list[HandoverResult] = []
        with self._open():
            self.handover.submit_update(update, opts, results.append)
            while not results:
                if not self.handover.apply_ready_updates():
                    self.scheduler.step()  # drain the running batch; new requests wait behind
                    self._cond.notify_all()
        return results[0].to_dict()

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int,
                                  world_size: int, group_name: str = "weight_update_group",
                                  backend: str = "nccl", timeout: float = 120.0) -> HandoverReply:
        """Join the trainer's broadcast group as rank `rank_offset` (the trainer is rank 0); fails
        (keeping nothing of the attempt) if the trainer has not joined within `timeout` seconds
        (at most 600)."""
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
            raise ValueError(f"timeout must be a number of seconds, got {timeout!r}")
        return self.handover.init_weights_update_group(
            master_address, master_port, rank_offset, world_size, group_name, backend,
            timeout).to_dict()

    def destroy_weights_update_group(self, group_name: str = "weight_update_group"
                                     ) -> HandoverReply:
        return self.handover.destroy_weights_update_group(group_name).to_dict()

    def get_weights_by_name(self, name: str, truncate_size: int = 100) -> list[float]:
        """The first `truncate_size` values of checkpoint tensor `name`, flattened."""
        if not isinstance(name, str):
            raise ValueError(f"name must be a string, got {type(name).__name__}")
        if isinstance(truncate_size, bool) or not isinstance(truncate_size, int) or truncate_size < 0:
            raise ValueError(f"truncate_size must be an int >= 0, got {truncate_size!r}")
        with self._open():
            return self.handover.get_weights_by_name(name, truncate_size)

    def update_weight_version(self, new_version: str, abort_all_requests: bool = True
                              ) -> HandoverReply:
        _check_flag(abort_all_requests, "abort_all_requests")
        with self._open():
            return self.handover.update_weight_version(new_version, abort_all_requests).to_dict()

    # ---- memory occupation (colocated trainer)
    def release_memory_occupation(self, tags: list[str] | None = None) -> HandoverReply:
        """Give back the memory of `tags` (None: kv_cache, weights, cuda_graph); needs
        `enable_memory_saver` and the engine idle or paused."""
        _check_tags(tags)
        with self._open():
            return self.handover.release_memory_occupation(tags).to_dict()

    def resume_memory_occupation(self, tags: list[str] | None = None) -> HandoverReply:
        """Take the memory of `tags` again (`weights` first lets the trainer push into them)."""
        _check_tags(tags)
        with self._open():
            return self.handover.resume_memory_occupation(tags).to_dict()

    def drop_cpu_backup(self) -> HandoverReply:
        """Free the host memory that `enable_cpu_backup` keeps for the weights from the first release
        on (as large as the weights); the next release allocates it again. Refused while the
        weights are released."""
        with self._open():
            return self.handover.drop_cpu_backup().to_dict()

    def dump_memory_timeline(self, path: str) -> None:
        """Write this engine's memory ledger as JSON for `tide memory-plot`."""
        self.memory_ledger.dump_json(path)

    def get_server_info(self) -> dict[str, Any]:
        info = self.scheduler.server_info()
        return {key: info[key] for key in ("model_path", "max_total_tokens", "context_length",
                                           "device", "dtype", "kv_cache_layout")}

    def shutdown(self) -> None:
        """Abort every request, leave trainer groups, stop the rank processes (tp_size > 1) and
        give the device memory back: weights, KV pools, CUDA graphs and scratch are freed in place
        (`ModelRunner.close`), so references still held to the engine or its parts pin none of
        it, and the next engine in this process sizes its KV cache from the freed memory. The
        engine cannot generate afterwards; a second call does nothing."""
        with self._control():
            if self._shut_down:
                return
            self._shut_down = True
            self.handover.shutdown("engine shutdown")
            self.worker.shutdown()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def _check_flag(value: object, name: str) -> None:
    """ValueError naming `name` unless `value` is a bool (a string such as "false" is truthy)."""
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool, got {value!r}")


def _check_tags(tags: object) -> None:
    """ValueError unless `tags` is None or a list/tuple of strings."""
    if tags is not None and (not isinstance(tags, (list, tuple))
                             or not all(isinstance(t, str) for t in tags)):
        raise ValueError(f"tags must be a list of strings or None, got {tags!r}")
