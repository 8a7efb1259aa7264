"""apply_strategy: put one stage's components where a MemoryStrategy says, for one call.

Tiers, as weight groups and hooks:
- `none`: every component is one group, onloaded at once and kept for the whole call.
- `model`: every component is one group; using a component (its forward, or `activate`)
  evicts the others first, so one component at a time is on the device.
- `block_swap`: as `model`, but the last N blocks of each block-bearing component are
  streamed groups: onloaded before their forward (with prefetch), evicted after.
- `sequential`: every leaf module is a streamed group; only tensors held directly by parent
  modules (small modulation and position tables) stay resident while the component runs.

`OffloadHandle.remove()` takes every hook off and points every tensor back at its original
storage. Use it as a context manager so that happens even when a step raises.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from torch import nn

from .blockswap import Observer, StreamSchedule, hook_group
from .hostpool import HostPool, pinned_cap_bytes
from .residency import WeightGroup, own_slots, partition_slots
from .swapstats import SwapLedger
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

    def __init__(self, backend: Any, observer: Observer | None, exclusive: bool) -> None:
        self.backend = backend
        self.ledger = SwapLedger(backend)
        self._exclusive = exclusive  # one component on the device at a time (every tier but none)
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
        """Make `name` the component in use: onload its resident part (evicting the others first
        unless the tier keeps everything resident)."""
        if self._active == name or name not in self._components:
            return
        for other, state in self._components.items():
            if other != name and self._exclusive:
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

    def swap_summary(self) -> dict:
        """Bytes moved and time spent copying, waiting and computing, per streamed group."""
        return self.ledger.summary()

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
    host_pool: HostPool | None = None,
) -> OffloadHandle:
    """Apply `strategy` to `stage` on `backend`'s device; nothing is left applied if this raises.

    Streamed tensors get pinned host homes from `host_pool` (kept by the caller across runs,
    capped by `strategy.max_pinned_ram_gb`); `handle.swap_summary()` reports what streaming cost.

    Example:
        with apply_strategy(stage, strategy, backend_for(device)) as handle:
            handle.activate("vae")
            frames = vae.decode(latents)
    """
    for name, blocks in stage.blocks.items():
        strategy.check_against_model(len(blocks), name)
    handle = OffloadHandle(backend, observer, exclusive=strategy.offload is not OffloadTier.NONE)
    pinning = _Pinning(host_pool or HostPool(), backend.pin, pinned_cap_bytes(strategy.max_pinned_ram_gb))
    try:
        for name, module in stage.modules.items():
            handle._components[name] = _build_component(
                handle, name, module, stage.blocks.get(name), strategy, backend, pinning
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
    pinning: "_Pinning",
) -> _ComponentState:
    tier, nb = strategy.offload, strategy.non_blocking
    units = _streamed_units(module, blocks, strategy)
    resident_slots, unit_slots = partition_slots(module, [members for _, members in units])
    resident = WeightGroup(name, resident_slots, backend, nb) if resident_slots else None
    streamed = [(head, [pinning.adopt(s) for s in slots]) for (head, _), slots in zip(units, unit_slots) if slots]
    schedule = None
    if streamed:
        names = {id(m): qualified for qualified, m in module.named_modules()}
        groups = [WeightGroup(f"{name}.{names[id(head)] or '(root)'}", slots, backend, nb) for head, slots in streamed]
        schedule = StreamSchedule(
            groups, strategy.prefetch_blocks, tier is OffloadTier.BLOCK_SWAP, handle._observe, handle.ledger, backend
        )
        for (head, _), group in zip(streamed, groups):
            handle._handles += hook_group(head, group, schedule)
        handle._handles.append(module.register_forward_hook(lambda m, args, out: schedule.end_of_pass()))
    if tier is not OffloadTier.NONE:
        # Components are also used through methods that are not `forward` (a VAE's `encode` and
        # `decode`), but every computation passes through the root or one of its direct children.
        for entry in (module, *module.children()):
            handle._handles.append(entry.register_forward_pre_hook(lambda m, args: handle.activate(name)))
    return _ComponentState(resident, schedule)


def device_weight_bytes(stage: StageComponents, strategy: MemoryStrategy) -> int:
    """Weight bytes the tier puts on the device at its peak (activations come on top).

    Computed from the same partition apply_strategy uses, without moving anything, so a host
    can be asked to make room before the first onload.
    """
    per_component = []
    for name, module in stage.modules.items():
        units = _streamed_units(module, stage.blocks.get(name), strategy)
        resident, unit_slots = partition_slots(module, [members for _, members in units])
        streamed = sorted((_slot_bytes(slots) for slots in unit_slots), reverse=True)
        per_component.append(_slot_bytes(resident) + sum(streamed[: strategy.prefetch_blocks + 1]))
    if strategy.offload is OffloadTier.NONE:
        return sum(per_component)
    return max(per_component, default=0)


def _slot_bytes(slots) -> int:
    unique = {id(s.current()): s.host for s in slots}
    return sum(t.numel() * t.element_size() for t in unique.values())


@dataclass(frozen=True)
class _Pinning:
    pool: HostPool
    pin: Any
    cap_bytes: int

    def adopt(self, slot):
        return self.pool.adopt(slot, self.pin, self.cap_bytes)


def _streamed_units(
    module: nn.Module, blocks: nn.ModuleList | None, strategy: MemoryStrategy
) -> list[tuple[nn.Module, list[nn.Module]]]:
    """(module whose forward brings the unit in, modules whose own tensors the unit holds).

    Sequential streams leaf modules only: tensors held directly by a parent (Wan's modulation
    tables, CogVideoX's positional table) are needed for the parent's whole forward, so they
    stay resident while the component runs; that keeps at most prefetch + 1 units on the device.
    """
    if strategy.offload is OffloadTier.SEQUENTIAL:
        return [(m, [m]) for m in module.modules() if own_slots(m) and next(m.children(), None) is None]
    if strategy.offload is OffloadTier.BLOCK_SWAP and blocks is not None:
        return [(b, list(b.modules())) for b in list(blocks)[len(blocks) - strategy.blocks_to_swap :]]
    return []
