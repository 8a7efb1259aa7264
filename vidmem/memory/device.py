"""The small device interface the residency engine speaks: copy in, record, wait, evicted form.

One schedule drives every backend, so the logic that decides *when* a block moves is the same
code on a user's GPU and on this CPU-only CI. `CudaBackend` adds what only a GPU has: a side
stream for host-to-device copies and events so compute waits only for the block it needs.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Protocol

import torch

from .hostpool import cuda_pin


def resolve_compute_device(requested: str | torch.device | None = None) -> torch.device:
    """`cuda` when present, else `cpu`; called at run time, never at import."""
    if requested is not None:
        return torch.device(requested)
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


class Backend(Protocol):
    """What the schedule needs from a device. Tests supply their own to observe placement."""

    device: torch.device
    pin: Callable[[torch.Tensor], torch.Tensor] | None  # makes a pinned host copy; None: no pinning

    def copy_group(self, hosts: list[torch.Tensor], non_blocking: bool) -> tuple[list[torch.Tensor], Any]:
        """Start copying `hosts` to the device; returns the device tensors and a completion token."""

    def evicted(self, host: torch.Tensor) -> torch.Tensor:
        """What a tensor points at while evicted: its persistent host copy."""

    def wait(self, token: Any, tensors: list[torch.Tensor]) -> None:
        """Make compute wait for the copy behind `token` (and own `tensors` from now on)."""

    def stamp(self) -> Any:
        """A point on the compute timeline, for telemetry."""

    def elapsed(self, start: Any, end: Any) -> float:
        """Seconds between two stamps (or the two ends of a copy token); may synchronise."""


class CpuBackend:
    """Compute on the CPU: weights already live there, so onloading is the identity.

    The schedule still runs every hook, so ordering and residency bookkeeping are exercised.
    """

    pin = None

    def __init__(self) -> None:
        self.device = torch.device("cpu")

    def copy_group(self, hosts: list[torch.Tensor], non_blocking: bool) -> tuple[list[torch.Tensor], Any]:
        return hosts, None

    def evicted(self, host: torch.Tensor) -> torch.Tensor:
        return host

    def wait(self, token: Any, tensors: list[torch.Tensor]) -> None:
        return None

    def stamp(self) -> float:
        return time.perf_counter()

    def elapsed(self, start: Any, end: Any) -> float:
        return 0.0 if start is None or end is None else end - start


class CudaBackend:
    """Host-to-device copies on a side stream; compute waits on per-group events.

    Device tensors produced on the side stream are marked with `record_stream` when compute
    starts using them, so the caching allocator cannot hand their memory to the next prefetch
    while a kernel on the compute stream still reads it. The side stream never waits for
    compute: host copies are read-only, so a prefetch may start at once and overlap fully.
    """

    pin = staticmethod(cuda_pin)

    def __init__(self, device: torch.device, use_stream: bool = True) -> None:
        self.device = device
        self._stream = torch.cuda.Stream(device=device) if use_stream else None

    def copy_group(self, hosts: list[torch.Tensor], non_blocking: bool) -> tuple[list[torch.Tensor], Any]:
        stream = self._stream or torch.cuda.current_stream(self.device)
        start, end = _timing_event(), _timing_event()
        with torch.cuda.stream(stream):
            start.record(stream)
            tensors = [host.to(self.device, non_blocking=non_blocking) for host in hosts]
            end.record(stream)
        return tensors, (start, end)

    def evicted(self, host: torch.Tensor) -> torch.Tensor:
        return host

    def wait(self, token: Any, tensors: list[torch.Tensor]) -> None:
        if token is None or self._stream is None:
            return
        compute = torch.cuda.current_stream(self.device)
        compute.wait_event(token[1])
        for tensor in tensors:
            tensor.record_stream(compute)

    def stamp(self) -> Any:
        event = _timing_event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def elapsed(self, start: Any, end: Any) -> float:
        if start is None or end is None:
            return 0.0
        end.synchronize()
        return start.elapsed_time(end) / 1000.0


def _timing_event() -> Any:
    return torch.cuda.Event(enable_timing=True)


def backend_for(device: torch.device, use_stream: bool = True) -> Backend:
    if device.type == "cuda":
        return CudaBackend(device, use_stream=use_stream)
    if device.type == "cpu":
        return CpuBackend()
    raise ValueError(f"device={device} is not supported; use 'cuda' or 'cpu'.")
