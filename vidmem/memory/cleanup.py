"""free_memory(): return cached memory to the system, with a before/after receipt."""

from __future__ import annotations

import gc
from dataclasses import dataclass

import torch

from .telemetry import MemorySnapshot, snapshot


@dataclass(frozen=True)
class FreeReceipt:
    before: MemorySnapshot
    after: MemorySnapshot
    collected_objects: int

    def as_dict(self) -> dict:
        return {"before": self.before.as_dict(), "after": self.after.as_dict(), "collected_objects": self.collected_objects}


def free_memory(device: torch.device | None = None) -> FreeReceipt:
    """gc.collect(), then on CUDA empty_cache() and ipc_collect(); only what exists is called."""
    before = snapshot(device)
    collected = gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.ipc_collect()
    return FreeReceipt(before, snapshot(device), collected)
