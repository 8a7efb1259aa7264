"""A timeline model of block swap on a GPU: how much copy time the engine's schedule hides.

Everything this module returns is *modelled*, not measured: CI has no GPU. The schedule is not
restated here: the engine's own `StreamSchedule` (memory/blockswap.py) decides when each swapped
block is copied, waited for and evicted, driving stand-in groups and a backend that keeps three
clocks instead of moving memory (copy times from bytes / bandwidth, compute times given per block):

- the compute stream runs the non-block layers (`other_compute_s`), the resident blocks, then the
  swapped blocks, each as soon as the host has queued it and (for a swapped block) its copy has
  landed: the wait is on that block's copy only;
- the copy queue runs copies one at a time in issue order. A non-blocking copy (`overlap=True`:
  from a pinned home, or a pageable block staged through pinned slots) starts as soon as the host
  issues it and the queue is free: the side stream does not wait for compute. A blocking copy
  (`overlap=False`: `non_blocking` off, a tensor subclass, or a driver that refuses to pin even a
  staging slot) holds the host until it lands, so the host queues the next compute late;
- the host issues everything at once, except where the schedule makes it wait: before a new copy
  while more than `EVICTED_IN_FLIGHT` evicted blocks may still be computing (their memory).

Whatever the schedule does (prefetch after a block's forward has been queued, wrap-around into
the next forward, nothing to prefetch with one swapped block), the model does, because it runs it.
Classifier-free guidance is two forwards per step (Wan) or one forward at batch 2 (CogVideoX):
pass `forwards` and per-block compute accordingly.

Not modelled: copies and kernels competing for device memory bandwidth, per-copy launch latency,
and the host's own time to issue calls. Pageable blocks, used past the pinned ceiling, are staged
(memory/hostpool.py): still asynchronous, but each chunk costs a host memcpy too, so the copy runs
at about the slower of host memcpy and PCIe: model it with that bandwidth and `overlap=True`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from .blockswap import StreamSchedule


@dataclass(frozen=True)
class GpuSpec:
    """Transfer and compute rates. Defaults: PCIe 4.0 x16 at ~25 GB/s effective, and an RTX
    4090-class card at ~165 dense bf16 TFLOPS peak, of which real kernels reach
    `achieved_fraction`."""

    pcie_bytes_per_s: float = 25e9
    peak_flops: float = 165e12
    achieved_fraction: float = 0.5

    def __post_init__(self) -> None:
        if self.pcie_bytes_per_s <= 0 or self.peak_flops <= 0:
            raise ValueError("pcie_bytes_per_s and peak_flops must be positive (bytes/s and FLOP/s).")
        if not 0 < self.achieved_fraction <= 1:
            raise ValueError(f"achieved_fraction={self.achieved_fraction} must be in (0, 1]; e.g. 0.5.")

    def copy_s(self, nbytes: float) -> float:
        return nbytes / self.pcie_bytes_per_s

    def compute_s(self, flops: float) -> float:
        return flops / (self.peak_flops * self.achieved_fraction)


@dataclass(frozen=True)
class BlockCost:
    """One transformer block: bytes copied host-to-device when it is swapped, compute seconds per forward."""

    copy_bytes: float
    compute_s: float


@dataclass(frozen=True)
class Timeline:
    """Result of `simulate`. `resident_s` is the same forwards with every block resident."""

    total_s: float
    resident_s: float
    copy_s: float  # time the copy queue was busy
    stall_s: float  # time the compute stream stood idle: waiting for copies, or for a blocked host
    copies: int
    peak_swapped_on_device: int  # swapped blocks on the device at once (evicted ones still computing not counted)

    @property
    def overhead(self) -> float:
        """Extra time relative to all-resident: 0.05 means 5% slower."""
        return self.total_s / self.resident_s - 1.0 if self.resident_s > 0 else 0.0


def uniform_blocks(count: int, copy_bytes: float, compute_s: float) -> list[BlockCost]:
    """`count` identical blocks, as in every CogVideoX and Wan transformer."""
    return [BlockCost(copy_bytes, compute_s) for _ in range(count)]


def simulate(
    blocks: Sequence[BlockCost],
    swapped: int,
    prefetch: int,
    bandwidth: float,
    *,
    overlap: bool = True,
    forwards: int = 1,
    other_compute_s: float = 0.0,
) -> Timeline:
    """Replay `forwards` forwards of a model whose last `swapped` blocks stream in.

    Args:
        blocks: every block in execution order; the first len(blocks) - swapped stay resident.
        swapped: N, how many of the last blocks stream (0 = all resident).
        prefetch: how many swapped blocks ahead are copied while one computes.
        bandwidth: host-to-device bytes per second.
        overlap: non-blocking copies, from pinned homes or staged (True), or blocking ones that hold the host (False).
        forwards: transformer forwards in the call (steps x forwards per step).
        other_compute_s: compute per forward outside the blocks (embeddings, head).

    Example:
        simulate(uniform_blocks(40, 0.7e9, 0.55), swapped=20, prefetch=1, bandwidth=25e9, forwards=100).overhead
    """
    _check(blocks, swapped, prefetch, bandwidth, forwards, other_compute_s)
    clocks = _Clocks(bandwidth, blocking=not overlap)
    groups = [_Block(f"blocks.{len(blocks) - swapped + i}", block, clocks) for i, block in enumerate(blocks[len(blocks) - swapped :])]
    peak = [0]

    def observe(kind: str, group) -> None:
        peak[0] = max(peak[0], sum(g.on_device for g in groups))

    schedule = StreamSchedule(groups, prefetch, True, clocks, observe)
    for _ in range(forwards):
        clocks.run(other_compute_s)
        for block in blocks[: len(blocks) - swapped]:
            clocks.run(block.compute_s)
        for group in groups:
            schedule.before_forward(group)
            clocks.run(group.cost.compute_s)
            schedule.after_forward(group)
    per_forward = other_compute_s + sum(b.compute_s for b in blocks)
    total = clocks.compute_end
    return Timeline(total, per_forward * forwards, clocks.copy_busy, total - per_forward * forwards, clocks.copies, peak[0])


class _Clocks:
    """The backend StreamSchedule drives here: host, compute stream and copy queue as clocks."""

    def __init__(self, bandwidth: float, blocking: bool) -> None:
        self.bandwidth, self.blocking = bandwidth, blocking
        self.host = 0.0  # when the host issues its next call
        self.compute_end = 0.0  # when the compute stream has finished what is queued
        self.copy_free = 0.0  # when the copy queue is next idle
        self.ready = 0.0  # the copy the next compute waits for lands then
        self.copy_busy = 0.0
        self.copies = 0

    def copy(self, nbytes: float) -> float:
        """Issue one copy; returns when it lands (the copy token)."""
        start = max(self.copy_free, self.host)
        self.copy_free = start + nbytes / self.bandwidth
        self.copy_busy += nbytes / self.bandwidth
        self.copies += 1
        if self.blocking:
            self.host = self.copy_free  # a blocking copy returns to the host when it has landed
        return self.copy_free

    def run(self, seconds: float) -> None:
        """Queue `seconds` of compute: it starts when queued, the stream is free and its copy landed."""
        self.compute_end = max(self.compute_end, self.host, self.ready) + seconds

    # --- the Backend verbs StreamSchedule calls -------------------------------------------

    def wait(self, landed: float) -> None:
        self.ready = max(self.ready, landed)

    def compute_done(self) -> float:
        return self.compute_end

    def host_wait(self, marker: float) -> None:
        self.host = max(self.host, marker)

    def stamp(self) -> None:
        return None


class _Block:
    """Stands in for a streamed WeightGroup: the same verbs, a copy on the clocks for tensors."""

    def __init__(self, name: str, cost: BlockCost, clocks: _Clocks) -> None:
        self.name, self.cost, self.clocks = name, cost, clocks
        self.nbytes = cost.copy_bytes
        self.on_device = False
        self._landed: float | None = None

    def onload(self, timed: bool = False) -> float | None:
        if self.on_device:
            return None
        self._landed = self.clocks.copy(self.cost.copy_bytes)
        self.on_device = True
        return self._landed

    def wait(self) -> None:
        if self._landed is not None:
            self.clocks.wait(self._landed)
            self._landed = None

    def evict(self) -> None:
        self.on_device = False
        self._landed = None

    def read_ahead(self) -> int:
        return 0  # the model's copies read no file


def _check(blocks, swapped, prefetch, bandwidth, forwards, other_compute_s) -> None:
    if not 0 <= swapped <= len(blocks):
        raise ValueError(f"swapped={swapped} must be between 0 and the block count {len(blocks)}.")
    if prefetch < 0:
        raise ValueError(f"prefetch={prefetch} must be 0 or more (0 copies each block when it is needed).")
    if bandwidth <= 0:
        raise ValueError(f"bandwidth={bandwidth} must be positive bytes per second (PCIe 4.0 x16: ~25e9).")
    if forwards < 1:
        raise ValueError(f"forwards={forwards} must be at least 1 (steps x forwards per step).")
    if other_compute_s < 0 or any(b.compute_s < 0 or b.copy_bytes < 0 for b in blocks):
        raise ValueError("compute seconds and copy bytes must be 0 or more.")
