"""A timeline model of block swap on a GPU: how much copy time the engine's schedule hides.

Everything this module returns is *modelled*, not measured: CI has no GPU. It replays the order in
which `StreamSchedule` (with `CudaBackend`) issues copies and compute, on two queues, with copy
times from bytes / PCIe bandwidth and compute times given per block.

How a forward runs, here as in the engine:
- The compute stream runs the non-block layers (head of the previous forward and embeddings of
  this one: `other_compute_s`), then blocks 0..M-1 in index order. The last N blocks are swapped.
- At a swapped block's pre-forward hook the engine issues that block's copy if it is not on the
  device yet, makes compute wait for it, then issues copies for the next `prefetch` swapped blocks.
  Past the last swapped block it wraps around to the first swapped blocks of the *next* forward,
  whose copies then hide behind the head, the embeddings and the resident blocks. With one swapped
  block there is nothing else to prefetch, so its copy is exposed in every forward.
- Copies run one at a time in issue order. With `overlap` they run on a side stream, which waits
  for the compute stream to reach the hook first: a copy issued at block i starts no earlier than
  block i's compute. Without `overlap` they run on the compute stream, in line with compute.
- After its forward a swapped block is evicted by re-pointing its parameters: no copy, no time.
- Classifier-free guidance is two forwards per step (Wan) or one forward at batch 2 (CogVideoX):
  pass `forwards` and per-block compute accordingly.

Not modelled: copies and kernels competing for device memory bandwidth, per-copy launch latency,
and the host falling behind the GPU (the model assumes pinned host copies and non-blocking
copies, so the host enqueues ahead). Pageable memory, used past the pinned ceiling, copies at
roughly half the bandwidth: model it by passing that bandwidth.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


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
    stall_s: float  # time compute waited for copies (or ran them, without overlap)
    copies: int
    peak_swapped_on_device: int  # swapped blocks on the device (or in flight) at once

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
        overlap: copies on a side stream (True) or on the compute stream (False).
        forwards: transformer forwards in the call (steps x forwards per step).
        other_compute_s: compute per forward outside the blocks (embeddings, head).

    Example:
        simulate(uniform_blocks(40, 0.7e9, 0.55), swapped=20, prefetch=1, bandwidth=25e9, forwards=100).overhead
    """
    _check(blocks, swapped, prefetch, bandwidth, forwards, other_compute_s)
    run = _Run(blocks[len(blocks) - swapped :], prefetch, bandwidth, overlap)
    resident = blocks[: len(blocks) - swapped]
    for _ in range(forwards):
        run.compute(other_compute_s)
        for block in resident:
            run.compute(block.compute_s)
        for index in range(swapped):
            run.swapped_block(index)
    per_forward = other_compute_s + sum(b.compute_s for b in blocks)
    return Timeline(run.clock, per_forward * forwards, run.copy_busy, run.stall, run.copies, run.peak)


class _Run:
    """Two clocks (compute stream, copy queue) and which swapped blocks are on the device."""

    def __init__(self, swapped: Sequence[BlockCost], prefetch: int, bandwidth: float, overlap: bool) -> None:
        self.swapped, self.bandwidth, self.overlap = swapped, bandwidth, overlap
        self.lookahead = min(prefetch, len(swapped) - 1)  # StreamSchedule never prefetches itself
        self.clock = 0.0  # where the compute stream has got to
        self.copy_free = 0.0  # when the copy queue is next idle
        self.landed: dict[int, float] = {}  # swapped index -> when its copy lands
        self.copy_busy = self.stall = 0.0
        self.copies = self.peak = 0

    def compute(self, seconds: float) -> None:
        self.clock += seconds

    def swapped_block(self, index: int) -> None:
        """One swapped block's pre-forward hook, forward and eviction."""
        if index not in self.landed:
            self._issue(index)
        start = max(self.clock, self.landed[index])
        self.stall += start - self.clock
        self.clock = start
        for step in range(1, self.lookahead + 1):
            upcoming = (index + step) % len(self.swapped)
            if upcoming not in self.landed:
                self._issue(upcoming)
        self.peak = max(self.peak, len(self.landed))
        self.compute(self.swapped[index].compute_s)
        del self.landed[index]

    def _issue(self, index: int) -> None:
        seconds = self.swapped[index].copy_bytes / self.bandwidth
        self.copies += 1
        self.copy_busy += seconds
        if self.overlap:  # side stream: after the copies before it, and after compute reached the hook
            self.copy_free = max(self.copy_free, self.clock) + seconds
            self.landed[index] = self.copy_free
        else:  # compute stream: the copy runs now, in line with compute
            self.clock += seconds
            self.stall += seconds
            self.landed[index] = self.clock


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
