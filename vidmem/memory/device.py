"""The small device interface the residency engine speaks: copy in, record, wait, evicted form.

One schedule drives every backend, so the logic that decides *when* a block moves is the same
code on a user's GPU and on this CPU-only CI. `CudaBackend` adds what only a GPU has: a side
stream for host-to-device copies and events so compute waits only for the block it needs.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch


def resolve_compute_device(requested: str | torch.device | None = None) -> torch.device:
    """`cuda` when present, else `cpu`; called at run time, never at import."""
    if requested is not None:
        return torch.device(requested)
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


class Backend(Protocol):
    """What the schedule needs from a device. Tests supply their own to observe placement."""

    device: torch.device

    def copy_in(self, host: torch.Tensor, non_blocking: bool) -> torch.Tensor: ...

    def evicted(self, host: torch.Tensor) -> torch.Tensor: ...

    def record(self) -> Any: ...

    def wait(self, token: Any, tensors: list[torch.Tensor]) -> None: ...


class CpuBackend:
    """Compute on the CPU: weights already live there, so onloading is the identity.

    The schedule still runs every hook, so ordering and residency bookkeeping are exercised.
    """

    def __init__(self) -> None:
        self.device = torch.device("cpu")

    def copy_in(self, host: torch.Tensor, non_blocking: bool) -> torch.Tensor:
        return host

    def evicted(self, host: torch.Tensor) -> torch.Tensor:
        """What a parameter points at while evicted: its persistent host copy (no copy made)."""
        return host

    def record(self) -> Any:
        return None

    def wait(self, token: Any, tensors: list[torch.Tensor]) -> None:
        return None


class CudaBackend:
    """Host-to-device copies on a side stream; compute waits on per-group events.

    Device tensors produced on the side stream are marked with `record_stream` when compute
    starts using them, so the caching allocator cannot hand their memory to the next prefetch
    while a kernel on the compute stream still reads it.
    """

    def __init__(self, device: torch.device, use_stream: bool = True) -> None:
        self.device = device
        self._stream = torch.cuda.Stream(device=device) if use_stream else None

    def copy_in(self, host: torch.Tensor, non_blocking: bool) -> torch.Tensor:
        if self._stream is None:
            return host.to(self.device, non_blocking=non_blocking)
        # The copy must not start before compute has finished writing anything it depends on.
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            return host.to(self.device, non_blocking=non_blocking)

    def evicted(self, host: torch.Tensor) -> torch.Tensor:
        return host

    def record(self) -> Any:
        if self._stream is None:
            return None
        event = torch.cuda.Event()
        event.record(self._stream)
        return event

    def wait(self, token: Any, tensors: list[torch.Tensor]) -> None:
        if token is None:
            return
        compute = torch.cuda.current_stream(self.device)
        compute.wait_event(token)
        for tensor in tensors:
            tensor.record_stream(compute)


def backend_for(device: torch.device, use_stream: bool = True) -> Backend:
    if device.type == "cuda":
        return CudaBackend(device, use_stream=use_stream)
    if device.type == "cpu":
        return CpuBackend()
    raise ValueError(f"device={device} is not supported; use 'cuda' or 'cpu'.")
