"""Component residency: where each model component of a pipeline lives, and when it moves.

Strategies, per component (`DiffusionConfig.component_residency`):

- `resident`: on the compute device all the time, as loaded.
- `offload`: the weights live in pinned host memory, which stays their source of truth: moving the
  component off the device drops the device copy and copies nothing back. Before a stage that runs it,
  the weights are copied to the device as one flat buffer; after the stage they are dropped, unless the
  next stage runs the component too, or it is `preferred` (it then stays, across requests, until a
  placement needs its room under the budget).
- `layerwise`: the component's blocks (transformer layers; `BLOCK_PATHS`) live in pinned host memory
  and stream through the device during its stage: when block i starts, blocks i+1 .. i+N-1 are copied on
  a side stream while it computes, and block i is dropped when it returns, so at most
  `layerwise_blocks` (N) blocks are on the device at once. The rest of the component (embeddings, norms,
  projections) is placed like `offload` around its stage. With a `residency_budget_gb`, the first
  blocks that fit the room left beside the streaming window stay on the device for the rest of the
  stage (block cache): the later passes of the stage (denoising steps) copy only the others.

Prefetch: when a stage starts, the next memory-intensive component that a later stage runs (only that
one, and only if it is not already on the device) is copied on the side stream while the current stage
computes, if the budget has room for it; otherwise as soon as the current stage's releases make room.
Components that are not memory-intensive are copied when their stage starts.

Release points: this manager empties the allocator cache (`tide.memory.empty_device_cache`, recorded in
the engine's `MemoryLedger`) only right after a memory-intensive component released its device storage:
reason `component_offload` (an offloaded or evicted component) or `layerwise_pass` (a layerwise component
finished its stage). The engine adds `oom` after an out-of-memory error and `release_memory` for
`release_memory_occupation`, through `release_point`. Stage boundaries without such a release never
empty it.

Invariants: a module's parameter and buffer objects never change (their `.data` points at host views
while released and at views of a device buffer while placed), so stages and weight updates keep plain
references; a stage only runs once every component it names is on the compute device; the host copy of
an offloaded or layerwise component always holds the current weights.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from tide.diffusion.config import AUTO_RESIDENCY
from tide.diffusion.stages import Stage, StageHook
from tide.memory import MemoryLedger, empty_device_cache

logger = logging.getLogger(__name__)

RESIDENT = "resident"
OFFLOAD = "offload"
LAYERWISE = "layerwise"
STRATEGIES = (RESIDENT, OFFLOAD, LAYERWISE)
AUTO = AUTO_RESIDENCY

# Release-point reasons this manager records (the engine adds "oom" and "release_memory").
REASON_OFFLOAD = "component_offload"
REASON_LAYERWISE = "layerwise_pass"

GiB = 1 << 30
MEMORY_INTENSIVE_MIN_BYTES = GiB  # a text encoder this large is memory-intensive by default
AUTO_BUDGET_FRACTION = 0.8  # auto with no budget on CUDA: this share of the device's memory
_ALIGN = 256  # byte alignment of every tensor inside a flat buffer

# The blocks a layerwise component streams, by class: attribute paths in execution order (a path the
# module lacks is skipped: transformers releases differ); a path to a ModuleList contributes each of
# its entries, any other module is one block. Other classes: every top-level ModuleList's entries.
BLOCK_PATHS: dict[str, tuple[str, ...]] = {
    "FluxTransformer2DModel": ("transformer_blocks", "single_transformer_blocks"),
    "UNet2DConditionModel": ("down_blocks", "mid_block", "up_blocks"),
    "T5EncoderModel": ("encoder.block",),
    "CLIPTextModel": ("text_model.encoder.layers", "encoder.layers"),
    "CLIPTextModelWithProjection": ("text_model.encoder.layers", "encoder.layers"),
    "AutoencoderKL": ("decoder.mid_block", "decoder.up_blocks"),
}


# ---------------------------------------------------------------------------------------------------
# Policies and planning


@dataclass(frozen=True)
class ComponentPolicy:
    """How one model component is placed: its strategy, whether releasing it is a release point
    (`memory_intensive`), and whether an offloaded component stays on the device after use
    (`preferred`)."""

    name: str
    strategy: str
    memory_intensive: bool = False
    preferred: bool = False

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ValueError(f"component {self.name!r}: unknown residency strategy {self.strategy!r}; "
                             f"choose from {list(STRATEGIES)}")


@dataclass(frozen=True)
class ComponentSize:
    """Weight bytes of a component: all of it, its layerwise blocks, and the rest."""

    total: int
    blocks: tuple[int, ...] = ()

    @property
    def rest(self) -> int:
        return self.total - sum(self.blocks)

    def footprint(self, strategy: str, layerwise_blocks: int) -> int:
        """Device bytes while its stage runs."""
        if strategy == LAYERWISE and self.blocks:
            return self.rest + sum(sorted(self.blocks)[-layerwise_blocks:])
        return self.total


def module_size(module: nn.Module) -> ComponentSize:
    """Weight bytes of `module` (works on meta-device modules: nothing is read)."""
    blocks = find_blocks(module)
    total = sum(_nbytes(t) for t in _tensors(module))
    return ComponentSize(total, tuple(sum(_nbytes(t) for t in _tensors(b)) for b in blocks))


def static_peak(strategies: dict[str, str], sizes: dict[str, ComponentSize],
                stage_components: Sequence[Sequence[str]], layerwise_blocks: int) -> int:
    """Device bytes of weights at the busiest stage: every resident component, plus the footprint of
    the non-resident components of that stage (prefetches wait for room, so they add nothing)."""
    resident = sum(sizes[c].total for c, s in strategies.items() if s == RESIDENT)
    stage_peak = max((sum(sizes[c].footprint(strategies[c], layerwise_blocks)
                          for c in set(comps) if c in strategies and strategies[c] != RESIDENT)
                      for comps in stage_components), default=0)
    return resident + stage_peak


def plan_strategies(requested: dict[str, str], sizes: dict[str, ComponentSize],
                    stage_components: Sequence[Sequence[str]], denoiser: str,
                    memory_intensive: set[str], budget: int | None,
                    layerwise_blocks: int) -> dict[str, str]:
    """Strategies for every component in `sizes`: the requested ones as given, `auto` ones chosen so
    the static peak fits `budget`. Moves are tried in order — memory-intensive encoders, then the
    other components (largest first) to offload; the denoiser to offload, then to layerwise; the
    memory-intensive encoders to layerwise — until the peak fits; then each moved component goes
    back to the least aggressive strategy that still fits (latest move first). ValueError when even
    every move does not fit."""
    chosen = {name: (RESIDENT if s == AUTO else s) for name, s in requested.items()}
    auto = [n for n, s in requested.items() if s == AUTO]
    if budget is None or not auto:
        return chosen

    def fits() -> bool:
        return static_peak(chosen, sizes, stage_components, layerwise_blocks) <= budget

    by_size = sorted((n for n in auto if n != denoiser), key=lambda n: -sizes[n].total)
    steps = [(n, OFFLOAD) for n in by_size if n in memory_intensive]
    steps += [(n, OFFLOAD) for n in by_size if n not in memory_intensive]
    if denoiser in auto:
        steps += [(denoiser, OFFLOAD), (denoiser, LAYERWISE)]
    steps += [(n, LAYERWISE) for n in by_size if n in memory_intensive and sizes[n].blocks]
    moved: list[str] = []
    for name, strategy in steps:
        if fits():
            break
        chosen[name] = strategy
        moved.append(name)
    if not fits():
        need = static_peak(chosen, sizes, stage_components, layerwise_blocks)
        raise ValueError(f"residency_budget_gb={budget / 1e9:g}: the pipeline's weights need at least "
                         f"{need / 1e9:.3g} GB on the device even with {chosen}; raise the budget or "
                         "lower layerwise_blocks")
    for name in dict.fromkeys(reversed(moved)):
        current = chosen[name]
        for lighter in STRATEGIES[:STRATEGIES.index(current)]:
            chosen[name] = lighter
            if fits():
                break
        else:
            chosen[name] = current
    return chosen


# ---------------------------------------------------------------------------------------------------
# Moving weights


def _tensors(module: nn.Module) -> list[torch.Tensor]:
    """Parameters and buffers of `module`, each once."""
    seen: set[int] = set()
    out: list[torch.Tensor] = []
    for t in [*module.parameters(), *module.buffers()]:
        if id(t) not in seen:
            seen.add(id(t))
            out.append(t)
    return out


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _aligned(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def find_blocks(module: nn.Module) -> list[nn.Module]:
    """The blocks a layerwise `module` streams, in execution order (see `BLOCK_PATHS`)."""
    paths = BLOCK_PATHS.get(type(module).__name__)
    if paths is None:
        paths = tuple(name for name, child in module.named_children()
                      if isinstance(child, nn.ModuleList))
    blocks: list[nn.Module] = []
    for path in paths:
        target: Any = module
        for part in path.split("."):
            target = getattr(target, part, None)
        if isinstance(target, nn.ModuleList):
            blocks.extend(target)
        elif isinstance(target, nn.Module):
            blocks.append(target)
    return [b for b in blocks if _tensors(b)]


class HostCopy:
    """One flat host buffer holding a copy of some tensors; `views[i]` has the shape and dtype of
    tensor i. Pinned for fast asynchronous copies when `pin` (page-locked in place with
    cudaHostRegister: no rounding of the size), pageable otherwise or where registering fails."""

    def __init__(self, tensors: Sequence[torch.Tensor], pin: bool) -> None:
        self.offsets: list[int] = []
        total = 0
        for t in tensors:
            self.offsets.append(total)
            total += _aligned(_nbytes(t))
        self.nbytes = total
        self.flat = torch.empty(total, dtype=torch.uint8)
        self.pinned = pin and total > 0 and _register(self.flat)
        self.views = [self.flat[o:o + _nbytes(t)].view(t.dtype).view(t.shape)
                      for o, t in zip(self.offsets, tensors)]
        for view, t in zip(self.views, tensors):
            view.copy_(t.detach())

    def close(self) -> None:
        if self.pinned:
            _unregister(self.flat)
            self.pinned = False

    def __del__(self) -> None:
        self.close()


def _register(flat: torch.Tensor) -> bool:
    try:
        err = torch.cuda.cudart().cudaHostRegister(flat.data_ptr(), flat.numel(), 0)
        err = int(getattr(err, "value", err))
    except (RuntimeError, AttributeError, TypeError) as e:
        logger.warning("cannot pin %d bytes of host memory (%s); copies will be synchronous",
                       flat.numel(), e)
        return False
    if err != 0:
        logger.warning("cudaHostRegister of %d bytes failed (error %s); copies will be synchronous",
                       flat.numel(), err)
        return False
    return True


def _unregister(flat: torch.Tensor) -> None:
    try:
        torch.cuda.cudart().cudaHostUnregister(flat.data_ptr())
    except (RuntimeError, AttributeError):  # interpreter shutdown: nothing left to do
        pass


class WeightGroup:
    """Tensors that move together (a whole component, a block, or the rest of a layerwise
    component). While released, each tensor's `.data` is its view of the host copy; while placed, a
    view of one flat device buffer filled by one copy. The tensor objects themselves never change.

    Made from the tensors' current values (device or host), it starts released: the host copy is
    taken and the old storage dropped."""

    def __init__(self, name: str, tensors: Sequence[torch.Tensor], device: torch.device) -> None:
        self.name = name
        self.tensors = list(tensors)
        self.device = device
        self.host = HostCopy(self.tensors, pin=device.type == "cuda")
        self.nbytes = self.host.nbytes
        self._flat: torch.Tensor | None = None
        self._ready: Any = None  # CUDA event the copy recorded, until a compute stream waited on it
        self._point_at_host()

    @property
    def placed(self) -> bool:
        return self._flat is not None

    def _point_at_host(self) -> None:
        with torch.inference_mode(False):
            for t, view in zip(self.tensors, self.host.views):
                t.data = view

    def place(self, copy_stream: Any = None) -> None:
        """Copy to the device (on `copy_stream` when given: asynchronously, `wait` before use)."""
        if self.placed:
            return
        with torch.inference_mode(False):
            if copy_stream is not None:
                with torch.cuda.stream(copy_stream):
                    flat = torch.empty(self.nbytes, dtype=torch.uint8, device=self.device)
                    flat.copy_(self.host.flat, non_blocking=self.host.pinned)
                    self._ready = torch.cuda.Event()
                    self._ready.record(copy_stream)
            else:
                flat = torch.empty(self.nbytes, dtype=torch.uint8, device=self.device)
                flat.copy_(self.host.flat)
            for t, o in zip(self.tensors, self.host.offsets):
                t.data = flat[o:o + _nbytes(t)].view(t.dtype).view(t.shape)
        self._flat = flat

    def wait(self, stream: Any) -> None:
        """Make `stream` wait for this group's copy (no host synchronisation)."""
        if self._ready is not None:
            stream.wait_event(self._ready)
            self._ready = None

    def release(self, compute_stream: Any = None, refresh_host: bool = False) -> None:
        """Point the tensors back at the host copy and drop the device storage; with `refresh_host`,
        copy the device values into the host copy first (weights written on the device only)."""
        if not self.placed:
            return
        if refresh_host and self._flat is not None:
            with torch.inference_mode(False):
                self.host.flat.copy_(self._flat)
        self._point_at_host()
        if self._flat is not None and compute_stream is not None:
            # Allocated on the copy stream, read by the compute stream: the allocator must not hand
            # the block out again before the compute work queued so far is done.
            self._flat.record_stream(compute_stream)
        self._flat = None
        self._ready = None

    def host_targets(self) -> list[torch.Tensor]:
        return self.host.views

    def close(self) -> None:
        self.host.close()


