"""Parameters made in storage chosen before the model exists (the memory saver's weights region).

A model is built twice. First on the meta device, which allocates nothing: `plan_layout` learns
every parameter's shape and dtype, its place in module order (checkpoint parameters first, then
derived ones such as the fp8 copies, which `ModelRunner`'s region and the CPU backup expect), and
the order in which construction registers them. Then for real, inside `placed(layout, homes)`: a
parameter-registration hook copies each parameter, as its module registers it, into the tensor
planned for it and registers a parameter over that tensor instead. The first home of a parameter is
dropped at once, so the weights are never resident twice (the old copy-after-load path peaked at
two copies of every weight).

Invariants: the real build registers the same parameters in the same order as the meta build (it
runs the same code); a parameter registered again (a tied weight) keeps the storage it already
has; parameters that construction replaced before it finished get no home; `finish` places any
parameter the hook did not see, so every parameter ends in its home whatever the build did.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn.modules.module import register_module_parameter_registration_hook

Shape = tuple[tuple[int, ...], torch.dtype]


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


def _registrations(build: Callable[[], nn.Module]) -> tuple[nn.Module, list[nn.Parameter]]:
    """Runs `build` and returns the model with the parameters registered during it, in order,
    each once (a tied weight registered twice counts at its first registration)."""
    seen: list[nn.Parameter] = []  # strong references, so ids stay unique while building
    ids: set[int] = set()
    owner = threading.get_ident()

    def record(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and threading.get_ident() == owner and id(param) not in ids:
            ids.add(id(param))
            seen.append(param)

    handle = register_module_parameter_registration_hook(record)
    try:
        model = build()
    finally:
        handle.remove()
    return model, seen


def plan_layout(build: Callable[[], nn.Module]) -> ParameterLayout:
    """Run `build` on the meta device (nothing is allocated) and return where its parameters go.
    `build` must construct the model on the current default device (it runs under
    `torch.device("meta")`) and may derive parameters (fp8 copies) after construction."""
    with torch.device("meta"):
        model, registered = _registrations(build)
    ordered = module_order(model)
    index = {id(p): i for i, p in enumerate(ordered)}
    return ParameterLayout(
        shapes=tuple((tuple(p.shape), p.dtype) for p in ordered),
        slot_of_registration=tuple(index.get(id(p), -1) for p in registered),
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
        self._owner = threading.get_ident()

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
        if param is None or threading.get_ident() != self._owner or id(param) in self._placed_ids:
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
        its home, so that every parameter of `model` lives in `homes`."""
        ordered = module_order(model)
        if len(ordered) != len(self.homes):
            raise RuntimeError(f"parameter placement: the model has {len(ordered)} parameters, "
                               f"{len(self.homes)} were planned")
        for slot, p in enumerate(ordered):
            home = self.homes[slot]
            if p.data_ptr() != home.data_ptr():
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
    # torch types the hook as returning None; a returned parameter replaces the registered one.
    handle = register_module_parameter_registration_hook(placement.register)  # type: ignore[arg-type]
    try:
        yield placement
    finally:
        handle.remove()
