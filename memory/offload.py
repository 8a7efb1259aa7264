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
storage. Use it as a context manager so that happens even when a step raises. With a warm store
(memory/warm.py), a call that ends without error hands the device copies still in place to the
store, and the next call starts from them: weights already on the device are not copied again.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch
from torch import nn

from .blockswap import EVICTED_IN_FLIGHT, KeepBudget, Observer, StreamSchedule, hook_group
from .cleanup import release_dropped_pinned
from .hostpool import HostPool, pinned_cap_bytes
from .residency import Slot, WeightGroup, own_slots, partition_slots, tie, tied_bytes
from .strategy import MemoryStrategy, OffloadTier
from .swapstats import SwapLedger
from .warm import ACTIVE_CORE, IDLE_CORE, STREAMED, WarmStore, rehome_everywhere
from .storage.mapping import any_mapped_files, check_files_unchanged


@dataclass(frozen=True)
class StageComponents:
    """The modules one stage uses, and for those with transformer blocks, where the blocks are."""

    modules: Mapping[str, nn.Module]
    blocks: Mapping[str, nn.ModuleList] = field(default_factory=dict)


@dataclass
class _Component:
    core: WeightGroup | None  # everything not streamed, moved as one group
    schedule: StreamSchedule | None
    denoiser: bool = False  # has transformer blocks: runs every step, to the call's end