@dataclass
class ManagedComponent:
    """A model component under the manager: its policy, weight groups and counters."""

    policy: ComponentPolicy
    module: nn.Module
    size: ComponentSize
    whole: WeightGroup | None = None  # offload: everything; layerwise: the rest
    blocks: list[WeightGroup] = field(default_factory=list)
    backup: WeightGroup | None = None  # resident: the host copy release_memory_occupation made
    hooks: list[Any] = field(default_factory=list)
    placements: int = 0
    h2d_bytes: int = 0
    max_blocks_on_device: int = 0
    cached: set[int] = field(default_factory=set)  # layerwise blocks kept for the rest of the stage

    @property
    def name(self) -> str:
        return self.policy.name

    @property
    def strategy(self) -> str:
        return self.policy.strategy

    def groups(self) -> Iterator[WeightGroup]:
        if self.whole is not None:
            yield self.whole
        yield from self.blocks

    def blocks_on_device(self) -> int:
        return sum(1 for b in self.blocks if b.placed)

    def device_bytes(self) -> int:
        if self.strategy == RESIDENT:
            if self.backup is not None and not self.backup.placed:
                return 0
            return self.size.total
        return sum(g.nbytes for g in self.groups() if g.placed)

    @property
    def on_device(self) -> bool:
        """Everything a stage needs is placed (resident, or the whole/rest group placed)."""
        if self.strategy == RESIDENT:
            return self.backup is None or self.backup.placed
        return self.whole is not None and self.whole.placed


