"""The streaming schedule: groups onloaded just before their forward, evicted right after.

Used by the `block_swap` tier (the swapped transformer blocks, in block order) and by the
`sequential` tier (every leaf module, in the order they first ran). When a group's forward has
been queued, the next `prefetch` groups start copying, so with a side stream the transfer hides
behind compute (and a pageable copy, which blocks the CPU, runs while the GPU works through the
queued kernels). At most `prefetch + 1` streamed groups are on the device at once, plus one just
evicted whose memory the GPU may still be reading: before each new copy the CPU waits until
older evicted groups have finished computing, so it never queues copies far ahead of the GPU.

Training adds a second pass per step: with per-block gradient checkpointing the backward re-runs
each block's forward, blocks in reverse order, through the same hooks. `begin_pass(backward=True)`
switches the schedule to that order (block swap: the blocks reversed; sequential: learned on the
first backward, as the forward's order is on the first forward), so the block the backward needs
next (the previous one in forward order) is copied ahead like the forward's next block. A
re-run is cut short once it has rebuilt what the backward needs (torch's checkpoint early stop),
so its forward hook may never fire: in the backward the prefetch is started when a group's
re-run begins, and the group re-run before it is evicted then. Training passes do not wrap round
(after the last block of the forward comes the backward, not the first block).
"""

from __future__ import annotations

from collections import deque
from typing import Any, Callable

import torch
from torch import nn

from .residency import WeightGroup
from .swapstats import SwapLedger

Observer = Callable[[str, WeightGroup], None]
EVICTED_IN_FLIGHT = 1  # evicted groups the GPU may still be computing with; bounds device memory
# Groups past the prefetch window whose file-backed weights (the disk tier) the kernel is asked to read ahead:
# their page-cache misses then overlap compute instead of stalling the copy that stages them.
READ_AHEAD_GROUPS = 2


class KeepBudget:
    """Device bytes streamed groups may keep beyond the schedule's window ("residency follows free
    memory"): a group whose forward is done stays on the device while the kept total fits, so the
    next step finds it there instead of copying it again. Shared by every schedule of one call
    (both experts of Wan 2.2 A14B). 0, the default, keeps nothing: the schedule as described above.
    """

    def __init__(self, limit_bytes: int = 0) -> None:
        self.limit_bytes = max(0, int(limit_bytes))
        self.kept_bytes = 0
        self.kept_groups = 0

    def take(self, nbytes: int) -> bool:
        if self.kept_bytes + nbytes > self.limit_bytes:
            return False
        self.kept_bytes += nbytes
        self.kept_groups += 1
        return True

    def give(self, nbytes: int) -> None:
        self.kept_bytes -= nbytes
        self.kept_groups -= 1

    def as_dict(self) -> dict:
        return {"limit_bytes": self.limit_bytes, "kept_bytes": self.kept_bytes, "kept_groups": self.kept_groups}


class PassOrder:
    """The order streamed groups run in during one kind of pass (forward, or training's backward).

    Known from the start (block swap's blocks), or learned on the first pass: a group seen for
    the first time goes right after the group that ran before it (a module that first runs in a
    later pass, e.g. a branch skipped on the first chunk, lands where it ran). Complete when the
    pass ends or a group runs a second time.
    """

    def __init__(self, groups: list[WeightGroup], known: bool) -> None:
        self.groups: list[WeightGroup] = list(groups) if known else []
        self._position = {id(g): i for i, g in enumerate(self.groups)}
        self.closed = known
        self._previous: WeightGroup | None = None

    def learn(self, group: WeightGroup) -> None:
        previous, self._previous = self._previous, group
        if id(group) in self._position:
            self.closed = True  # a group runs again: one full pass has been seen
            return
        at = self._position[id(previous)] + 1 if previous is not None and id(previous) in self._position else len(self.groups)
        self.groups.insert(at, group)
        self._position = {id(g): i for i, g in enumerate(self.groups)}

    def close(self) -> None:
        self.closed = True

    def after(self, group: WeightGroup, count: int, cyclic: bool) -> list[WeightGroup]:
        """The `count` groups that run after `group` (wrapping round to the first when `cyclic`)."""
        if not count or not self.closed or id(group) not in self._position:
            return []
        start, total = self._position[id(group)], len(self.groups)
        if cyclic:
            return [self.groups[(start + k) % total] for k in range(1, min(count, total - 1) + 1)]
        return self.groups[start + 1 : start + 1 + count]

    def opening(self, count: int) -> list[WeightGroup]:
        return self.groups[:count] if self.closed else []

    def wraps(self, group: WeightGroup, upcoming: WeightGroup) -> bool:
        """Whether `upcoming`, coming after `group`, runs in the next pass (the order wrapped round)."""
        return self._position[id(upcoming)] <= self._position[id(group)]


