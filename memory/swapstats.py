"""SwapLedger: what streaming cost, per block and per call.

Stamps are taken on the backend's timelines (CUDA events on the compute and copy streams, or
`perf_counter` on the CPU) and only turned into seconds in `summary()`, so the hot loop never
synchronises the GPU. "Waited" is the time compute stood still for a copy: the real price of
swapping. Bytes moved count every host-to-device copy, and by route (memory/hostpool.py
`upload_route`): straight from a pinned home, staged through the pinned ring, or synchronously from
pageable memory, as the CUDA backend's copy tokens report them. Backends whose tokens carry no
routes report none here (the CPU copies nothing; MPS and XPU copy synchronously, which the warm
receipt counts as pageable).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .warm import UploadRoutes

ROUTE_KEYS = ("pinned_bytes", "staged_bytes", "pageable_bytes")


@dataclass
class _Block:
    nbytes: int
    copies: list = field(default_factory=list)  # copy tokens
    waits: list = field(default_factory=list)  # (start, end) stamps
    computes: list = field(default_factory=list)
    routes: UploadRoutes = field(default_factory=UploadRoutes)


class SwapLedger:
    def __init__(self, backend: Any) -> None:
        self._backend = backend
        self._blocks: dict[str, _Block] = {}
        self._open: dict[str, Any] = {}

    def _block(self, group) -> _Block:
        return self._blocks.setdefault(group.name, _Block(group.nbytes))

    def copied(self, group, token: Any) -> None:
        block = self._block(group)
        block.copies.append(token)
        routes = getattr(token, "routes", None)
        if routes is not None:
            block.routes += routes

    def waited(self, group, start: Any, end: Any) -> None:
        self._block(group).waits.append((start, end))
        self._open[group.name] = end

    def computed(self, group, end: Any) -> None:
        start = self._open.pop(group.name, None)
        if start is not None:
            self._block(group).computes.append((start, end))

    def summary(self) -> dict:
        elapsed = self._backend.elapsed
        blocks = {}
        for name, block in self._blocks.items():
            blocks[name] = {
                "bytes_moved": block.nbytes * len(block.copies),
                "copies": len(block.copies),
                "copy_s": sum(elapsed(None, token) for token in block.copies if token is not None),
                "wait_s": sum(elapsed(a, b) for a, b in block.waits),
                "compute_s": sum(elapsed(a, b) for a, b in block.computes),
                **dict(zip(ROUTE_KEYS, (block.routes.pinned, block.routes.staged, block.routes.pageable))),
            }
        keys = ("bytes_moved", "copies", "copy_s", "wait_s", "compute_s", *ROUTE_KEYS)
        totals = {k: sum(b[k] for b in blocks.values()) for k in keys}
        return {"blocks": blocks, "totals": totals}
