"""Test device backends: make placement observable on a CPU-only machine.

`StrictBackend` gives onloaded weights a fresh storage (a copy, standing in for the device copy)
and gives evicted weights a poisoned copy (NaN, or the largest integer for index buffers), so any
computation that touches a weight the schedule did not onload ruins the latents and fails the
comparison. (torch refuses to point a CPU parameter at a `meta` tensor, or we would use that.)
"""

from __future__ import annotations

import numpy
import torch

from vidmem.memory.device import CpuBackend

COPY_ALIGN = 64  # bytes: torch's CPU allocator aligns every new tensor to this


def copy_at_same_alignment(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of `tensor` in fresh memory at the same address modulo COPY_ALIGN.

    The stand-in for a device copy on a CPU. On a GPU every tier computes on device copies; here
    the reference (CpuBackend) computes on the original in place, and MKL's default mode rounds a
    matrix-vector product by its operands' alignment (docs/bit-identity.md), so the stand-in keeps
    the original's place in a 64-byte line, as vidmem's own host copies do (memory/hostpool.py).
    """
    if type(tensor) is not torch.Tensor or not tensor.is_contiguous():
        return tensor.clone()  # subclasses (GGUF, torchao) copy as themselves
    nbytes = tensor.numel() * tensor.element_size()
    line = numpy.empty(nbytes + COPY_ALIGN, dtype=numpy.uint8)
    start = (tensor.data_ptr() - line.ctypes.data) % COPY_ALIGN
    # from_numpy: a storage of exactly nbytes starting there, so byte counts of copies stay exact
    return torch.from_numpy(line[start : start + nbytes]).view(tensor.dtype).view(tensor.shape).copy_(tensor)


class StrictBackend(CpuBackend):
    """Also counts copies, and with `pinning` hands out (unpinned) arenas to exercise HostPool."""

    copies_to_device = True  # a stand-in device: its copies are what a warm store keeps

    def __init__(self, pinning: bool = False) -> None:
        super().__init__()
        self.copies = 0
        self.can_pin = pinning
        self.arenas = 0

    def pin_arena(self, nbytes: int) -> torch.Tensor:
        self.arenas += 1
        return torch.empty(nbytes, dtype=torch.uint8)

    def copy_group(self, hosts, non_blocking, side_stream, timed):
        self.copies += len(hosts)
        return [copy_at_same_alignment(host) for host in hosts], None

    def evicted(self, host: torch.Tensor) -> torch.Tensor:
        if host.is_floating_point():
            return torch.full_like(host, float("nan"))
        if host.dtype == torch.bool:
            return ~host
        return torch.full_like(host, torch.iinfo(host.dtype).max)


class Recorder:
    """An observer for apply_strategy: the event log and the peak of resident streamed groups."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str]] = []
        self.resident: set[str] = set()
        self.peak_streamed = 0

    def __call__(self, kind: str, group) -> None:
        self.events.append((kind, group.name))
        if kind in ("onload", "prefetch"):
            self.resident.add(group.name)
        else:
            self.resident.discard(group.name)
        streamed = [n for n in self.resident if "." in n]  # streamed groups are named component.path
        self.peak_streamed = max(self.peak_streamed, len(streamed))
