"""Measured memory, for receipts: CUDA allocator figures where CUDA exists, process RSS always.

`StageMeter` times one stage and records its peak: on CUDA from the allocator's peak counter,
on the CPU by sampling RSS on a background thread (the kernel's ru_maxrss is per process
lifetime, so it cannot give a stage's own peak).
"""

from __future__ import annotations

import threading
import time
from dataclasses import asdict, dataclass
from typing import Callable

import psutil
import torch

from .plan.costs import CUDA_CONTEXT_BYTES


@dataclass(frozen=True)
class MemorySnapshot:
    rss_bytes: int
    allocated_bytes: int | None = None  # CUDA only
    reserved_bytes: int | None = None
    device_free_bytes: int | None = None

    def as_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v is not None}


def snapshot(device: torch.device | None = None) -> MemorySnapshot:
    rss = psutil.Process().memory_info().rss
    if device is None or device.type != "cuda":
        return MemorySnapshot(rss)
    free, _total = torch.cuda.mem_get_info(device)
    return MemorySnapshot(rss, torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device), free)


def free_device_bytes(device: torch.device) -> int | None:
    """Bytes a new allocation on `device` can use: the driver's free memory plus what the caching
    allocator holds unused. None off CUDA (host RAM is not budgeted here)."""
    if device.type != "cuda":
        return None
    now = snapshot(device)
    return now.device_free_bytes + now.reserved_bytes - now.allocated_bytes


def budgeted_free_bytes(budget_bytes: int) -> Callable[[torch.device], int | None]:
    """`free_device_bytes`, bounded by the user's VRAM budget (the Memory Strategy's vram_budget_gb).

    The planner fits a run's whole device footprint, CUDA context included, in the budget; at run time
    the free figure is what decides how many streamed blocks stay on the device, how many activation
    chunks auto runs and which rung the out-of-memory ladder takes. Free memory alone would let a run
    planned for 8 GiB on a 24 GiB card keep ~16 GiB of blocks beyond its plan, memory the user asked
    to leave to other applications. So with a budget a device has at most what the budget leaves
    beside the CUDA context and what torch has allocated (the planner's own CUDA_CONTEXT_BYTES), never
    below 0. `budget_bytes` 0: no budget of the user's, the plain free figure.
    """
    if not budget_bytes:
        return free_device_bytes

    def within_budget(device: torch.device) -> int | None:
        free = free_device_bytes(device)
        if free is None:
            return None
        left = budget_bytes - CUDA_CONTEXT_BYTES - torch.cuda.memory_allocated(device)
        return max(0, min(free, left))

    return within_budget


def device_room_for_plan(free_bytes: int | None) -> int | None:
    """A run-time free figure (`free_device_bytes`, `budgeted_free_bytes`) as a budget for a planned footprint.

    Those figures are bytes left for new allocations, the CUDA context already made; a planned phase's
    device_bytes include CUDA_CONTEXT_BYTES. Compared as they are, the context counts twice: after an
    out-of-memory error the ladder judged a strategy within 512 MiB of the budget not to fit, and
    activation_chunks=auto ran more slices than the plan. So the context is added back, here only.
    None stays None (no figure: off CUDA)."""
    return None if free_bytes is None else free_bytes + CUDA_CONTEXT_BYTES


def allocator_backend() -> str:
    """The CUDA caching allocator backend this process runs: "native" (PyTorch's default) or
    "cudaMallocAsync" (`PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync`, which ComfyUI sets on
    recent NVIDIA drivers). "native" without CUDA: there is nothing else to model."""
    if not torch.cuda.is_available():
        return "native"
    return torch.cuda.get_allocator_backend()


@dataclass
class StageReceipt:
    stage: str
    seconds: float = 0.0
    peak_rss_bytes: int = 0
    peak_allocated_bytes: int | None = None

    def as_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v is not None}


class StageMeter:
    """Context manager: wall time and peak memory of one stage."""

    def __init__(self, stage: str, device: torch.device, interval_s: float = 0.02) -> None:
        self.receipt = StageReceipt(stage)
        self._device = device
        self._interval = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample_rss, daemon=True)

    def __enter__(self) -> StageReceipt:
        if self._device.type == "cuda":
            torch.cuda.synchronize(self._device)  # time the GPU's work, not only the queueing
            torch.cuda.reset_peak_memory_stats(self._device)
        self._start = time.perf_counter()
        self._thread.start()
        return self.receipt

    def __exit__(self, *exc: object) -> None:
        if self._device.type == "cuda":
            torch.cuda.synchronize(self._device)
        self.receipt.seconds = time.perf_counter() - self._start
        self._stop.set()
        self._thread.join()
        if self._device.type == "cuda":
            self.receipt.peak_allocated_bytes = torch.cuda.max_memory_allocated(self._device)

    def _sample_rss(self) -> None:
        process = psutil.Process()
        while True:
            self.receipt.peak_rss_bytes = max(self.receipt.peak_rss_bytes, process.memory_info().rss)
            if self._stop.wait(self._interval):
                return


def default_budgets(device: torch.device) -> tuple[int, int]:
    """(VRAM, RAM) budgets when the user gives none: the GPU's total memory and the machine's
    RAM. On a CPU-only machine compute runs in RAM, so RAM is the "VRAM" budget too; the planner
    then fits the compute and the process together in that one RAM (PlanOptions.compute_budget)."""
    ram = psutil.virtual_memory().total
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory, ram
    return ram, ram
