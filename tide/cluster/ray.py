"""Engine replicas as Ray actors behind one router: `RayEngine` (needs `pip install 'tide[ray]'`).

    ray start --head                                   # or an existing cluster
    python -c "from tide.cluster.ray import RayEngine; e = RayEngine(num_replicas=2); print(e.generate('Hi'))"

`RayEngine(model_path, num_replicas=N, **options)` starts N actors, each holding one `tide.Engine`
built from `options` (`EngineConfig` fields), each in its own placement group: one bundle of
`tp_size` GPUs (all on one node, `STRICT_PACK`) when the cluster has GPUs for every replica, else one
bundle of `num_cpus_per_replica` CPUs. It has `tide.Engine`'s methods:

- `generate` spreads the items of a batch over the replicas by least outstanding requests
  (`tide.cluster.router.Router`) and returns the outputs in order, as `Engine.generate` does;
- every handover method (pause/continue, the weight updates, groups, versions, flush,
  release/resume) runs on every live replica at once and returns one merged reply
  (`merge_replies`): `success` only if every replica succeeded;
- `init_weights_update_group(master_address, master_port, rank_offset, world_size, ...)` gives
  the `k`-th live replica the rank offset `rank_offset + k * tp_size`, so one broadcast group spans
  the trainer (rank 0) and every replica: `world_size = 1 + live replicas * tp_size`.

A replica whose actor dies (node lost, process killed, `ray.kill`) is marked dead and never picked
again; the items it was running come back with finish reason `abort` and a message naming the
replica, while the other replicas' items complete; `health()` and `get_server_info()["replicas"]`
report it. A broadcast group that included it cannot broadcast any more: destroy it and join a new
one with `world_size = 1 + live replicas x tp_size` (the trainer's side too).

Ray is imported only here, and only when a `RayEngine` is made, so tide works without it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from tide.cluster.router import (
    NoLiveReplicaError,
    ReplicaReply,
    Router,
    group_rank_offsets,
    merge_replies,
)
from tide.config import EngineConfig
from tide.engine_io import GenerateOutput, SamplingParamsDict
from tide.io_struct import ENGINE_UNUSED_ARGS, check_unused_args

# Engine methods a replica actor runs on request (nothing else is reachable through `call`).
_HANDOVER_METHODS = frozenset({
    "pause_generation", "continue_generation", "update_weights_from_disk",
    "update_weights_from_tensor", "update_weights_from_distributed", "update_weights_from_ipc",
    "init_weights_update_group", "destroy_weights_update_group", "update_weight_version",
    "release_memory_occupation", "resume_memory_occupation",
})
_REPLICA_METHODS = _HANDOVER_METHODS | {"generate", "flush_cache", "get_weights_by_name",
                                        "get_server_info", "dump_memory_timeline"}
MAX_CONCURRENT_CALLS = 512  # threads of one replica actor: concurrent generate calls + controls


def _import_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise ImportError("tide.cluster.ray needs Ray: pip install 'tide[ray]' (or pip install "
                          "ray)") from None
    return ray


class EngineReplica:
    """The body of one replica actor: a `tide.Engine` and the calls the router makes on it.
    Ray runs it as a threaded actor, so `generate` calls batch together and a pause or an update
    reaches the engine while they run (the engine interleaves them between steps)."""

    def __init__(self, index: int, options: dict[str, Any]) -> None:
        from tide.engine import Engine

        self.index = index
        self.engine = Engine(**options)

    def ready(self) -> dict[str, Any]:
        """Facts about this replica (it answers, so it lives)."""
        info: dict[str, Any] = dict(self.engine.get_server_info())
        info.update(pid=os.getpid(), weight_version=self.weight_version(),
                    has_tokenizer=self.engine.tokenizer is not None,
                    dp_rank=self.engine.config.dp_rank,
                    cuda_visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES"))
        return info

    def weight_version(self) -> str:
        return str(self.engine.handover.weight_version)

    def load(self) -> dict[str, int]:
        """Requests running and queued in this replica's scheduler now."""
        scheduler = self.engine.scheduler
        return {"num_running_reqs": scheduler.num_running(),
                "num_queued_reqs": scheduler.num_queued()}

    def call(self, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if method not in _REPLICA_METHODS:
            raise ValueError(f"{method!r} is not a replica method")
        return getattr(self.engine, method)(*args, **kwargs)

    def shutdown(self) -> None:
        self.engine.shutdown()


class RayEngine:
    """`num_replicas` engines on a Ray cluster behind one least-outstanding-requests router; the
    same methods as `tide.Engine` (see the module docstring).

    `ray_address`: the cluster to join when Ray is not initialized yet (default "auto": the one
    `ray start --head` started). `num_cpus_per_replica`: CPUs each replica reserves.
    `placement_timeout`: seconds to wait for the cluster to place every replica (and for the
    replicas to load) before giving up and releasing what was reserved. `options`: `EngineConfig`
    fields for every replica (`tp_size`, where the engine has it, sizes each replica's GPU bundle;
    `dp_rank` is not one: replica i gets `dp_rank` i, so replicas draw different unseeded samples).
    """

    def __init__(self, model_path: str | None = None, *, num_replicas: int = 1,
                 num_cpus_per_replica: float = 1.0, ray_address: str | None = "auto",
                 placement_timeout: float = 600.0, **options: Any) -> None:
        known = {f.name for f in dataclasses.fields(EngineConfig)}
        unknown = sorted(set(options) - known)
        if "dp_rank" in options:
            raise ValueError("dp_rank is set per replica (replica i has dp_rank i); do not pass it")
        if unknown:
            raise ValueError(f"unknown engine option(s) {unknown}; allowed options are "
                             f"{sorted(known)}")
        if not isinstance(num_cpus_per_replica, (int, float)) or num_cpus_per_replica <= 0:
            raise ValueError(f"num_cpus_per_replica must be > 0, got {num_cpus_per_replica!r}")
        self.router = Router(num_replicas)  # checks num_replicas
        ray = _import_ray()
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if not ray.is_initialized():
            ray.init(address=ray_address)
        self._ray = ray
        self.tp_size = int(options.get("tp_size", 1))
        device = str(options.get("device", "auto"))
        gpus = int(ray.cluster_resources().get("GPU", 0))
        needed = num_replicas * self.tp_size
        self.use_gpu = device != "cpu" and gpus >= needed
        if device.startswith("cuda") and not self.use_gpu:
            raise ValueError(f"device {device!r}: {num_replicas} replicas x tp_size "
                             f"{self.tp_size} need {needed} GPUs and the cluster has {gpus}")
        if self.use_gpu:
            options["device"] = "cuda"  # Ray shows each actor only its own GPUs
            bundle = {"GPU": float(self.tp_size), "CPU": float(num_cpus_per_replica)}
        else:
            options["device"] = "cpu"
            bundle = {"CPU": float(num_cpus_per_replica)}
        if model_path is not None:
            options["model_path"] = model_path
        self.placement_groups = [placement_group([bundle], strategy="STRICT_PACK")
                                 for _ in range(num_replicas)]
        self.actors: list[Any] = []
        try:
            ready = [pg.ready() for pg in self.placement_groups]
            done, _ = ray.wait(ready, num_returns=len(ready), timeout=placement_timeout)
            if len(done) < len(ready):
                raise RuntimeError(
                    f"the Ray cluster could not place {num_replicas} replicas of {bundle} within "
                    f"{placement_timeout:.0f} s (available: {ray.available_resources()})")
            actor_class = ray.remote(EngineReplica)
            for index, pg in enumerate(self.placement_groups):
                self.actors.append(actor_class.options(
                    num_cpus=bundle["CPU"], num_gpus=bundle.get("GPU", 0),
                    max_concurrency=MAX_CONCURRENT_CALLS, name=None,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        placement_group=pg, placement_group_bundle_index=0,
                        placement_group_capture_child_tasks=True),
                ).remote(index, {**options, "dp_rank": index}))
            self.replica_info = self._wait_ready(placement_timeout)
        except BaseException:
            for actor in self.actors:
                ray.kill(actor)
            for pg in self.placement_groups:
                remove_placement_group(pg)
            raise
        self.has_tokenizer = bool(self.replica_info[0]["has_tokenizer"])
        # async_generate's threads: as many calls at once as the replicas together take.
        self._executor = ThreadPoolExecutor(max_workers=MAX_CONCURRENT_CALLS * num_replicas,
                                            thread_name_prefix="tide-ray-generate")

    def _wait_ready(self, timeout: float) -> list[dict[str, Any]]:
        ray = self._ray
        refs = [actor.ready.remote() for actor in self.actors]
        done, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout)
        if len(done) < len(refs):
            raise RuntimeError(f"the replicas did not load within {timeout:.0f} s")
        infos = []
        for index, ref in enumerate(refs):
            try:
                infos.append(ray.get(ref))
            except ray.exceptions.RayError as e:
                raise RuntimeError(f"replica {index} failed to start: {_cause(e)}") from None
        return infos

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
        """`Engine.generate`, with the items of a batch spread over the replicas (least
        outstanding requests first). Items on a replica that dies come back with finish reason
        `abort` and a message naming it; a bad item raises `ValueError` as in `Engine.generate`,
        sglang's unused arguments too (`tide.io_struct.ENGINE_UNUSED_ARGS`)."""
        check_unused_args(unused, ENGINE_UNUSED_ARGS)
        if (prompt is None) == (input_ids is None):
            raise ValueError("exactly one of prompt or input_ids must be given")
        inputs: Any = prompt if prompt is not None else input_ids
        single = isinstance(prompt, str) or (input_ids is not None and bool(input_ids)
                                             and not isinstance(input_ids[0], list))
        items: list[Any] = [inputs] if single else list(inputs or [])
        if not items:
            raise ValueError("prompt / input_ids must not be empty")
        per_item = {"sampling_params": sampling_params, "return_logprob": return_logprob,
                    "top_logprobs_num": top_logprobs_num, "rid": rid,
                    "logprob_start_len": logprob_start_len}
        for name, value in per_item.items():
            if isinstance(value, list) and len(value) != len(items):
                raise ValueError(f"{name} has {len(value)} entries but there are {len(items)} "
                                 "prompts")
        assigned: dict[int, list[int]] = {}
        try:
            for item in range(len(items)):
                assigned.setdefault(self.router.pick(), []).append(item)
        except NoLiveReplicaError:
            for index, members in assigned.items():
                self.router.finish(index, len(members))
            raise
        refs = {}
        for index, members in assigned.items():
            kwargs = {name: [value[i] for i in members] if isinstance(value, list) else value
                      for name, value in per_item.items()}
            key = "prompt" if prompt is not None else "input_ids"
            kwargs[key] = [items[i] for i in members]
            refs[index] = self.actors[index].call.remote("generate", (), kwargs)
        start = time.perf_counter()
        per_item_out: dict[int, list[GenerateOutput]] = {}
        error: BaseException | None = None
        for index, members in assigned.items():
            try:
                outputs = self._ray.get(refs[index])
            except self._ray.exceptions.RayActorError as e:
                reason = self._replica_died(index, e)
                for i in members:
                    per_item_out[i] = self._aborted(items[i], per_item, i, reason,
                                                    time.perf_counter() - start)
                continue
            except ValueError as e:  # a bad item: raised after every replica's part is collected
                error = error or ValueError(_cause(e))
                continue
            finally:
                self.router.finish(index, len(members))
            cursor = 0
            for i in members:
                n = _copies(per_item["sampling_params"], i)
                per_item_out[i] = outputs[cursor:cursor + n]
                cursor += n
        if error is not None:
            raise error
        flat = [out for i in range(len(items)) for out in per_item_out[i]]
        return flat[0] if single and len(flat) == 1 else flat

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
        """`generate`, awaited: it runs on a thread of this engine's own pool (as many as the
        replicas take calls at once), and the replicas batch concurrent calls as
        `Engine.generate` from several threads does. Cancelling the awaiting task does not stop
        the call: its items run to their end on the replicas."""
        check_unused_args(unused, ENGINE_UNUSED_ARGS)
        call = functools.partial(self.generate, prompt, sampling_params, input_ids,
                                 return_logprob, top_logprobs_num, rid, logprob_start_len)
        return await asyncio.get_running_loop().run_in_executor(self._executor, call)

    def _aborted(self, item: Any, per_item: dict[str, Any], i: int, reason: str,
                 latency: float) -> list[GenerateOutput]:
        rids = per_item["rid"]
        rid = rids[i] if isinstance(rids, list) else rids
        n = _copies(per_item["sampling_params"], i)
        outs: list[GenerateOutput] = []
        for j in range(n):
            out: GenerateOutput = {"output_ids": [], "meta_info": {
                "id": (f"{rid}-{j}" if n > 1 else rid) if rid else "",
                "finish_reason": {"type": "abort", "message": reason},
                "weight_version": None, "prompt_tokens": len(item) if isinstance(item, list) else 0,
                "completion_tokens": 0, "cached_tokens": 0, "e2e_latency": latency}}
            if self.has_tokenizer:
                out["text"] = ""
            outs.append(out)
        return outs

    # ---- fan-out of the handover API
    def _fan_out(self, method: str, per_replica: Callable[[int], tuple[tuple, dict]]
                 ) -> tuple[list[ReplicaReply], list[dict[str, Any]]]:
        """Call `method` on every live replica at once; (their replies, the dead replicas)."""
        ray = self._ray
        live = self.router.live_indices()
        if not live:
            raise NoLiveReplicaError("every replica has died: "
                                     + "; ".join(f"replica {r['index']}: {r['dead_reason']}"
                                                 for r in self.router.describe()))
        skipped = [r for r in self.router.describe() if not r["alive"]]
        refs = {i: self.actors[i].call.remote(method, *per_replica(i)) for i in live}
        replies: list[ReplicaReply] = []
        error: BaseException | None = None
        for index, ref in refs.items():
            try:
                result = ray.get(ref)
            except ray.exceptions.RayActorError as e:
                replies.append(ReplicaReply(index, False, self._replica_died(index, e)))
                continue
            except ValueError as e:
                error = error or ValueError(_cause(e))
                continue
            if isinstance(result, dict) and "success" in result:
                data = {k: v for k, v in result.items() if k not in ("success", "message")}
                replies.append(ReplicaReply(index, bool(result["success"]),
                                            str(result.get("message", "")), data))
            else:
                replies.append(ReplicaReply(index, True, "", {"value": result}))
        if error is not None:
            raise error
        return replies, skipped

    def _handover(self, method: str, *args: Any, **kwargs: Any) -> dict[str, Any]:
        replies, skipped = self._fan_out(method, lambda _i: (args, kwargs))
        merged = merge_replies(replies, skipped)
        return {"success": merged.success, "message": merged.message,
                "num_paused_requests": 0, **merged.data}

    def pause_generation(self, mode: str = "abort") -> dict[str, Any]:
        return self._handover("pause_generation", mode)

    def continue_generation(self, torch_empty_cache: bool = True) -> dict[str, Any]:
        return self._handover("continue_generation", torch_empty_cache)

    def update_weights_from_disk(self, model_path: str, load_format: str | None = None,
                                 **options: Any) -> dict[str, Any]:
        return self._handover("update_weights_from_disk", model_path, load_format, **options)

    def update_weights_from_tensor(self, named_tensors: Any = None,
                                   serialized_named_tensors: Any = None,
                                   load_format: str | None = None, **options: Any
                                   ) -> dict[str, Any]:
        """Tensors (`named_tensors`, sent to every replica by Ray) or a serialized payload."""
        return self._handover("update_weights_from_tensor", named_tensors,
                              serialized_named_tensors, load_format, **options)

    def update_weights_from_distributed(self, names: list[str], dtypes: list[str],
                                        shapes: list[list[int]],
                                        group_name: str = "weight_update_group",
                                        load_format: str | None = None, **options: Any
                                        ) -> dict[str, Any]:
        """Every replica receives the trainer's broadcasts at once (one group spans them all)."""
        return self._handover("update_weights_from_distributed", names, dtypes, shapes,
                              group_name, load_format, **options)

    def update_weights_from_ipc(self, serialized_buckets: str | bytes, **options: Any
                                ) -> dict[str, Any]:
        return self._handover("update_weights_from_ipc", serialized_buckets, **options)

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int,
                                  world_size: int, group_name: str = "weight_update_group",
                                  backend: str = "nccl", timeout: float = 120.0
                                  ) -> dict[str, Any]:
        """Every live replica joins the trainer's group: the `k`-th as ranks from
        `rank_offset + k * tp_size` (`world_size` must be at least
        `rank_offset + live replicas * tp_size`)."""
        live = self.router.live_indices()  # ranks go to the live replicas, densely
        offsets = dict(zip(live, group_rank_offsets(rank_offset, world_size, len(live),
                                                    self.tp_size)))
        replies, skipped = self._fan_out("init_weights_update_group", lambda i: (
            (master_address, master_port, offsets[i], world_size, group_name, backend, timeout),
            {}))
        merged = merge_replies(replies, skipped)
        return {"success": merged.success, "message": merged.message,
                "num_paused_requests": 0, **merged.data}

    def destroy_weights_update_group(self, group_name: str = "weight_update_group"
                                     ) -> dict[str, Any]:
        return self._handover("destroy_weights_update_group", group_name)

    def update_weight_version(self, new_version: str, abort_all_requests: bool = True
                              ) -> dict[str, Any]:
        return self._handover("update_weight_version", new_version, abort_all_requests)

    def release_memory_occupation(self, tags: list[str] | None = None) -> dict[str, Any]:
        return self._handover("release_memory_occupation", tags)

    def resume_memory_occupation(self, tags: list[str] | None = None) -> dict[str, Any]:
        return self._handover("resume_memory_occupation", tags)

    def flush_cache(self, empty_cache: bool = True) -> bool:
        """True only if every live replica flushed (each must be idle)."""
        replies, _ = self._fan_out("flush_cache", lambda _i: ((empty_cache,), {}))
        return all(r.success and r.data.get("value") is True for r in replies)

    def get_weights_by_name(self, name: str, truncate_size: int = 100) -> list[float]:
        """From the first live replica (every replica holds the same weights)."""
        index = self._first_live()
        return self._call(index, "get_weights_by_name", name, truncate_size)

    @property
    def weight_version(self) -> str:
        """The version every live replica serves (RuntimeError if they disagree)."""
        versions = self.weight_versions()
        distinct = {v for v in versions if v is not None}
        if len(distinct) != 1:
            raise RuntimeError(f"replicas serve different weight versions: {versions}")
        return distinct.pop()

    def weight_versions(self) -> list[str | None]:
        """Each replica's weight version (None for a dead one)."""
        ray = self._ray
        live = self.router.live_indices()
        refs = {i: self.actors[i].weight_version.remote() for i in live}
        out: list[str | None] = [None] * self.router.num_replicas
        for index, ref in refs.items():
            try:
                out[index] = ray.get(ref)
            except ray.exceptions.RayActorError as e:
                self._replica_died(index, e)
        return out

    def health(self, timeout: float = 10.0) -> list[dict[str, Any]]:
        """Ask every live replica to answer within `timeout` seconds; one that has died is marked
        so. Returns the router's view of every replica (`alive`, `dead_reason`, ...)."""
        ray = self._ray
        refs = {i: self.actors[i].ready.remote() for i in self.router.live_indices()}
        for index, ref in refs.items():
            try:
                ray.get(ref, timeout=timeout)
            except ray.exceptions.RayActorError as e:
                self._replica_died(index, e)
            except ray.exceptions.GetTimeoutError:
                pass  # busy, not dead (a long weight update); alive stays True
        return self.router.describe()

    def get_server_info(self, timeout: float = 10.0) -> dict[str, Any]:
        """Facts as the replicas report them now: the first live replica's at the top level (its
        weight version, memory and KV state), `num_replicas`, `tp_size`, and one entry per replica
        with its pid, `dp_rank` (its unseeded sampling stream), devices and `weight_version`
        (None for a dead replica; a live one that does not answer within `timeout` seconds shows
        its facts from start-up)."""
        ray = self._ray
        live = self.router.live_indices()
        refs = {i: self.actors[i].ready.remote() for i in live}
        facts: list[dict[str, Any] | None] = [None] * self.router.num_replicas
        for index, ref in refs.items():
            try:
                facts[index] = ray.get(ref, timeout=timeout)
            except ray.exceptions.RayActorError as e:
                self._replica_died(index, e)
            except ray.exceptions.GetTimeoutError:
                facts[index] = self.replica_info[index]
        first = next((f for f in facts if f is not None), self.replica_info[0])
        info: dict[str, Any] = {k: v for k, v in first.items()
                                if k not in ("pid", "cuda_visible_devices", "has_tokenizer",
                                             "dp_rank")}
        replicas = self.router.describe()
        for index, entry in enumerate(replicas):
            start = self.replica_info[index]
            now = facts[index]
            entry.update(pid=start["pid"], dp_rank=start["dp_rank"],
                         cuda_visible_devices=start["cuda_visible_devices"],
                         weight_version=now["weight_version"] if now is not None else None)
        info.update(num_replicas=self.router.num_replicas, tp_size=self.tp_size,
                    replicas=replicas)
        return info

    def shutdown(self) -> None:
        """Stop every replica and give back their placement groups."""
        from ray.util.placement_group import remove_placement_group

        ray = self._ray
        self._executor.shutdown(wait=False, cancel_futures=True)
        refs = [self.actors[i].shutdown.remote() for i in self.router.live_indices()]
        ray.wait(refs, num_returns=len(refs), timeout=30)
        for actor in self.actors:
            ray.kill(actor)
        for pg in self.placement_groups:
            remove_placement_group(pg)

    def __enter__(self) -> RayEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # ---- internals
    def _first_live(self) -> int:
        live = self.router.live_indices()
        if not live:
            raise NoLiveReplicaError("every replica has died")
        return live[0]

    def _call(self, index: int, method: str, *args: Any, **kwargs: Any) -> Any:
        ray = self._ray
        try:
            return ray.get(self.actors[index].call.remote(method, args, kwargs))
        except ray.exceptions.RayActorError as e:
            raise RuntimeError(self._replica_died(index, e)) from None
        except ValueError as e:
            raise ValueError(_cause(e)) from None

    def _replica_died(self, index: int, error: BaseException) -> str:
        reason = f"replica {index} (pid {self.replica_info[index]['pid']}) died: " \
                 f"{type(error).__name__}"
        self.router.mark_dead(index, reason)
        return reason


def _copies(sampling_params: Any, item: int) -> int:
    """How many outputs item `item` yields (its `n`)."""
    params = sampling_params[item] if isinstance(sampling_params, list) else sampling_params
    n = params.get("n", 1) if isinstance(params, dict) else getattr(params, "n", 1)
    return int(n) if isinstance(n, int) and n > 0 else 1


def _cause(error: BaseException) -> str:
    """The message of the exception a replica raised (without Ray's wrapping)."""
    cause = getattr(error, "cause", None)
    return str(cause) if cause is not None else str(error).splitlines()[-1]