class OffloadHandle:
    """The applied strategy for one stage; `remove()` restores every module exactly."""

    def __init__(self, strategy: MemoryStrategy, backend: Any, observer: Observer | None, telemetry: bool,
                 warm: WarmStore | None = None, keep_bytes: int = 0,
                 compute_gate: Callable[[nn.Module], bool] | None = None) -> None:
        self.strategy = strategy
        self.compute_gate = compute_gate  # whether a streamed module computes when called (a step cache)
        self.backend = backend
        self.warm = warm
        self.keep = KeepBudget(keep_bytes)  # streamed bytes that may stay on the device (free memory permitting)
        self.ledger = SwapLedger(backend) if telemetry else None
        self._exclusive = strategy.offload is not OffloadTier.NONE  # one component at a time
        self._observe = observer or (lambda kind, group: None)
        self._components: dict[str, _Component] = {}
        self._groups: list[WeightGroup] = []  # every group made, registered as soon as it exists
        self._hooks: list = []
        self._active: str | None = None

    def __enter__(self) -> "OffloadHandle":
        return self

    def __exit__(self, exc_type, *exc: object) -> None:
        self.remove(keep=exc_type is None)

    def __repr__(self) -> str:
        return f"OffloadHandle({self.strategy.describe()}, {len(self._groups)} groups, {len(self._hooks)} hooks)"

    @property
    def groups(self) -> list[WeightGroup]:
        return list(self._groups)

    def activate(self, name: str) -> None:
        """Make `name` the component in use: onload its core (evicting the others first
        unless the tier keeps everything on the device)."""
        if self._active == name or name not in self._components:
            return
        if self._exclusive:
            for other, component in self._components.items():
                if other != name:
                    self._evict(component)
        core = self._components[name].core
        if core is not None and not core.on_device:
            core.onload()
            core.wait()
            self._observe("onload", core)
        self._active = name

    def evict(self, name: str) -> None:
        """Evict one component now (e.g. the text encoder once prompts are encoded)."""
        if name in self._components:
            self._evict(self._components[name])
            if self._active == name:
                self._active = None

    def hand_off(self, finished: str, next_: str) -> None:
        """`finished` will not run again this call and `next_` runs next (Wan 2.2 A14B's experts).

        Evicts what `finished` had prefetched for a pass that will not come, and starts copying
        the blocks that open `next_`'s first pass, so its first streamed block does not stall.
        Its core still moves when it activates: holding both cores at once would need the VRAM
        of two transformers.
        """
        if finished in self._components and self._components[finished].schedule is not None:
            self._components[finished].schedule.evict_all()
            self._components[finished].schedule.drain()  # its blocks' memory is free before new copies
        if next_ in self._components and self._components[next_].schedule is not None:
            self._components[next_].schedule.prefetch_start()

    def begin_pass(self, name: str, backward: bool) -> None:
        """Training: `name`'s next pass is the backward (with checkpointing its blocks re-run in
        reverse order, and the schedule prefetches in that order) or the next step's forward.
        Call it before `loss.backward()` and again after; sampling never calls it."""
        if name in self._components and self._components[name].schedule is not None:
            self._components[name].schedule.begin_pass(backward)

    def stream_counts(self) -> dict:
        """Streamed groups copied to the device, and copies a step cache saved by skipping them (not a group the
        keep budget holds: it stays on the device either way), this call."""
        schedules = [c.schedule for c in self._components.values() if c.schedule is not None]
        return {"copies": sum(s.copies for s in schedules), "skipped": sum(s.skipped for s in schedules)}

    def swap_summary(self) -> dict:
        """Bytes moved and time spent copying, waiting and computing, per streamed group (after the
        call's passes). A prefetch still in flight is claimed for the compute stream first: the
        timing reads synchronise the host on its copy, and the claim `remove(keep=True)` makes for
        the warm store would otherwise come after that (harmless once the copy is done, but a compute
        wait on a copy the host already waited for is what the CUDA-path tests flag in the loop)."""
        if not self.ledger:
            return {"blocks": {}, "totals": {}}
        for group in self._groups:
            self._claim_for_compute(group)
        return self.ledger.summary()

    def remove(self, keep: bool = False) -> None:
        """Take every hook off and restore every tensor. With `keep` (a call that ended well), the
        device copies still in place go to the warm store for the next call; otherwise, and for
        whatever the store kept that this call did not take back, the copies are dropped."""
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        try:
            if self.warm is not None:
                self.warm.forget()  # what this call did not take back is not needed any more
                if keep:
                    for group in self._groups:
                        self._claim_for_compute(group)
                        self.warm.keep(group.kept_pairs(), self._keep_rank(group))
        except BaseException:
            self.warm.release_all()  # a keep that failed half-way keeps nothing
            raise
        finally:  # whatever keeping raised, every module goes back to its host tensors
            for group in self._groups:
                group.restore()
            self._groups.clear()
            self._components.clear()
            self._active = None

    @staticmethod
    def _claim_for_compute(group: WeightGroup) -> None:
        """A streamed group the schedule began copying for a pass that never came (the call ended)
        still has its side-stream copy pending. The next call takes the copy from the warm store
        with no token to wait on, so claim it now: the compute stream waits for the copy and the
        allocator learns the compute stream uses it (record_stream), or a later kernel could read
        it half-copied, or its memory be handed to the next prefetch while a kernel reads it."""
        if group.streamed and group.on_device:
            group.wait()

    def _adopt_kept(self) -> None:
        """Take back what the warm store kept where the last call ended (no copy); a streamed group
        taken back counts against this call's keep budget, as if this call had kept it."""
        for component in self._components.values():
            if component.core is not None:
                component.core.adopt_kept()
            if component.schedule is None:
                continue
            for group in component.schedule.groups:
                if group.adopt_kept():
                    component.schedule.adopt(group)

    def _keep_rank(self, group: WeightGroup) -> int:
        """Which kept copies go first when the host asks for memory back (memory/warm.py)."""
        if group.streamed:
            return STREAMED
        return ACTIVE_CORE if any(component.core is group for component in self._ended_with()) else IDLE_CORE

    def _ended_with(self) -> list[_Component]:
        """The components in use when the call ended: the active one under the tiers that keep one at
        a time; under tier none the denoisers (a text or image encoder ran only at the start, so it is
        the cheaper loss), or every component of a stage without one (the decode's VAE)."""
        if self._exclusive:
            return [self._components[self._active]] if self._active in self._components else []
        denoisers = [component for component in self._components.values() if component.denoiser]
        return denoisers or list(self._components.values())

    def _evict(self, component: _Component) -> None:
        if component.core is not None and component.core.on_device:
            component.core.evict()
            self._observe("evict", component.core)
        if component.schedule is not None:
            component.schedule.evict_all()

    def _group(self, name: str, tensors: list[list[Slot]], streamed: bool) -> WeightGroup:
        group = WeightGroup(name, tensors, self.backend, streamed, self.strategy.non_blocking, self.warm)
        self._groups.append(group)
        return group

    def _add_component(self, name: str, module: nn.Module, blocks: nn.ModuleList | None, pool: HostPool) -> None:
        strategy = self.strategy
        core_slots, streamed = _partition(module, streamed_units(module, blocks, strategy))
        core = self._group(name, tie(core_slots), streamed=False) if core_slots else None
        schedule = None
        if streamed:
            heads = [head for head, _ in streamed]
            groups = self._streamed_groups(name, module, streamed, pool)
            order_known = strategy.offload is OffloadTier.BLOCK_SWAP
            schedule = StreamSchedule(groups, strategy.prefetch_blocks, order_known, self.backend, self._observe, self.ledger,
                                      self.keep)
            for head, group in zip(heads, groups):
                self._hooks += hook_group(head, group, schedule, self.compute_gate)
            self._hooks.append(module.register_forward_hook(torch.compiler.disable(lambda m, args, out: schedule.end_of_pass())))
        self._components[name] = _Component(core, schedule, denoiser=blocks is not None)
        if self._exclusive:
            self._hook_activation(name, module)

    def _streamed_groups(self, name: str, module: nn.Module, streamed: list[tuple[nn.Module, list[Slot]]],
                         pool: HostPool) -> list[WeightGroup]:
        """One group per streamed unit, its tensors given pinned homes unit by unit. `streamed` is
        emptied on the way: a unit's original (pageable) tensors are let go as soon as its homes are
        made, so adopting a model never holds a second copy of more than one unit in RAM."""
        cap = pinned_cap_bytes(self.strategy.max_pinned_ram_gb, pool.host_room_bytes)
        names = {id(m): qualified for qualified, m in module.named_modules()}
        # A new pinned home is every store's news: the decode's store may keep a copy of a VAE tensor this
        # call's sequential tier streams (image-to-video), which would otherwise orphan the old host tensor.
        rehome = rehome_everywhere if self.warm is not None else None
        groups = []
        streamed.reverse()  # popped from the end: first unit first
        while streamed:
            head, slots = streamed.pop()
            tensors = pool.adopt(tie(slots), self.backend, cap, rehome)
            groups.append(self._group(f"{name}.{names[id(head)] or '(root)'}", tensors, streamed=True))
        return groups

    def _hook_activation(self, name: str, module: nn.Module) -> None:
        """Using a component onloads it and brings its inputs to the device.

        Components are also used through methods that are not `forward` (a VAE's `encode` and
        `decode`), but every computation passes through the root or one of its direct children.
        diffusers sends inputs to where a component's first weight sits *before* calling it,
        which is the host until this hook has run, hence the move.
        """
        device = self.backend.device

        @torch.compiler.disable  # moves weights and inputs: runs eagerly under torch.compile
        def enter(m, args, kwargs):
            self.activate(name)
            return _to_device(args, device), _to_device(kwargs, device)

        for entry in (module, *module.children()):
            self._hooks.append(entry.register_forward_pre_hook(enter, with_kwargs=True))


