"""HostPool: page-locked (pinned) host homes for streamed weights, under a RAM ceiling.

A host-to-device copy is only truly asynchronous from pinned memory. The first time a streamed
tensor is seen, the pool copies it once into a pinned arena and makes that copy the tensor's
home (the pageable original is released, so RAM is not doubled). Later runs find it already
pinned and allocate nothing: the pool never grows run over run. Past the ceiling, or if the
driver refuses to pin, tensors stay pageable and still work, only with synchronous copies.

Arenas are ARENA_BYTES each, a power of two, because torch's pinned allocator rounds every
request up to one: pinning each 670 MiB Wan 14B block separately would lock 1 GiB apiece. The
ceiling counts arena bytes, i.e. what is really locked. The pool belongs to one loaded pipeline
(both experts of Wan 2.2 A14B share it) and lives as long as that pipeline.
"""

from __future__ import annotations

import psutil
import torch

from .residency import Slot

GiB = 1 << 30
ARENA_BYTES = 1 * GiB
ALIGN = 512  # bytes; keeps every view aligned for any dtype and for fast DMA
# Page-locked memory cannot be swapped out; leave the OS and ComfyUI this much RAM unpinned.
PINNED_HEADROOM_BYTES = 8 * GiB


def default_pinned_cap() -> int:
    """Half of the RAM that is free now, keeping PINNED_HEADROOM_BYTES unpinned."""
    available = psutil.virtual_memory().available
    return max(0, min(available // 2, available - PINNED_HEADROOM_BYTES))


def pinned_cap_bytes(max_pinned_ram_gb: float | None) -> int:
    """The user's ceiling in bytes, or the automatic one when unset."""
    return default_pinned_cap() if max_pinned_ram_gb is None else int(max_pinned_ram_gb * GiB)


class HostPool:
    def __init__(self, arena_bytes: int = ARENA_BYTES) -> None:
        self.arena_bytes = arena_bytes
        self._arenas: list[torch.Tensor] = []
        self._used = 0  # bytes used in the newest arena
        self.allocations = 0  # tensors ever copied into the pool; flat after the first run
        self.fallbacks = 0  # tensors left pageable (over the ceiling, or pinning refused)

    def __repr__(self) -> str:
        return f"HostPool({self.pinned_bytes / GiB:.2f} GiB pinned in {len(self._arenas)} arenas)"

    @property
    def pinned_bytes(self) -> int:
        return sum(a.numel() for a in self._arenas)

    def adopt(self, tensors: list[list[Slot]], backend, cap_bytes: int) -> list[list[Slot]]:
        """The same tensors with pinned homes where possible; each is re-pointed to it for good."""
        if not backend.can_pin:
            return tensors
        return [self._adopt_one(owners, backend, cap_bytes) for owners in tensors]

    def stats(self) -> dict:
        return {"pinned_bytes": self.pinned_bytes, "arenas": len(self._arenas),
                "allocations": self.allocations, "fallbacks": self.fallbacks}

    def _adopt_one(self, owners: list[Slot], backend, cap_bytes: int) -> list[Slot]:
        host = owners[0].host
        if self._holds(host):
            return owners
        home = self._allocate(host, backend, cap_bytes)
        if home is None:
            self.fallbacks += 1
            return owners
        home.copy_(host)
        self.allocations += 1
        adopted = [Slot(s.module, s.name, s.is_parameter, home) for s in owners]
        for slot in adopted:
            slot.point_to(home)
        return adopted

    def _allocate(self, host: torch.Tensor, backend, cap_bytes: int) -> torch.Tensor | None:
        size = host.numel() * host.element_size()
        if size > self.arena_bytes:
            return None
        if not self._arenas or self._used + size > self.arena_bytes:
            if self.pinned_bytes + self.arena_bytes > cap_bytes:
                return None
            try:
                arena = backend.pin_arena(self.arena_bytes)
            except RuntimeError:  # the driver refused to lock more memory
                return None
            self._arenas.append(arena)
            self._used = 0
        start = self._used
        self._used = -(-(start + size) // ALIGN) * ALIGN
        return self._arenas[-1][start : start + size].view(host.dtype).view(host.shape)

    def _holds(self, tensor: torch.Tensor) -> bool:
        pointer = tensor.data_ptr()
        return any(a.data_ptr() <= pointer < a.data_ptr() + a.numel() for a in self._arenas)
