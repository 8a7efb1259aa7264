"""The streaming schedule: groups onloaded just before their forward, evicted right after.

Used by the `block_swap` tier (the swapped transformer blocks, in block order) and by the
`sequential` tier (every module that owns tensors, in the order they first ran). While a group
computes, the next `prefetch` groups are already being copied in, so with a side stream the
transfer hides behind compute. At most `prefetch + 1` streamed groups are ever resident.
"""

from __future__ import annotations

from typing import Any, Callable

from torch import nn

from .residency import WeightGroup
from .swapstats import SwapLedger

Observer = Callable[[str, WeightGroup], None]


class StreamSchedule:
    """Onload/evict bookkeeping for one component's streamed groups.

    With `order_known` the groups are given in execution order (blocks run in index order);
    otherwise the order is learned during the component's first forward (`end_of_pass`), and
    prefetch starts once it is known.
    """

    def __init__(
        self,
        groups: list[WeightGroup],
        prefetch: int,
        order_known: bool,
        observer: Observer | None = None,
        ledger: SwapLedger | None = None,
        backend: Any = None,
    ) -> None:
        self.groups = groups
        self._ledger = ledger
        self._stamp = backend.stamp if ledger is not None else (lambda: None)
        self._prefetch = prefetch
        self._order: list[WeightGroup] = list(groups) if order_known else []
        self._position = {id(g): i for i, g in enumerate(self._order)}
        self._order_closed = order_known
        self._observe = observer or (lambda kind, group: None)

    def before_forward(self, group: WeightGroup) -> None:
        self._learn(group)
        if not group.resident:
            self._onload(group, "onload")
        start = self._stamp()
        group.wait()
        if self._ledger is not None:
            self._ledger.waited(group, start, self._stamp())
        for upcoming in self._upcoming(group):
            if not upcoming.resident:
                self._onload(upcoming, "prefetch")

    def after_forward(self, group: WeightGroup) -> None:
        if self._ledger is not None:
            self._ledger.computed(group, self._stamp())
        group.evict()
        self._observe("evict", group)

    def _onload(self, group: WeightGroup, kind: str) -> None:
        token = group.onload()
        if self._ledger is not None:
            self._ledger.copied(group, token)
        self._observe(kind, group)

    def evict_all(self) -> None:
        for group in self.groups:
            if group.resident:
                group.evict()
                self._observe("evict", group)

    def end_of_pass(self) -> None:
        """The component's forward has finished: the learned execution order is complete."""
        self._order_closed = True

    def _learn(self, group: WeightGroup) -> None:
        if id(group) not in self._position:  # also a module that first runs in a later pass
            self._position[id(group)] = len(self._order)
            self._order.append(group)

    def _upcoming(self, group: WeightGroup) -> list[WeightGroup]:
        if not self._prefetch or not self._order_closed:
            return []
        start = self._position[id(group)]
        count = min(self._prefetch, len(self._order) - 1)
        return [self._order[(start + k) % len(self._order)] for k in range(1, count + 1)]


def hook_group(module: nn.Module, group: WeightGroup, schedule: StreamSchedule) -> list:
    """Forward hooks that stream `group` around `module`'s forward; returns removable handles."""
    pre = module.register_forward_pre_hook(lambda m, args: schedule.before_forward(group))
    post = module.register_forward_hook(lambda m, args, out: schedule.after_forward(group))
    return [pre, post]
