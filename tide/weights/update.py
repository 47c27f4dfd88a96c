"""Writing new weights into a live model, all-or-nothing at the validation level.

Every path first validates the complete list of (name, shape, dtype) against the model and only then
writes. A bad name, shape or dtype raises `ValueError` naming the tensor before any parameter changes.
Tensor paths (in-process, buckets, distributed, IPC) require the model's exact dtype; the disk path
casts like the initial load does.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Sequence

import torch
from torch import nn

from tide.weights.bucket import FlattenedBucket, flatten_by_dtype
from tide.weights.distributed import (
    DEFAULT_JOIN_TIMEOUT_S,
    MAX_JOIN_TIMEOUT_S,
    UpdateHeader,
    WeightUpdateGroup,
    init_custom_process_group,
)
from tide.weights.loader import PinnedStaging, read_checkpoint_shapes, write_checkpoint
from tide.weights.mapping import WeightMap, WeightTarget
from tide.weights.receive import BroadcastReceiver, Dest, PartDest, back_to_back
from tide.weights.wire import deserialize_named_tensors

logger = logging.getLogger(__name__)

LOAD_FORMATS = (None, "flattened_bucket")
# Tensor updates also take per-rank payloads that hold each rank's part already (sglang's per-rank
# serialized lists, sharded by the trainer).
SHARDED = "sharded"
TENSOR_LOAD_FORMATS = (*LOAD_FORMATS, SHARDED)
# In-process tensors of an update: [(name, tensor), ...], or flattened buckets (one, or one per dtype).
NamedTensors = Sequence[tuple[str, torch.Tensor]]
TensorPayload = NamedTensors | FlattenedBucket | Sequence[FlattenedBucket]
_DTYPES = {
    "float32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16,
    "float16": torch.float16, "half": torch.float16,
}


class PartialWriteError(RuntimeError):
    """An update failed after it had begun writing parameters (a read, copy or broadcast failed
    part-way): some parameters may hold new values, some old. Validation errors (ValueError) are
    raised before the first write and never this."""


def _writing(what: str, write: Callable[[], int]) -> int:
    """`write()`, with any failure in it reported as a `PartialWriteError`."""
    try:
        return write()
    except Exception as e:  # re-raised as what it means for the weights
        raise PartialWriteError(f"{what} failed part-way: {type(e).__name__}: {e}") from e


def parse_dtype(value: str | torch.dtype) -> torch.dtype:
    if isinstance(value, torch.dtype):
        return value
    key = str(value).removeprefix("torch.")
    if key not in _DTYPES:
        raise ValueError(f"dtype {value!r} is not supported; allowed: {sorted(_DTYPES)}")
    return _DTYPES[key]


class WeightUpdater:
    def __init__(self, model: nn.Module, device: torch.device) -> None:
        self.model = model
        self.device = device
        self.weight_map = WeightMap(model)
        self.groups: dict[str, WeightUpdateGroup] = {}
        self._staging: PinnedStaging | None = None
        # (param, shard) pairs written since `reset_coverage()`: tells when a refill is complete.
        self.written: set[tuple[str, str | int | None]] = set()
        self.tp_size = 1  # the ranks an update reaches (`tide.scheduler.tp_worker` has more)
        # Set (to the reason) while the parameters' memory is released: every update is refused.
        self.write_block: str | None = None
        self._last_plan: tuple[object, list[WeightTarget]] | None = None  # an RL loop repeats one
        self._receive_streams: tuple[torch.cuda.Stream, torch.cuda.Stream] | None = None
        # weight parameter name -> its projection, for projections with an fp8 copy of the weight
        # (`tide.layers.fp8`; such a module has `requantize()`)
        self._fp8_modules: dict[str, nn.Module] = {
            f"{name}.weight": m for name, m in model.named_modules()
            if getattr(m, "weight_fp8", None) is not None}

    def reset_coverage(self) -> None:
        self.written = set()

    def coverage_complete(self) -> bool:
        return self.weight_map.required() <= self.written

    def _note(self, targets: Iterable[WeightTarget]) -> int:
        """Record what an update wrote, once all its writes have finished; projections with an fp8
        copy of a written weight are requantized from it first. Returns how many targets."""
        done = list(targets)
        names = sorted({t.param_name for t in done})
        modules = [self._fp8_modules[n] for n in names if n in self._fp8_modules]
        for module in modules:
            module.requantize()  # type: ignore[operator]
        if modules:
            self._sync()  # the next update's copies (on other streams) may overwrite the weights
        self.written.update((t.param_name, t.shard) for t in done)
        return len(done)

    # ---- validation
    def plan(
        self,
        metas: Iterable[tuple[str, Sequence[int], torch.dtype]],
        exact_dtype: bool,
        require_complete: bool = False,
        sharded: bool = False,
    ) -> list[WeightTarget]:
        if self.write_block is not None:
            raise ValueError(self.write_block)
        checked = [(name, tuple(shape), dtype) for name, shape, dtype in metas]
        if not checked:
            raise ValueError("the update names no weights")
        key = (tuple(checked), exact_dtype, require_complete, sharded)
        if self._last_plan is not None and self._last_plan[0] == key:
            return list(self._last_plan[1])  # the same request as last time: same (valid) plan
        seen: set[str] = set()
        for name, _, _ in checked:
            if name in seen:
                raise ValueError(f"weight {name!r} appears more than once in the update")
            seen.add(name)
        targets = self.weight_map.plan(checked, require_complete=require_complete, sharded=sharded)
        if exact_dtype:
            by_name = {name: dtype for name, _, dtype in checked}
            for t in targets:
                want = self.weight_map.params[t.param_name].dtype
                if by_name[t.name] != want:
                    raise ValueError(
                        f"weight {t.name!r} has dtype {by_name[t.name]}, the model's is {want}"
                    )
        self._last_plan = (key, targets)
        return list(targets)

    # ---- paths: each `prepare_*` validates everything and returns the function that writes
    def prepare_from_disk(self, model_path: str) -> Callable[[], int]:
        targets = {t.name: t for t in self.plan(read_checkpoint_shapes(model_path), False, True)}

        def write() -> int:
            if self.device.type == "cuda" and self._staging is None:
                self._staging = PinnedStaging(self.device)  # kept: pinning memory is slow
            write_checkpoint(self.weight_map, targets, model_path, staging=self._staging)
            self._sync()
            self._note(targets.values())
            return len(targets)

        return lambda: _writing(f"reading {model_path!r}", write)

    def prepare_named_tensors(self, named: object, sharded: bool = False) -> Callable[[], int]:
        """`named`: [(name, tensor), ...]; anything else is a ValueError. `sharded`: each tensor
        is this rank's part (its `local_shape`), written as is."""
        if not isinstance(named, (list, tuple)):
            raise ValueError("named_tensors must be a list of (name, tensor) pairs")
        pairs: list[tuple[str, torch.Tensor]] = []
        for item in named:
            if (
                not isinstance(item, (tuple, list))
                or len(item) != 2
                or not isinstance(item[0], str)
                or not isinstance(item[1], torch.Tensor)
            ):
                raise ValueError("named_tensors must be a list of (name, tensor) pairs")
            name, tensor = item[0], item[1]
            # What `apply` cannot copy from fails here, before anything is written.
            if tensor.layout != torch.strided or tensor.device.type == "meta" or tensor.is_quantized:
                raise ValueError(f"weight {name!r} cannot be copied from (layout {tensor.layout}, "
                                 f"device {tensor.device.type}); updates take dense tensors with data")
            pairs.append((name, tensor))
        targets = self.plan([(n, t.shape, t.dtype) for n, t in pairs], exact_dtype=True,
                            sharded=sharded)
        tensors = dict(pairs)

        def write() -> int:
            for target in targets:
                self.weight_map.write(target, tensors[target.name], sharded)
            self._sync()
            self._note(targets)
            return len(targets)

        return lambda: _writing("writing the tensors", write)

    def prepare_buckets(self, buckets: object) -> Callable[[], int]:
        """`buckets`: a `FlattenedBucket` or a list of them; anything else is a ValueError."""
        if isinstance(buckets, FlattenedBucket):
            buckets = [buckets]
        if not isinstance(buckets, (list, tuple)):
            raise ValueError("a flattened_bucket payload must be a FlattenedBucket or a list of them")
        named: list[tuple[str, torch.Tensor]] = []
        for bucket in buckets:
            if not isinstance(bucket, FlattenedBucket):
                raise ValueError("a flattened_bucket payload must hold FlattenedBucket objects")
            named.extend(bucket.named_tensors())
        return self.prepare_named_tensors(named)

    def prepare_serialized(self, payload: str | bytes, load_format: str | None) -> Callable[[], int]:
        obj = deserialize_named_tensors(payload)
        if load_format == "flattened_bucket":
            return self.prepare_buckets(obj)
        return self.prepare_named_tensors(obj, sharded=load_format == SHARDED)

    def prepare_serialized_per_rank(self, payloads: Sequence[str | bytes],
                                    load_format: str | None) -> Callable[[], int]:
        """One serialized payload per tensor-parallel rank (here: one rank)."""
        if len(payloads) != self.tp_size:
            raise ValueError(f"serialized_named_tensors must hold one payload per rank "
                             f"({self.tp_size}), got {len(payloads)}")
        return self.prepare_serialized(payloads[0], load_format)

    def prepare_from_ipc(self, payload: str | bytes | Sequence[str | bytes]) -> Callable[[], int]:
        """`payload`: serialized FlattenedBucket(s) whose buffers are CUDA IPC handles of the
        trainer's memory (or a list with one such payload per tensor-parallel rank). The mapped
        buffers are dropped once copied."""
        if isinstance(payload, (list, tuple)):
            if len(payload) != self.tp_size:
                raise ValueError(f"serialized_buckets must hold one payload per rank "
                                 f"({self.tp_size}), got {len(payload)}")
            payload = payload[0]
        if not isinstance(payload, (str, bytes)):
            raise ValueError("serialized_buckets must be a serialized payload (str or bytes)")
        holder = [deserialize_named_tensors(payload)]
        write = self.prepare_buckets(holder[0])

        def apply() -> int:
            try:
                return write()
            finally:
                holder.clear()

        return apply

    # ---- distributed
    def init_group(
        self, master_address: str, master_port: int, rank_offset: int, world_size: int,
        group_name: str, backend: str, timeout: float = DEFAULT_JOIN_TIMEOUT_S,
    ) -> None:
        """Join the trainer's group; ValueError for bad arguments, RuntimeError when the join
        fails or takes longer than `timeout` seconds (nothing of it is kept then)."""
        if group_name in self.groups:
            raise ValueError(f"group_name {group_name!r} already exists; destroy it first")
        if not 0 < timeout <= MAX_JOIN_TIMEOUT_S:
            raise ValueError(f"timeout must be in (0, {MAX_JOIN_TIMEOUT_S:g}] seconds, got {timeout}")
        group = init_custom_process_group(
            backend, master_address, master_port, rank_offset, world_size, group_name,
            join_timeout_s=timeout, device=self.device if backend == "nccl" else None,
        )
        if group.device.type == "cuda":
            self._warm_receive_pool(group)
        self.groups[group_name] = group

    def _streams(self, device: torch.device) -> tuple[torch.cuda.Stream, torch.cuda.Stream]:
        """The (receive, copy) streams of every distributed update (see `BroadcastReceiver`)."""
        if self._receive_streams is None:
            self._receive_streams = (torch.cuda.Stream(device), torch.cuda.Stream(device))
        return self._receive_streams

    def _params_one_run(self) -> bool:
        """Whether the parameters, in module order, are whole tensors of one dtype back to back in
        one storage: a flattened update in module order then lands in place (`BroadcastReceiver`)."""
        params = list(self.weight_map.params.values())
        return not any(getattr(p, "tp_split", None) for p in params) and back_to_back(params)

    def _warm_receive_pool(self, group: WeightUpdateGroup) -> None:
        """Take and free a flattened update's two piece buffers on the receive stream, so that the
        caching allocator holds them for it and the first update does not wait for cudaMalloc.
        Without the memory for them now, the first update allocates them itself. Parameters back
        to back in one storage, in module order, whole (`enable_memory_saver` without tensor
        parallelism, no alignment gaps) take no buffers for an update flattened in module order
        (its pieces land in place), so none are held for them."""
        if group.bucket_bytes == 0:
            return  # pieces are whole dtype buffers, of sizes known only at an update
        if self._params_one_run():
            return
        with torch.cuda.stream(self._streams(group.device)[0]):
            try:
                buffers = [torch.empty(group.bucket_bytes, dtype=torch.uint8, device=group.device)
                           for _ in range(2)]
            except torch.cuda.OutOfMemoryError:
                return
        del buffers

    def destroy_group(self, group_name: str) -> None:
        group = self.groups.pop(group_name, None)
        if group is None:
            raise ValueError(f"group_name {group_name!r} is not an open weight update group")
        group.close()

    def load_from_distributed(
        self,
        names: Sequence[str],
        dtypes: Sequence[str | torch.dtype],
        shapes: Sequence[Sequence[int]],
        group_name: str,
        load_format: str | None,
        peer_error: str | None = None,
    ) -> int:
        """Receive rank 0's update header, then its broadcasts: one per tensor, or with
        `load_format="flattened_bucket"` each dtype's tensors as one flat buffer (first-seen dtype
        order) in the group's pieces (`tide.weights.receive`). A request that fails validation
        (here, or on another tensor-parallel rank: `peer_error`) or disagrees with the header still
        receives everything the header announced (into scratch memory) so the trainer never hangs,
        writes nothing, then raises ValueError; a valid one is validated completely before the
        first broadcast is received. No header (RuntimeError): the group is closed. A receive that
        fails part-way raises `PartialWriteError`. Under tensor parallelism a tensor this
        rank holds only part of arrives whole and its part is copied out as soon as it has arrived
        (`PartDest`)."""
        group = self.groups.get(group_name)
        if group is None:
            raise ValueError(f"group_name {group_name!r} is not an open weight update group")
        receiver = BroadcastReceiver(
            group, self._streams(group.device) if group.device.type == "cuda" else None)
        try:
            header = receiver.receive_header()
        except RuntimeError as e:
            receiver.finish()
            self.destroy_group(group_name)  # out of step with rank 0: nothing later would match
            raise RuntimeError(f"{e}; group {group_name!r} is closed, join a new one") from None
        error: ValueError | None = None
        targets: dict[str, WeightTarget] = {}
        metas: list[tuple[str, tuple[int, ...], torch.dtype]] = []
        try:
            metas = self._distributed_metas(names, dtypes, shapes, load_format, header)
            targets = {t.name: t for t in self.plan(metas, exact_dtype=True)}
        except ValueError as e:
            error = e
        if error is None and peer_error is not None:
            error = ValueError(peer_error)

        def dest(name: str) -> Dest:
            target = targets.get(name)
            if target is None:
                return None
            rows = self.weight_map.rows(target)
            if target.split is None:
                return rows
            return PartDest(rows, target.shape, *target.split)

        try:
            if error is not None:
                receiver.drain(header)
            else:
                _writing(f"receiving from group {group_name!r}",
                         lambda: self._receive_into(receiver, metas, load_format, dest))
        finally:
            receiver.finish()
        if error is not None:
            raise error
        if group.device.type != "cuda":
            self._sync()  # a gloo group's copies into CUDA parameters
        return _writing("requantizing the fp8 copies", lambda: self._note(targets.values()))

    @staticmethod
    def _receive_into(receiver: BroadcastReceiver,
                      metas: list[tuple[str, tuple[int, ...], torch.dtype]],
                      load_format: str | None, dest: Callable[[str], Dest]) -> int:
        """A valid update's broadcasts, each into its destination (`load_from_distributed`)."""
        if load_format == "flattened_bucket":
            order: dict[torch.dtype, list[tuple[Dest, int]]] = {}
            for name, shape, dtype in metas:
                order.setdefault(dtype, []).append((dest(name), math.prod(shape)))
            for dtype, items in order.items():
                receiver.receive_flattened(dtype, items)
        else:
            receiver.receive_tensors([(shape, dtype, dest(name)) for name, shape, dtype in metas])
        return len(metas)

    @staticmethod
    def _distributed_metas(names: Sequence[str], dtypes: Sequence[str | torch.dtype],
                           shapes: Sequence[Sequence[int]], load_format: str | None,
                           header: UpdateHeader) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
        """The request's (name, shape, dtype) triples, once they parse and agree with what rank 0
        announced (ValueError naming the difference)."""
        if not (len(names) == len(dtypes) == len(shapes)) or not names:
            raise ValueError("names, dtypes and shapes must be non-empty lists of equal length")
        if load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {load_format!r}")
        try:
            metas = [(n, tuple(int(d) for d in s), parse_dtype(d))
                     for n, s, d in zip(names, shapes, dtypes)]
        except TypeError as e:
            raise ValueError(f"shapes must be lists of ints: {e}") from None
        if load_format == "flattened_bucket":
            totals: dict[torch.dtype, int] = {}
            for _, shape, dtype in metas:
                totals[dtype] = totals.get(dtype, 0) + math.prod(shape)
            declared = UpdateHeader(True, tuple((n, d) for d, n in totals.items()))
        else:
            declared = UpdateHeader(False, tuple((math.prod(s), d) for _, s, d in metas))
        if declared != header:
            raise ValueError(f"rank 0 broadcasts {header.describe()}, but the request declares "
                             f"{declared.describe()}; nothing was written")
        return metas

    def check_distributed(self, names: Sequence[str], dtypes: Sequence[str | torch.dtype],
                          shapes: Sequence[Sequence[int]], group_name: str) -> None:
        """What `load_from_distributed` validates, without receiving (ValueError naming the
        problem): the ranks of a tensor-parallel engine all check before any receives."""
        if group_name not in self.groups:
            raise ValueError(f"group_name {group_name!r} is not an open weight update group")
        if not (len(names) == len(dtypes) == len(shapes)) or not names:
            raise ValueError("names, dtypes and shapes must be non-empty lists of equal length")
        self.plan([(n, tuple(s), parse_dtype(d)) for n, s, d in zip(names, shapes, dtypes)],
                  exact_dtype=True)

    # ---- inspection
    def weight_part(self, name: str) -> tuple[tuple[int, ...], tuple[int, int, int] | None,
                                              torch.Tensor]:
        """(full checkpoint shape, this rank's split or None, this rank's part on the host) of
        checkpoint tensor `name`."""
        self._check_readable()
        target = self.weight_map.resolve(name)
        if target is None:
            raise ValueError(f"weight {name!r} is not stored by this model")
        return target.shape, target.split, self.weight_map.rows(target).float().cpu()

    def get_weights_by_name(self, name: str, truncate_size: int = 100) -> list[float]:
        self._check_readable()
        target = self.weight_map.resolve(name)
        if target is None:
            raise ValueError(f"weight {name!r} is not stored by this model")
        rows = self.weight_map.rows(target)
        return rows.reshape(-1)[: max(0, truncate_size)].float().cpu().tolist()

    def _check_readable(self) -> None:
        """ValueError while the parameters' memory is released (their storage is empty)."""
        if self.write_block is not None:
            raise ValueError("the weights are released; resume_memory_occupation(['weights']) "
                             "before reading them")

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()


__all__ = [
    "FlattenedBucket",
    "LOAD_FORMATS",
    "PartialWriteError",
    "SHARDED",
    "TENSOR_LOAD_FORMATS",
    "NamedTensors",
    "TensorPayload",
    "WeightUpdater",
    "flatten_by_dtype",
    "parse_dtype",
]