def apply_strategy(
    stage: StageComponents,
    strategy: MemoryStrategy,
    backend: Any,
    observer: Observer | None = None,
    host_pool: HostPool | None = None,
    telemetry: bool = False,
    warm: WarmStore | None = None,
    keep_bytes: int = 0,
    compute_gate: Callable[[nn.Module], bool] | None = None,
    unpin_beyond_ceiling: bool = True,
) -> OffloadHandle:
    """Apply `strategy` to `stage` on `backend`'s device; nothing is left applied if this raises.

    Streamed tensors get pinned host homes from `host_pool` (kept by the caller across runs,
    capped by `strategy.max_pinned_ram_gb`). With `telemetry`, `handle.swap_summary()` reports
    what streaming cost (CUDA timing events per streamed forward; leave it off where unread).
    With `warm` (the stage's store, kept by the caller across calls), groups whose copies the
    store kept start on the device, and the others take what it has before copying the rest;
    `warm.tally` counts bytes uploaded and reused. `keep_bytes`: device memory streamed groups may
    keep beyond the schedule's window while sampling (free memory the run does not need); a kept
    block is not copied again on the next step (`handle.keep` says how many were kept).
    `compute_gate(module)`: whether a streamed module will compute when it is called now (False:
    a step cache skips it this pass, so its weights are not copied; `handle.stream_counts()`).
    `unpin_beyond_ceiling`: the stage's streamed blocks are what `host_pool` holds (the sampler,
    training), so a streaming strategy's `max_pinned_ram_gb` lower than what earlier calls pinned
    unpins the excess first (`HostPool.fit_ceiling`). Turn it off for a stage that shares the pool
    without owning it (the decode): its own ceiling would unpin the sampler's homes every run and
    the sampler would pin them again at its next.

    Example:
        with apply_strategy(stage, strategy, backend_for(device)) as handle:
            handle.activate("vae")
            frames = vae.decode(latents)
    """
    for name, blocks in stage.blocks.items():
        strategy.check_against_model(len(blocks), name)
    if any_mapped_files():  # the disk tier: refuse before anything is placed
        check_files_unchanged(stage_tensors(stage))
    handle = OffloadHandle(strategy, backend, observer, telemetry, warm, keep_bytes, compute_gate)
    pool = host_pool or HostPool()
    if unpin_beyond_ceiling and strategy.streams_blocks:
        _fit_pool(pool, strategy)
    try:
        for name, module in stage.modules.items():
            handle._add_component(name, module, stage.blocks.get(name), pool)
        if backend.can_pin:  # after this call's homes reused what they could of a dropped pipeline's pinned blocks
            release_dropped_pinned()
        handle._adopt_kept()
        if not handle._exclusive:
            for group in handle.groups:
                group.onload()
                group.wait()
    except BaseException:
        handle.remove()
        raise
    return handle