class ComponentManager(StageHook):
    """Owns the placement of every model component of one pipeline (see the module doc).

    `adopt(name, module)` takes a component as loaded (on the device or the host) and builds its host
    copies; `bind(stages)` gives it the stage order. As a `StageHook` it places before each stage,
    releases after, prefetches, and records release points in `ledger`. `device_module`: the backend
    whose allocator cache the release points empty (default: CUDA when the device is CUDA, nothing
    otherwise; tests pass a fake to observe them on a CPU).
    """

    def __init__(self, device: torch.device, policies: dict[str, ComponentPolicy],
                 layerwise_blocks: int, budget_bytes: int | None, ledger: MemoryLedger,
                 device_module: Any = None) -> None:
        if layerwise_blocks < 1:
            raise ValueError(f"layerwise_blocks must be >= 1, got {layerwise_blocks}")
        self.device = device
        self.policies = dict(policies)
        self.layerwise_blocks = layerwise_blocks
        self.budget_bytes = budget_bytes
        self.ledger = ledger
        self.device_module = device_module
        self.components: dict[str, ManagedComponent] = {}
        self.copy_stream: Any = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._stage_index: dict[str, int] = {}
        self._stage_comps: list[list[ManagedComponent]] = []
        self._deferred: ManagedComponent | None = None  # a prefetch waiting for room
        self.peak_device_bytes = 0
        self.weights_released = False

    # ---- setup
    def adopt(self, name: str, module: nn.Module) -> None:
        """Take a loaded model component under management (call in load order, before `bind`)."""
        policy = self.policies.get(name) or ComponentPolicy(name, RESIDENT)
        self.policies[name] = policy
        comp = ManagedComponent(policy, module, module_size(module))
        if policy.strategy == OFFLOAD:
            comp.whole = WeightGroup(name, _tensors(module), self.device)
        elif policy.strategy == LAYERWISE:
            blocks = find_blocks(module)
            if not blocks:
                raise ValueError(f"component_residency: component {name!r} "
                                 f"({type(module).__name__}) has no blocks to stream layerwise; "
                                 "use offload")
            in_blocks = {id(t) for b in blocks for t in _tensors(b)}
            rest = [t for t in _tensors(module) if id(t) not in in_blocks]
            comp.whole = WeightGroup(f"{name}.rest", rest, self.device)
            claimed: set[int] = set()
            for i, block in enumerate(blocks):
                own = [t for t in _tensors(block) if id(t) not in claimed]
                claimed.update(id(t) for t in own)
                comp.blocks.append(WeightGroup(f"{name}.block{i}", own, self.device))
            for i, block in enumerate(blocks):
                comp.hooks.append(block.register_forward_pre_hook(self._block_pre_hook(comp, i)))
                comp.hooks.append(block.register_forward_hook(self._block_post_hook(comp, i)))
        self.components[name] = comp
        self._note_device_bytes()

    def bind(self, stages: Sequence[Stage]) -> None:
        """The stage order of the pipeline this manager serves."""
        self._stage_index = {s.name: i for i, s in enumerate(stages)}
        self._stage_comps = [[self.components[c] for c in dict.fromkeys(s.components)
                              if c in self.components] for s in stages]

    # ---- state
    def device_bytes(self) -> int:
        """Bytes of component weights on the device now (prefetches in flight included)."""
        return sum(c.device_bytes() for c in self.components.values())

    def _note_device_bytes(self) -> None:
        self.peak_device_bytes = max(self.peak_device_bytes, self.device_bytes())

    def reset_peak(self) -> None:
        self.peak_device_bytes = self.device_bytes()

    def host_bytes(self) -> int:
        """Bytes of host copies (pinned on CUDA)."""
        return sum(g.nbytes for c in self.components.values()
                   for g in [*c.groups(), *([c.backup] if c.backup else [])])

    def stats(self) -> dict[str, Any]:
        """Placement and counters, per component and in total (for /metrics and tests)."""
        return {
            "device_bytes": self.device_bytes(),
            "peak_device_bytes": self.peak_device_bytes,
            "host_bytes": self.host_bytes(),
            "budget_bytes": self.budget_bytes,
            "components": {
                name: {"strategy": c.strategy, "memory_intensive": c.policy.memory_intensive,
                       "preferred": c.policy.preferred, "bytes": c.size.total,
                       "on_device": c.on_device, "device_bytes": c.device_bytes(),
                       "blocks": len(c.blocks), "blocks_on_device": c.blocks_on_device(),
                       "cached_blocks": len(c.cached),
                       "max_blocks_on_device": c.max_blocks_on_device,
                       "placements": c.placements, "h2d_bytes": c.h2d_bytes}
                for name, c in self.components.items()},
        }

    def _compute_stream(self) -> Any:
        return torch.cuda.current_stream(self.device) if self.copy_stream is not None else None

    # ---- moving
    def _place(self, comp: ManagedComponent, group: WeightGroup, prefetch: bool) -> None:
        if group.placed:
            return
        # A synchronous placement still copies on the side stream (the compute stream then waits on
        # the copy's event): the host never blocks.
        group.place(self.copy_stream)
        comp.placements += 1
        comp.h2d_bytes += group.nbytes
        self._note_device_bytes()
        if not prefetch:
            group.wait(self._compute_stream())

    def _release_component(self, comp: ManagedComponent) -> None:
        stream = self._compute_stream()
        for g in comp.groups():
            g.release(stream)
        comp.cached = set()
        if self._deferred is comp:
            self._deferred = None

    def _make_room(self, need: int, keep: set[str]) -> bool:
        """Evict idle preferred components until `need` more bytes fit the budget; whether a
        memory-intensive one left (the caller then has a release point to take)."""
        released_mi = False
        if self.budget_bytes is None:
            return False
        for comp in self.components.values():
            if self.device_bytes() + need <= self.budget_bytes:
                break
            if comp.policy.preferred and comp.strategy == OFFLOAD and comp.name not in keep \
                    and comp.on_device:
                self._release_component(comp)
                released_mi |= comp.policy.memory_intensive
        return released_mi

    def _fits(self, need: int) -> bool:
        return self.budget_bytes is None or self.device_bytes() + need <= self.budget_bytes

    def _prefetch_bytes(self, comp: ManagedComponent) -> int:
        groups = [comp.whole] if comp.whole is not None else []
        groups += comp.blocks[:self.layerwise_blocks]
        return sum(g.nbytes for g in groups if not g.placed)

    def _prefetch(self, comp: ManagedComponent) -> None:
        if comp.whole is not None:
            self._place(comp, comp.whole, prefetch=True)
        for g in comp.blocks[:self.layerwise_blocks]:
            self._place(comp, g, prefetch=True)
        self._track_blocks(comp)

    def _next_memory_intensive(self, index: int) -> ManagedComponent | None:
        """The memory-intensive, non-resident component of the first later stage that runs one the
        current stage does not run, if it is not on the device already."""
        current = {c.name for c in self._stage_comps[index]}
        for comps in self._stage_comps[index + 1:]:
            for comp in comps:
                if comp.policy.memory_intensive and comp.strategy != RESIDENT \
                        and comp.name not in current:
                    return None if comp.on_device else comp
        return None

    def _try_prefetch(self, comp: ManagedComponent, keep: set[str]) -> str | None:
        """Prefetch `comp` if its bytes fit (evicting idle preferred components if needed);
        otherwise leave it deferred. Returns the release reason an eviction calls for."""
        need = self._prefetch_bytes(comp)
        reason = REASON_OFFLOAD if self._make_room(need, keep | {comp.name}) else None
        if self._fits(need):
            self._prefetch(comp)
            self._deferred = None
        else:
            self._deferred = comp
        return reason

    # ---- StageHook
    def before_stage(self, stage: Stage, batch: Any) -> None:
        index = self._stage_index.get(stage.name)
        if index is None:
            return
        if self.weights_released:
            raise RuntimeError("the pipeline's weights are released (release_memory_occupation); "
                               "call resume_memory_occupation first")
        needed = self._stage_comps[index]
        keep = {c.name for c in needed}
        reason = None
        for comp in needed:
            if comp.strategy == RESIDENT:
                continue
            if self._make_room(self._prefetch_bytes(comp), keep):
                reason = REASON_OFFLOAD
            assert comp.whole is not None
            self._place(comp, comp.whole, prefetch=False)
            comp.whole.wait(self._compute_stream())
            if comp.strategy == LAYERWISE:
                self._choose_cached_blocks(comp)
            for g in comp.blocks[:self.layerwise_blocks]:
                self._place(comp, g, prefetch=True)  # the block hooks wait before each block runs
            self._track_blocks(comp)
        if reason is not None:
            self.release_point(reason)
        upcoming = self._next_memory_intensive(index)
        if upcoming is not None:
            reason = self._try_prefetch(upcoming, keep)
            if reason is not None:
                self.release_point(reason)

    def after_stage(self, stage: Stage, batch: Any) -> None:
        index = self._stage_index.get(stage.name)
        if index is None:
            return
        following = {c.name for c in self._stage_comps[index + 1]} \
            if index + 1 < len(self._stage_comps) else set()
        reason = None
        for comp in self._stage_comps[index]:
            if comp.strategy == RESIDENT or comp.name in following:
                continue
            if comp.strategy == OFFLOAD and comp.policy.preferred:
                continue
            self._release_component(comp)
            if comp.policy.memory_intensive:
                reason = reason or (REASON_OFFLOAD if comp.strategy == OFFLOAD else REASON_LAYERWISE)
        if reason is not None:
            self.release_point(reason)
        if self._deferred is not None:
            keep = following
            reason = self._try_prefetch(self._deferred, keep)
            if reason is not None:
                self.release_point(reason)

    def after_batch(self, batch: Any, failed: bool) -> None:
        """After a failed batch, every non-resident component leaves the device (preferred ones
        too: an out-of-memory error should find the most room). No release point here: the engine
        takes its own (`oom`)."""
        self._deferred = None
        if failed:
            for comp in self.components.values():
                if comp.strategy != RESIDENT:
                    self._release_component(comp)

    # ---- layerwise block streaming
    def _track_blocks(self, comp: ManagedComponent) -> None:
        comp.max_blocks_on_device = max(comp.max_blocks_on_device, comp.blocks_on_device())

    def _choose_cached_blocks(self, comp: ManagedComponent) -> None:
        """With a budget, the first blocks (in order) whose bytes fit the room left beside the
        streaming window stay on the device for the rest of the stage: later passes (denoising
        steps) copy only the others. Without a budget none do (pure streaming, <= N blocks)."""
        comp.cached = set()
        if self.budget_bytes is None:
            return
        window = sum(sorted(g.nbytes for g in comp.blocks)[-self.layerwise_blocks:])
        placed_blocks = sum(g.nbytes for g in comp.blocks if g.placed)  # inside the window
        room = self.budget_bytes - (self.device_bytes() - placed_blocks) - window
        for i, g in enumerate(comp.blocks):
            if g.nbytes > room:
                break
            comp.cached.add(i)
            room -= g.nbytes

    def _block_pre_hook(self, comp: ManagedComponent, index: int) -> Any:
        def hook(_module: nn.Module, _args: Any) -> None:
            n = len(comp.blocks)
            # The streaming window: this block and the next N-1 that still need a copy (cached
            # blocks already on the device need none and do not count).
            window = [index]
            for j in range(1, n):
                if len(window) == self.layerwise_blocks:
                    break
                i = (index + j) % n
                if not (i in comp.cached and comp.blocks[i].placed):
                    window.append(i)
            stream = self._compute_stream()
            for i, g in enumerate(comp.blocks):
                if g.placed and i not in window and i not in comp.cached:
                    g.release(stream)  # prefetched for an order that did not come
            block = comp.blocks[index]
            self._place(comp, block, prefetch=False)
            block.wait(stream)
            for i in window[1:]:
                self._place(comp, comp.blocks[i], prefetch=True)
            self._track_blocks(comp)

        return hook

    def _block_post_hook(self, comp: ManagedComponent, index: int) -> Any:
        def hook(_module: nn.Module, _args: Any, _output: Any) -> None:
            if index not in comp.cached:
                comp.blocks[index].release(self._compute_stream())

        return hook

    # ---- release points
    def release_point(self, reason: str) -> bool:
        """Empty the allocator cache, recorded in the ledger with `reason`. On a non-CUDA device with
        no `device_module` there is no cache to empty (returns False)."""
        if self.device_module is None and self.device.type != "cuda":
            return False
        return empty_device_cache(self.device_module, reason=reason, ledger=self.ledger)

    # ---- memory occupation (colocated trainer) and weight writes
    def synchronize(self) -> None:
        """Wait for copies in flight (before host copies are written)."""
        if self.copy_stream is not None:
            self.copy_stream.synchronize()

    def release_weights(self) -> int:
        """Drop every component's device copy of its weights (resident ones into a pinned host copy
        kept for the next release); returns the bytes released."""
        self.synchronize()
        released = 0
        stream = self._compute_stream()
        for comp in self.components.values():
            released += comp.device_bytes()
            if comp.strategy == RESIDENT:
                if comp.backup is None:
                    comp.backup = WeightGroup(comp.name, _tensors(comp.module), self.device)
                else:
                    comp.backup.release(stream, refresh_host=True)
            else:
                self._release_component(comp)
        self.weights_released = True
        return released

    def resume_weights(self) -> int:
        """Put resident components back on the device from their host copies; returns the bytes."""
        restored = 0
        for comp in self.components.values():
            if comp.backup is not None and not comp.backup.placed:
                comp.backup.place(None)
                restored += comp.backup.nbytes
        self.weights_released = False
        self._note_device_bytes()
        return restored

    def write_targets(self, name: str) -> dict[str, list[torch.Tensor]]:
        """For each parameter of component `name`: every tensor a weight update must write (the live
        one, and the host copy where that is the source of truth)."""
        comp = self.components[name]
        host_views: dict[int, torch.Tensor] = {}
        for g in comp.groups():
            for t, view in zip(g.tensors, g.host_targets()):
                host_views[id(t)] = view
        out: dict[str, list[torch.Tensor]] = {}
        for pname, p in comp.module.named_parameters():
            targets = [p.data]
            host = host_views.get(id(p))
            if host is not None and host.data_ptr() != p.data.data_ptr():
                targets.append(host)
            out[pname] = targets
        return out

    def close(self) -> None:
        """Remove the block hooks and unpin the host copies (the engine is shutting down)."""
        self.synchronize()
        for comp in self.components.values():
            for h in comp.hooks:
                h.remove()
            comp.hooks.clear()
            for g in [*comp.groups(), *([comp.backup] if comp.backup else [])]:
                g.close()
