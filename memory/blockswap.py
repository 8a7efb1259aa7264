"""The streaming schedule: groups onloaded just before their forward, evicted right after.

Used by the `block_swap` tier (the swapped transformer blocks, in block order) and by the
`sequential` tier (every leaf module, in the order they first ran). When a group's forward has
been queued, the next `prefetch` groups start copying, so with a side stream the transfer hides
behind compute (and a pageable copy, which blocks the CPU, runs while the GPU works through the
queued kernels). At most `prefetch + 1` streamed groups are on the device at once, plus one just
evicted whose memory the GPU may still be reading: before each new copy the CPU waits until
older evicted groups have finished computing, so it never queues copies far ahead of the GPU.
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
    ) -> None:
        self.groups = groups
        self._prefetch = prefetch
        self._backend = backend
        self._observe = observer
        self._ledger = ledger
        self._order: list[WeightGroup] = list(groups) if order_known else []
        self._position = {id(g): i for i, g in enumerate(self._order)}
        self._order_closed = order_known
        self._in_flight: deque = deque()  # compute-done markers of evicted groups, oldest first
        self._previous: WeightGroup | None = None  # the group that ran last, to place new ones

    def before_forward(self, group: WeightGroup) -> None:
        self._learn(group)
        self._drop_mispredicted(group)
        if not group.on_device:
            self._onload(group, "onload")
        if self._ledger is None:
            group.wait()
            return
        start = self._backend.stamp()
        group.wait()
        self._ledger.waited(group, start, self._backend.stamp())

    def after_forward(self, group: WeightGroup) -> None:
        if self._ledger is not None:
            self._ledger.computed(group, self._backend.stamp())
        for upcoming in self._upcoming(group):
            if not upcoming.on_device:
                self._onload(upcoming, "prefetch")
        group.evict()
        self._in_flight.append(self._backend.compute_done())
        self._observe("evict", group)

    def _drop_mispredicted(self, group: WeightGroup) -> None:
        """Evict prefetched groups that the path did not reach (a module skipped this pass, e.g.
        the Wan VAE's first-chunk branch), so at most prefetch + 1 stay on the device."""
        expected = {id(group), *(id(g) for g in self._upcoming(group))}
        for other in self.groups:
            if other.on_device and id(other) not in expected:
                other.evict()
                self._observe("evict", other)

    def prefetch_start(self) -> None:
        """Start copying the groups that open the next pass (ahead of a hand-off to this component)."""
        if self._order_closed:
            for group in self._order[: self._prefetch]:
                if not group.on_device:
                    self._onload(group, "prefetch")

    def drain(self) -> None:
        """Wait until every evicted group's compute has finished (before another component copies)."""
        while self._in_flight:
            self._backend.host_wait(self._in_flight.popleft())

    def evict_all(self) -> None:
        for group in self.groups:
            if group.on_device:
                group.evict()
                self._observe("evict", group)

    def end_of_pass(self) -> None:
        """The component's forward has finished: the learned execution order is complete."""
        self._order_closed = True

    def _onload(self, group: WeightGroup, kind: str) -> None:
        while len(self._in_flight) > EVICTED_IN_FLIGHT:
            self._backend.host_wait(self._in_flight.popleft())
        token = group.onload(timed=self._ledger is not None)
        if self._ledger is not None:
            self._ledger.copied(group, token)
        self._observe(kind, group)

    def _learn(self, group: WeightGroup) -> None:
        previous, self._previous = self._previous, group
        if id(group) in self._position:
            self._order_closed = True  # a group runs again: one full pass has been seen
            return
        # A module that first runs in a later pass (a branch skipped on the first chunk) goes
        # where it ran: right after the group that ran before it.
        at = self._position[id(previous)] + 1 if previous is not None and id(previous) in self._position else len(self._order)
        self._order.insert(at, group)
        self._position = {id(g): i for i, g in enumerate(self._order)}

    def _upcoming(self, group: WeightGroup) -> list[WeightGroup]:
        if not self._prefetch or not self._order_closed:
            return []
        start = self._position[id(group)]
        count = min(self._prefetch, len(self._order) - 1)
        return [self._order[(start + k) % len(self._order)] for k in range(1, count + 1)]


def hook_group(module: nn.Module, group: WeightGroup, schedule: StreamSchedule) -> list:
    """Forward hooks that stream `group` around `module`'s forward; returns removable handles.

    The hooks re-point parameters and touch streams: never traced by torch.compile (a compiled
    model runs them eagerly between its graphs).
    """

    @torch.compiler.disable
    def before(m, args):
        schedule.before_forward(group)

    @torch.compiler.disable
    def after(m, args, out):
        schedule.after_forward(group)

    return [module.register_forward_pre_hook(before), module.register_forward_hook(after)]
