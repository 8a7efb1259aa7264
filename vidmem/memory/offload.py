"""apply_strategy: put one stage's components where a MemoryStrategy says, for one call.

Tiers, as weight groups and hooks:
- `none`: every component is one group, onloaded at once and kept for the whole call.
- `model`: every component is one group; using a component (its forward, or `activate`)
  evicts the others first, so one component at a time is on the device.
- `block_swap`: as `model`, but the last N blocks of each block-bearing component are
  streamed groups: onloaded before their forward (with prefetch), evicted after.
- `sequential`: nothing resident; every module that owns tensors is a streamed group.

`OffloadHandle.remove()` takes every hook off and points every tensor back at its original
storage. Use it as a context manager so that happens even when a step raises.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from torch import nn

from .blockswap import Observer, StreamSchedule, hook_group
from .residency import WeightGroup, all_slots, own_slots
from .strategy import MemoryStrategy, OffloadTier


@dataclass(frozen=True)
class StageComponents:
    """The modules one stage uses, and for those with transformer blocks, where the blocks are."""

    modules: Mapping[str, nn.Module]
    blocks: Mapping[str, nn.ModuleList] = field(default_factory=dict)


@dataclass
class _ComponentState:
    resident: WeightGroup | None
    schedule: StreamSchedule | None

    def groups(self) -> list[WeightGroup]:
        streamed = self.schedule.groups if self.schedule else []
        return ([self.resident] if self.resident else []) + streamed


class OffloadHandle:
    """The applied strategy for one stage; `remove()` restores every module exactly."""

    def __init__(self, backend: Any, observer: Observer | None) -> None:
        self.backend = backend
        self._observe = observer or (lambda kind, group: None)
        self._components: dict[str, _ComponentState] = {}
        self._handles: list = []
        self._active: str | None = None

    def __enter__(self) -> "OffloadHandle":
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    @property
    def groups(self) -> list[WeightGroup]:
        return [g for state in self._components.values() for g in state.groups()]

    def activate(self, name: str) -> None:
        """Make `name` the component in use: evict the others, onload its resident part."""
        if self._active == name or name not in self._components:
            return
        for other, state in self._components.items():
            if other != name:
                self._evict_component(state)
        resident = self._components[name].resident
        if resident is not None and not resident.resident:
            resident.onload()
            resident.wait()
            self._observe("onload", resident)
        self._active = name

    def evict(self, name: str) -> None:
        """Evict one component now (e.g. the text encoder once prompts are encoded)."""
        if name in self._components:
            self._evict_component(self._components[name])
            if self._active == name:
                self._active = None

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for group in self.groups:
            group.restore()
        self._components.clear()
        self._active = None

    def _evict_component(self, state: _ComponentState) -> None:
        if state.resident is not None and state.resident.resident:
            state.resident.evict()
            self._observe("evict", state.resident)
        if state.schedule is not None:
            state.schedule.evict_all()


def apply_strategy(
    stage: StageComponents,
    strategy: MemoryStrategy,
    backend: Any,
    observer: Observer | None = None,
) -> OffloadHandle:
    """Apply `strategy` to `stage` on `backend`'s device; nothing is left applied if this raises.

    Example:
        with apply_strategy(stage, strategy, backend_for(device)) as handle:
            handle.activate("vae")
            frames = vae.decode(latents)
    """
    for name, blocks in stage.blocks.items():
        strategy.check_against_model(len(blocks), name)
    handle = OffloadHandle(backend, observer)
    try:
        for name, module in stage.modules.items():
            handle._components[name] = _build_component(
                handle, name, module, stage.blocks.get(name), strategy, backend, observer
            )
        if strategy.offload is OffloadTier.NONE:
            for state in handle._components.values():
                state.resident.onload()
                state.resident.wait()
    except BaseException:
        handle.remove()
        raise
    return handle


def _build_component(
    handle: OffloadHandle,
    name: str,
    module: nn.Module,
    blocks: nn.ModuleList | None,
    strategy: MemoryStrategy,
    backend: Any,
    observer: Observer | None,
) -> _ComponentState:
    tier, nb = strategy.offload, strategy.non_blocking
    streamed = _streamed_modules(module, blocks, strategy)
    streamed_ids = {id(m) for m in streamed}
    if tier is OffloadTier.SEQUENTIAL:
        resident_modules: list[nn.Module] = []
    else:
        resident_modules = _modules_outside(module, streamed_ids)
    resident = WeightGroup(f"{name}", _own_slots_of(resident_modules), backend, nb) if resident_modules else None
    schedule = None
    if streamed:
        names = {id(m): qualified for qualified, m in module.named_modules()}
        groups = [_streamed_group(f"{name}.{names[id(m)]}".rstrip("."), m, tier, backend, nb) for m in streamed]
        schedule = StreamSchedule(groups, strategy.prefetch_blocks, tier is OffloadTier.BLOCK_SWAP, observer)
        for m, group in zip(streamed, groups):
            handle._handles += hook_group(m, group, schedule)
        handle._handles.append(module.register_forward_hook(lambda m, args, out: schedule.end_of_pass()))
    state = _ComponentState(resident, schedule)
    if tier is not OffloadTier.NONE:
        handle._handles.append(module.register_forward_pre_hook(lambda m, args: handle.activate(name)))
    return state


def _streamed_modules(module: nn.Module, blocks: nn.ModuleList | None, strategy: MemoryStrategy) -> list[nn.Module]:
    if strategy.offload is OffloadTier.SEQUENTIAL:
        return [m for m in module.modules() if own_slots(m)]
    if strategy.offload is OffloadTier.BLOCK_SWAP and blocks is not None:
        return list(blocks)[len(blocks) - strategy.blocks_to_swap :]
    return []


def _modules_outside(root: nn.Module, excluded: set[int]) -> list[nn.Module]:
    """Every module under `root` that is not inside an excluded subtree."""
    kept: list[nn.Module] = []

    def visit(m: nn.Module) -> None:
        if id(m) in excluded:
            return
        kept.append(m)
        for child in m.children():
            visit(child)

    visit(root)
    return kept


def _own_slots_of(modules: list[nn.Module]) -> list:
    return [slot for m in modules for slot in own_slots(m)]


def _streamed_group(label: str, m: nn.Module, tier: OffloadTier, backend: Any, nb: bool) -> WeightGroup:
    # A swapped block moves with all its children; a sequential group is one module's own tensors.
    slots = all_slots([m]) if tier is OffloadTier.BLOCK_SWAP else own_slots(m)
    return WeightGroup(label, slots, backend, nb)
