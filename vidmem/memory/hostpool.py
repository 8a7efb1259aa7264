"""HostPool: page-locked (pinned) host homes for streamed weights, under a RAM ceiling.

A host-to-device copy is only truly asynchronous from pinned memory. The first time a streamed
tensor is seen, the pool copies it once into pinned memory and makes that copy the tensor's
home (the pageable original is released, so RAM is not doubled). Later runs find it already
pinned and allocate nothing: the pool never grows run over run. Past the ceiling, tensors stay
in pageable memory and still work, only with synchronous copies. Pinning needs CUDA; without
it (`pin=None`) the pool adopts nothing.

The pool belongs to one loaded pipeline (both experts of Wan 2.2 A14B share it) and lives as
long as that pipeline.
"""

from __future__ import annotations

from typing import Callable

import psutil
import torch

from .residency import _Slot

GiB = 1 << 30
# Page-locked memory cannot be swapped out; leave the OS and ComfyUI this much RAM unpinned.
PINNED_HEADROOM_BYTES = 8 * GiB


def default_pinned_cap() -> int:
    """Half of the RAM that is free now, keeping PINNED_HEADROOM_BYTES unpinned."""
    available = psutil.virtual_memory().available
    return max(0, min(available // 2, available - PINNED_HEADROOM_BYTES))


def pinned_cap_bytes(max_pinned_ram_gb: float | None) -> int:
    """The user's ceiling in bytes, or the automatic one when unset."""
    return default_pinned_cap() if max_pinned_ram_gb is None else int(max_pinned_ram_gb * GiB)


def cuda_pin(host: torch.Tensor) -> torch.Tensor:
    pinned = torch.empty_like(host, device="cpu", pin_memory=True)
    pinned.copy_(host)
    return pinned


class HostPool:
    def __init__(self) -> None:
        self.pinned_bytes = 0
        self.allocations = 0  # pinned copies ever made; flat after the first run
        self.over_cap_tensors = 0
        self._pinned_ptrs: set[int] = set()

    def __repr__(self) -> str:
        return f"HostPool({self.pinned_bytes / GiB:.2f} GiB pinned, {self.allocations} allocations)"

    def adopt(self, slot: _Slot, pin: Callable[[torch.Tensor], torch.Tensor] | None, cap_bytes: int) -> _Slot:
        """The slot with a pinned home if possible; the tensor is re-pointed to it for good."""
        host = slot.host
        if pin is None or host.data_ptr() in self._pinned_ptrs:
            return slot
        size = host.numel() * host.element_size()
        if self.pinned_bytes + size > cap_bytes:
            self.over_cap_tensors += 1
            return slot
        pinned = pin(host)
        self.pinned_bytes += size
        self.allocations += 1
        self._pinned_ptrs.add(pinned.data_ptr())
        adopted = _Slot(slot.module, slot.name, slot.is_parameter, pinned)
        adopted.point_to(pinned)
        return adopted

    def stats(self) -> dict:
        return {
            "pinned_bytes": self.pinned_bytes,
            "allocations": self.allocations,
            "over_cap_tensors": self.over_cap_tensors,
        }
