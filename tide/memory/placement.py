"""Parameters made in storage chosen before the model exists (the memory saver's weights region).

A model is built twice. First on the meta device, which allocates nothing: `plan_layout` learns
every parameter's shape and dtype, its place in module order (checkpoint parameters first, then
derived ones such as the fp8 copies, which `ModelRunner`'s region and the CPU backup expect), and
the order in which construction registers them. Then for real, inside `placed(layout, homes)`: a
parameter-registration hook copies each parameter, as its module registers it, into the tensor
planned for it and registers a parameter over that tensor instead. The first home of a parameter is
dropped at once, so the weights are never resident twice (the old copy-after-load path peaked at
two copies of every weight). Those first homes go back to the caching allocator one by one while
construction goes on, so buffers made meanwhile (rotary tables) may land in their cached blocks;
`buffers_on_host` holds the buffers on the host while the cache is emptied, so no such block stays
reserved.

Invariants: the real build registers the same parameters in the same order as the meta build (it
runs the same code); a parameter registered again (a tied weight) keeps the storage it already
has; parameters that construction replaced before it finished get no home; `finish` places any
parameter the hook did not see, and refuses a parameter that sits in another one's home, so every
parameter ends in its own home whatever the build did.

The rule for model code: set a parameter's markers (`derived`, `dummy_value`, ...) before
assigning it to the module, or through the module attribute after; tie weights by assigning the
module attribute (`a.weight = b.weight`). The object registered is replaced, so a marker set on
the local variable afterwards is lost, and re-registering that variable is refused.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn
from torch.nn.modules.module import register_module_parameter_registration_hook

Shape = tuple[tuple[int, ...], torch.dtype]


class _Registrar(Protocol):
    def register(self, module: nn.Module, name: str,
                 param: nn.Parameter | None) -> nn.Parameter | None: ...


# One process-wide hook, installed once and never removed: adding or removing a global hook while
# another thread runs the hooks would break that thread's iteration over them. It serves the
# registrar active on the calling thread, if any.
_active = threading.local()
_install_lock = threading.Lock()
_installed = False


def _dispatch(module: nn.Module, name: str, param: nn.Parameter | None) -> nn.Parameter | None:
    registrar: _Registrar | None = getattr(_active, "registrar", None)
    return None if registrar is None else registrar.register(module, name, param)


@contextmanager
def _registering(registrar: _Registrar) -> Iterator[None]:
    """While open, parameters registered on this thread go through `registrar`."""
    global _installed
    with _install_lock:
        if not _installed:
            # torch types the hook as returning None; a returned parameter replaces the one
            # being registered.
            register_module_parameter_registration_hook(_dispatch)  # type: ignore[arg-type]
            _installed = True
    if getattr(_active, "registrar", None) is not None:
        raise RuntimeError("parameter placement: a build is already being placed on this thread")
    _active.registrar = registrar
    try:
        yield
    finally:
        _active.registrar = None


def module_order(model: nn.Module) -> list[nn.Parameter]:
    """The model's parameters once each, checkpoint parameters first, derived ones after (each
    group in module order)."""
    return sorted(model.parameters(), key=lambda p: bool(getattr(p, "derived", False)))


@dataclass(frozen=True)
class ParameterLayout:
    """Where a model's parameters live: `shapes` in module order (`module_order`), and for the n-th
    registration during construction the index of its parameter in `shapes` (-1: a parameter that
    construction replaced, which gets no home)."""

    shapes: tuple[Shape, ...]
    slot_of_registration: tuple[int, ...]


class _Recorder:
    """The parameters registered during a build, in order, each once (a tied weight registered
    twice counts at its first registration)."""

    def __init__(self) -> None:
        self.seen: list[nn.Parameter] = []  # strong references, so ids stay unique while building
        self._ids: set[int] = set()

    def register(self, module: nn.Module, name: str,
                 param: nn.Parameter | None) -> nn.Parameter | None:
        if param is not None and id(param) not in self._ids:
            self._ids.add(id(param))
            self.seen.append(param)
        return None


def plan_layout(build: Callable[[], nn.Module]) -> ParameterLayout:
    """Run `build` on the meta device (nothing is allocated) and return where its parameters go.
    `build` must construct the model on the current default device (it runs under
    `torch.device("meta")`) and may derive parameters (fp8 copies) after construction."""
    recorder = _Recorder()
    with torch.device("meta"), _registering(recorder):
        model = build()
    ordered = module_order(model)
    index = {id(p): i for i, p in enumerate(ordered)}
    return ParameterLayout(
        shapes=tuple((tuple(p.shape), p.dtype) for p in ordered),
        slot_of_registration=tuple(index.get(id(p), -1) for p in recorder.seen),
    )


class Placement:
    """The state of one real build inside `placed`: how many registrations it has seen."""

    def __init__(self, layout: ParameterLayout, homes: list[torch.Tensor]) -> None:
        if len(homes) != len(layout.shapes):
            raise ValueError(f"{len(homes)} homes for {len(layout.shapes)} planned parameters")
        self.layout = layout
        self.homes = homes
        self.count = 0
        self._placed: list[nn.Parameter] = []  # strong references: ids stay unique
        self._placed_ids: set[int] = set()

    def _home(self, slot: int, param: torch.Tensor) -> torch.Tensor:
        home = self.homes[slot]
        if home.shape != param.shape or home.dtype != param.dtype:
            raise RuntimeError(
                f"parameter placement: parameter {slot} is {tuple(param.shape)} {param.dtype}, "
                f"planned {tuple(home.shape)} {home.dtype} (the model built differently on meta)")
        return home

    def register(self, module: nn.Module, name: str,
                 param: nn.Parameter | None) -> nn.Parameter | None:
        """The registration hook: the parameter to register instead of `param`, or None to keep
        it."""
        if param is None or id(param) in self._placed_ids:
            return None
        n = self.count
        self.count += 1
        if n >= len(self.layout.slot_of_registration):
            raise RuntimeError(f"parameter placement: registration {n} ({name!r} of "
                               f"{type(module).__name__}) was not planned")
        slot = self.layout.slot_of_registration[n]
        if slot < 0:
            return None
        home = self._home(slot, param)
        with torch.no_grad():
            home.copy_(param)
        moved = nn.Parameter(home, requires_grad=param.requires_grad)
        moved.__dict__.update(param.__dict__)  # markers such as `derived`, `dummy_value`
        self._placed.append(moved)
        self._placed_ids.add(id(moved))
        return moved

    def finish(self, model: nn.Module) -> None:
        """Move any parameter the hook did not place (one set without `register_parameter`) into
        its home, so that every parameter of `model` lives in `homes`. A parameter found in
        another parameter's home means the build registered in another order than planned:
        refused (copying would overwrite that parameter)."""
        ordered = module_order(model)
        if len(ordered) != len(self.homes):
            raise RuntimeError(f"parameter placement: the model has {len(ordered)} parameters, "
                               f"{len(self.homes)} were planned")
        starts = {h.data_ptr(): i for i, h in enumerate(self.homes) if h.numel()}
        for slot, p in enumerate(ordered):
            home = self.homes[slot]
            if p.data_ptr() == home.data_ptr():
                continue
            other = starts.get(p.data_ptr())
            if other is not None:
                raise RuntimeError(f"parameter placement: parameter {slot} lies in the home of "
                                   f"parameter {other} (the build registered in another order)")
            home = self._home(slot, p)
            with torch.no_grad():
                home.copy_(p.data)
            p.data = home


@contextmanager
def placed(layout: ParameterLayout, homes: list[torch.Tensor]) -> Iterator[Placement]:
    """While open, parameters registered on this thread go into `homes[slot]` as planned by
    `layout` (`homes` in module order, as `layout.shapes`). Call `Placement.finish(model)` once
    the model is complete."""
    placement = Placement(layout, homes)
    with _registering(placement):
        yield placement


def _host_copies(model: nn.Module) -> tuple[list[tuple[nn.Module, str, int]],
                                            dict[int, tuple[torch.device, torch.Tensor]]]:
    """Each device buffer's owners (module, name, key) and, by key, its device and a host copy
    (a buffer shared by modules is copied once)."""
    owners: list[tuple[nn.Module, str, int]] = []
    copies: dict[int, tuple[torch.device, torch.Tensor]] = {}
    for module in model.modules():
        for name, buf in module._buffers.items():
            if buf is None or buf.device.type in ("cpu", "meta"):
                continue
            if id(buf) not in copies:
                copies[id(buf)] = (buf.device, buf.to("cpu"))
            owners.append((module, name, id(buf)))
    return owners, copies


@contextmanager
def buffers_on_host(model: nn.Module) -> Iterator[None]:
    """While open, the model's device buffers live on the host (the modules hold host copies);
    on exit they are copied back into fresh device memory. Emptying the allocator cache inside
    gives back every block the buffers had shared with freed parameters."""
    owners, copies = _host_copies(model)
    for module, name, key in owners:
        module._buffers[name] = copies[key][1]
    try:
        yield
    finally:
        back = {key: host.to(device) for key, (device, host) in copies.items()}
        for module, name, key in owners:
            module._buffers[name] = back[key]