class StreamSchedule:
    """Onload/evict bookkeeping for one component's streamed groups.

    With `order_known` the groups are given in execution order (blocks run in index order);
    otherwise the order is learned on the first pass (it is complete when the component's
    forward ends, or when a group runs a second time), and prefetch starts once it is known.
    """

    def __init__(
        self,
        groups: list[WeightGroup],
        prefetch: int,
        order_known: bool,
        backend: Any,
        observer: Observer,
        ledger: SwapLedger | None = None,
        budget: KeepBudget | None = None,
    ) -> None:
        self.groups = groups
        self._budget = budget or KeepBudget()
        self._kept: set[int] = set()  # ids of groups kept on the device by the budget
        self._skipping: set[int] = set()  # ids of groups called but not computing (a step cache)
        self._foresight: dict[int, Callable[[bool], bool]] = {}  # id(group) -> will it compute (next pass?)
        self.copies = 0  # streamed groups copied to the device this call
        self.skipped = 0  # copies a step cache saved: skipped calls of groups the keep budget does not hold
        self._prefetch = prefetch
        self._backend = backend
        self._observe = observer
        self._ledger = ledger
        self._orders = {False: PassOrder(groups, order_known), True: PassOrder(groups[::-1], order_known)}
        self._backward = False
        self._cyclic = True  # sampling calls the forward again and again; training alternates passes
        self._in_flight: deque = deque()  # compute-done markers of evicted groups, oldest first
        self._running: WeightGroup | None = None  # the group whose forward ran last

    @property
    def _order(self) -> PassOrder:
        return self._orders[self._backward]

    def foresee(self, group: WeightGroup, computes: Callable[[bool], bool]) -> None:
        """`computes(next_pass)` says ahead whether `group` will compute when it runs next (later in this
        pass, or in the next pass): a group that will not is neither prefetched nor kept for it."""
        self._foresight[id(group)] = computes

    def skip(self, group: WeightGroup) -> None:
        """`group`'s module is called but will not compute this pass (a step cache skips it): its
        weights are not copied, and nothing is prefetched or evicted on its account. Counted as a
        copy saved unless the keep budget holds the group: a kept group stays on the device whether
        it computes or not, so an uncached call would not copy it for this pass either. A group that
        is on the device because it was prefetched still counts: uncached, it would compute, be
        evicted and be copied again for the next pass; held through the skip, that copy is saved."""
        self._order.learn(group)
        self._skipping.add(id(group))
        if id(group) not in self._kept:
            self.skipped += 1

    def before_forward(self, group: WeightGroup) -> None:
        self._order.learn(group)
        if self._backward and self._running is not None and self._running is not group and self._running.on_device:
            self._retire(self._running)  # its re-run is done (its after-hook may never fire)
        self._running = group
        self._drop_mispredicted(group)
        if not group.on_device:
            self._onload(group, "onload")
        if self._backward:
            self._prefetch_after(group)
        if self._ledger is None:
            group.wait()
            return
        start = self._backend.stamp()
        group.wait()
        self._ledger.waited(group, start, self._backend.stamp())

    def after_forward(self, group: WeightGroup) -> None:
        if id(group) in self._skipping:
            self._skipping.discard(id(group))
            return
        if self._ledger is not None:
            self._ledger.computed(group, self._backend.stamp())
        self._prefetch_after(group)
        self._retire(group)

    def begin_pass(self, backward: bool) -> None:
        """Training: the next pass is the backward (blocks re-run in reverse) or the forward.

        Closes the order of the pass that ended, evicts groups the new pass does not open with,
        and starts copying those it does, so its first streamed group does not stall. From the
        first call on, passes do not wrap round.
        """
        self._order.close()
        self._backward, self._cyclic, self._running = backward, False, None
        opening = self._order.opening(max(self._prefetch, 1))
        keep = {id(g) for g in opening}
        for other in self.groups:
            if other.on_device and id(other) not in keep:
                self._retire(other)
        for group in opening[: self._prefetch]:
            if not group.on_device:
                self._onload(group, "prefetch")

    def adopt(self, group: WeightGroup) -> None:
        """`group` starts the call on the device, where the last call kept it (a warm store): it stays
        for this call while the keep budget has room. Without this, the first forward would take it
        for a stale prefetch and evict it, and the call would copy it again."""
        if self._cyclic and self._budget.take(group.nbytes):
            self._kept.add(id(group))

    def _retire(self, group: WeightGroup) -> None:
        """Evict a group whose compute has been queued (the GPU may still be reading it), unless
        the keep budget has room for it: then it stays for the next pass (sampling only)."""
        if id(group) in self._kept:
            return
        if self._cyclic and self._budget.take(group.nbytes):
            self._kept.add(id(group))
            return
        group.evict()
        self._in_flight.append(self._backend.compute_done())
        self._observe("evict", group)

    def _prefetch_after(self, group: WeightGroup) -> None:
        for upcoming in self._upcoming(group):
            if not upcoming.on_device:
                self._onload(upcoming, "prefetch")
        beyond = self._order.after(group, self._prefetch + READ_AHEAD_GROUPS, self._cyclic)[self._prefetch:]
        for later in beyond:
            if self._computes(later, next_pass=self._order.wraps(group, later)):
                later.read_ahead()

    def _drop_mispredicted(self, group: WeightGroup) -> None:
        """Evict prefetched groups that the path did not reach (a module skipped this pass, e.g.
        the Wan VAE's first-chunk branch), so at most prefetch + 1 stay on the device. A group in the
        window that a step cache said would not compute stays: it was prefetched for a later pass
        that computes it (First Block Cache cannot know in advance), and the window bounds it."""
        window = self._order.after(group, self._prefetch, self._cyclic)
        expected = {id(group), *(id(g) for g in window), *self._kept}
        for other in self.groups:
            if other.on_device and id(other) not in expected:
                other.evict()
                self._observe("evict", other)

    def prefetch_start(self) -> None:
        """Start copying the groups that open the next pass (ahead of a hand-off to this component)."""
        for group in self._order.opening(self._prefetch):
            if not group.on_device:
                self._onload(group, "prefetch")

    def drain(self) -> None:
        """Wait until every evicted group's compute has finished (before another component copies)."""
        while self._in_flight:
            self._backend.host_wait(self._in_flight.popleft())

    def evict_all(self) -> None:
        for group in self.groups:
            if id(group) in self._kept:
                self._kept.discard(id(group))
                self._budget.give(group.nbytes)
            if group.on_device:
                group.evict()
                self._observe("evict", group)

    def end_of_pass(self) -> None:
        """The component's forward has finished: the learned execution order is complete.

        With foresight (a step cache), the groups that open the next pass are copied now when they
        will compute in it: a pass that ended without computing its last group (skipped) prefetched
        nothing, and the pass after it must not stall on its first group."""
        self._order.close()
        if not self._foresight or not self._cyclic:
            return
        for group in self._order.opening(self._prefetch):
            if not group.on_device and self._computes(group, next_pass=True):
                self._onload(group, "prefetch")

    def _onload(self, group: WeightGroup, kind: str) -> None:
        while len(self._in_flight) > EVICTED_IN_FLIGHT:
            self._backend.host_wait(self._in_flight.popleft())
        token = group.onload(timed=self._ledger is not None)
        self.copies += 1
        if self._ledger is not None:
            self._ledger.copied(group, token)
        self._observe(kind, group)

    def _upcoming(self, group: WeightGroup) -> list[WeightGroup]:
        """The groups to have on the device after `group`: the next `prefetch` in order, less those a
        step cache will skip (in this pass, or in the next for those past the end of the order)."""
        upcoming = self._order.after(group, self._prefetch, self._cyclic)
        if not self._foresight:
            return upcoming
        return [u for u in upcoming if self._computes(u, next_pass=self._order.wraps(group, u))]

    def _computes(self, group: WeightGroup, next_pass: bool) -> bool:
        computes = self._foresight.get(id(group))
        return computes is None or computes(next_pass)


def hook_group(module: nn.Module, group: WeightGroup, schedule: StreamSchedule,
               computes: Callable[[nn.Module], bool] | None = None) -> list:
    """Forward hooks that stream `group` around `module`'s forward; returns removable handles.

    `computes(module)`, when given, says whether the module's forward will compute this time (a
    step cache may have replaced it for this pass): if not, nothing is copied for it. When it also
    has `computes.ahead(module, next_pass)` (pipelines/step_cache.py `BlockGate`), the schedule
    asks it before prefetching the group, so no copy is made for a pass that will skip it. The hooks
    re-point parameters and touch streams: never traced by torch.compile (a compiled model runs
    them eagerly between its graphs).
    """

    @torch.compiler.disable
    def before(m, args):
        if computes is not None and not computes(m):
            schedule.skip(group)
            return
        schedule.before_forward(group)

    @torch.compiler.disable
    def after(m, args, out):
        schedule.after_forward(group)

    ahead = getattr(computes, "ahead", None)
    if ahead is not None:
        schedule.foresee(group, lambda next_pass: ahead(module, next_pass))
    return [module.register_forward_pre_hook(before), module.register_forward_hook(after)]