def _fit_pool(pool: HostPool, strategy: MemoryStrategy) -> None:
    """Unpin what `pool` holds beyond what this call may keep pinned (homes made under a higher ceiling):
    the user's `max_pinned_ram_gb`, lowered since, which is kept whatever the host's budget (new homes
    are pinned up to it: fitting it to less would unpin and pin again every run); unset, the room the
    host's pinned budget leaves (`pool.host_room_bytes`: ComfyUI may have pinned more of its own since).
    The free-RAM part of the automatic ceiling unpins nothing: the free RAM it reads is what the pool's
    homes already left (`default_pinned_cap`)."""
    if strategy.max_pinned_ram_gb is not None:
        pool.fit_ceiling(pinned_cap_bytes(strategy.max_pinned_ram_gb), rehome_everywhere)
    elif pool.host_room_bytes is not None:
        pool.fit_ceiling(pool.host_room_bytes, rehome_everywhere)


def _partition(module: nn.Module, units: list[tuple[nn.Module, list[nn.Module]]]
               ) -> tuple[list[Slot], list[tuple[nn.Module, list[Slot]]]]:
    """`module`'s resident slots, and (head, slots) of each streamed unit that holds tensors."""
    core, unit_slots = partition_slots(module, [members for _, members in units])
    return core, [(head, slots) for (head, _), slots in zip(units, unit_slots) if slots]


def stage_tensors(stage: StageComponents) -> list[torch.Tensor]:
    """Every tensor the stage's modules hold now: between calls, the host tensors a warm store keys
    its copies by."""
    return [slot.current() for module in stage.modules.values() for m in module.modules() for slot in own_slots(m)]


def device_weight_bytes(stage: StageComponents, strategy: MemoryStrategy) -> int:
    """Weight bytes the tier puts on the device at its peak (activations come on top).

    Computed from the same partition apply_strategy uses, without moving anything, so a host
    can be asked to make room before the first onload. Streamed groups count prefetch + 1, plus
    the evicted ones whose memory the GPU may still be reading (EVICTED_IN_FLIGHT).
    """
    per_component = []
    for name, module in stage.modules.items():
        units = streamed_units(module, stage.blocks.get(name), strategy)
        core, unit_slots = partition_slots(module, [members for _, members in units])
        streamed = sorted((tied_bytes(tie(slots)) for slots in unit_slots), reverse=True)
        # the running group, its prefetches, and evicted groups the GPU may still be reading
        at_once = strategy.prefetch_blocks + 1 + EVICTED_IN_FLIGHT
        per_component.append(tied_bytes(tie(core)) + sum(streamed[:at_once]))
    if strategy.offload is OffloadTier.NONE:
        return sum(per_component)
    return max(per_component, default=0)


def streamed_units(
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


def _to_device(value: Any, device: torch.device) -> Any:
    """Tensors inside `value` (nested tuples, lists, dicts) on `device`; everything else as is.

    A container whose tensors are all in place is returned itself, not copied: callers may pass
    lists they mutate as a side channel (the Wan VAE's causal cache, `feat_cache`).
    """
    if isinstance(value, torch.Tensor):
        return value if value.device == device else value.to(device)
    if isinstance(value, (tuple, list)):
        moved = [_to_device(v, device) for v in value]
        if all(m is v for m, v in zip(moved, value)):
            return value
        return type(value)._make(moved) if hasattr(value, "_fields") else type(value)(moved)  # namedtuples
    if isinstance(value, dict):
        moved = {k: _to_device(v, device) for k, v in value.items()}
        return value if all(moved[k] is v for k, v in value.items()) else type(value)(moved)
    return value
