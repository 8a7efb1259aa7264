"""free_memory(): return cached memory to the system, with a before/after receipt."""

from __future__ import annotations

import gc
from dataclasses import dataclass

import torch

from .warm import release_everywhere

from .telemetry import MemorySnapshot, snapshot


# What libraries below torch say when an allocation of theirs fails: cuBLAS creating a handle or its
# workspace, cuDNN and cuFFT their workspaces. torch raises these as plain RuntimeErrors, not
# OutOfMemoryError, and their text need not say "out of memory".
ALLOCATION_FAILURES = ("out of memory", "cublas_status_alloc_failed", "cudnn_status_alloc_failed",
                       "cufft_alloc_failed", "hipblas_status_alloc_failed")


def is_out_of_memory(error: BaseException) -> bool:
    """torch's OutOfMemoryError (CUDA, and the generic one of other accelerators), or a RuntimeError
    whose text names a failed allocation (ALLOCATION_FAILURES): the one rule every ladder uses."""
    oom_types = tuple(t for t in (getattr(torch, "OutOfMemoryError", None), getattr(torch.cuda, "OutOfMemoryError", None)) if t)
    if isinstance(error, oom_types):
        return True
    text = str(error).lower()
    return isinstance(error, RuntimeError) and any(pattern in text for pattern in ALLOCATION_FAILURES)


@dataclass(frozen=True)
class FreeReceipt:
    before: MemorySnapshot
    after: MemorySnapshot
    collected_objects: int
    warm_released_bytes: int = 0  # weights kept on the device between runs (memory/warm.py), dropped

    def as_dict(self) -> dict:
        return {"before": self.before.as_dict(), "after": self.after.as_dict(), "collected_objects": self.collected_objects,
                "warm_released_bytes": self.warm_released_bytes}


def release_cached_pinned() -> bool:
    """Unlock the pinned host blocks torch's caching host allocator keeps after their tensors are
    gone (it holds them for reuse until told to let go, so dropping the last reference unlocks
    nothing). False where this torch has no such call: it is private, probed, and may vanish."""
    release = getattr(torch._C, "_host_emptyCache", None)
    if release is None:
        return False
    release()
    return True


class _DroppedPinned:
    """Whether an owner of pinned host memory (a host pool, a backend's staging) has been collected since
    torch's pinned cache was last emptied: process-wide, as that cache is."""

    pending = False


def note_pinned_dropped() -> None:
    """A finalizer for an owner of pinned memory: its blocks go back to torch's cache, still locked."""
    _DroppedPinned.pending = True


def release_dropped_pinned() -> bool:
    """Unlock what collected owners left in torch's pinned cache, once after they went (True where it did).
    Called after a placement took its own pinned memory, so a new pipeline reuses the cached blocks it
    can, and what it does not need stops being locked (ComfyUI never empties torch's host cache)."""
    if not _DroppedPinned.pending:
        return False
    _DroppedPinned.pending = False
    return release_cached_pinned()


def free_memory(device: torch.device, release_kept: bool = True) -> FreeReceipt:
    """Drop the weights every pipeline keeps on the device between runs, gc.collect(), then for a
    CUDA device empty_cache() and ipc_collect(). `release_kept` False: the kept weights stay (a
    stage that only returns what it used itself, as Prepare Training Data after its encoders).

    The kept weights go first: this runs after an out-of-memory error (the sampler's and the
    decode's ladders) and on Free VRAM, and a copy kept for a later call must never cost this one
    its room. CUDA is only touched when the compute device is CUDA, so a `--cpu` host never gets a CUDA
    context. Pinned host blocks cached by torch (from pipelines already dropped) are released
    too, where this torch exposes that.
    """
    before = snapshot(device)
    released = release_everywhere() if release_kept else 0
    collected = gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.ipc_collect()
        release_cached_pinned()
    return FreeReceipt(before, snapshot(device), collected, released)
