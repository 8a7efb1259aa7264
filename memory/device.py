"""The small device interface the residency engine speaks: copy in, wait, throttle, time.

One schedule drives every backend, so the logic that decides *when* a block moves is the same
code on a user's GPU and on this CPU-only CI. `CudaBackend` adds what only a GPU has: a side
stream for streamed copies, events so compute waits only for the block it needs, pinned host
arenas, and a host-side throttle that stops the CPU from queueing copies far ahead of the GPU.
"""

from __future__ import annotations

import logging
import time
import weakref
from dataclasses import dataclass
from typing import Any, Protocol

import torch

log = logging.getLogger("vidmem")


def resolve_compute_device(requested: str | torch.device | None = None) -> torch.device:
    """`cuda` when present, else `cpu`; called at run time, never at import."""
    if requested is not None:
        device = torch.device(requested)
    else:
        device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda" and device.index is None:  # compare equal to tensor.device
        device = torch.device("cuda", torch.cuda.current_device())
    return device


class Backend(Protocol):
    """What the schedule needs from a device. Tests supply their own to observe placement."""

    device: torch.device
    can_pin: bool
    copies_to_device: bool  # False: "onloading" is the identity (the CPU); nothing worth keeping warm

    def pin_arena(self, nbytes: int) -> torch.Tensor:
        """A page-locked uint8 host buffer of `nbytes` (only called when `can_pin`)."""

    def copy_group(self, hosts: list[torch.Tensor], non_blocking: bool, side_stream: bool, timed: bool) -> tuple[list[torch.Tensor], Any]:
        """Start copying `hosts` to the device; returns the device tensors and a copy token."""

    def evicted(self, host: torch.Tensor) -> torch.Tensor:
        """What a tensor points at while evicted: its persistent host copy."""

    def wait(self, token: Any, tensors: list[torch.Tensor]) -> None:
        """Make compute wait for the copy behind `token`; compute owns `tensors` from now on."""

    def compute_done(self) -> Any:
        """A marker that completes when the compute queued so far has finished."""

    def host_wait(self, marker: Any) -> None:
        """Block the CPU until `marker` has completed."""

    def stamp(self) -> Any:
        """A point on the compute timeline, for telemetry."""

    def elapsed(self, start: Any, end: Any) -> float:
        """Seconds between two stamps, or a copy's duration as elapsed(None, token); may synchronise."""


class CpuBackend:
    """Compute on the CPU: weights already live there, so onloading is the identity.

    The schedule still runs every hook, so ordering and residency bookkeeping are exercised.
    """

    can_pin = False
    copies_to_device = False

    def __init__(self) -> None:
        self.device = torch.device("cpu")

    def pin_arena(self, nbytes: int) -> torch.Tensor:
        raise RuntimeError("the CPU backend does not pin memory")

    def copy_group(self, hosts, non_blocking, side_stream, timed):
        return hosts, None

    def evicted(self, host: torch.Tensor) -> torch.Tensor:
        return host

    def wait(self, token: Any, tensors: list[torch.Tensor]) -> None:
        return None

    def compute_done(self) -> Any:
        return None

    def host_wait(self, marker: Any) -> None:
        return None

    def stamp(self) -> float:
        return time.perf_counter()

    def elapsed(self, start: Any, end: Any) -> float:
        return 0.0 if start is None or end is None else end - start


@dataclass(frozen=True)
class CopyToken:
    done: Any  # event on the stream that copied
    started: Any  # timing event, or None when untimed
    on_side_stream: bool
    routes: Any = None  # bytes that went pinned, staged and pageable (warm.UploadRoutes)


class CudaBackend:
    """Streamed copies on one side stream; compute waits on per-group events.

    Device tensors produced on the side stream are marked with `record_stream` when compute
    starts using them, so the caching allocator cannot hand their memory to the next prefetch
    while a kernel on the compute stream still reads it. The side stream never waits for
    compute: host copies are read-only, so a prefetch may start at once and overlap fully.
    (Training's activation offload copies to the host on a stream of its own for that reason;
    its copies back wait on those, done in the forward long before the backward asks.)
    Whole components (activated, not streamed) copy on the compute stream, so their memory
    stays in the compute stream's pool for activations once they are evicted.
    """

    can_pin = True
    copies_to_device = True

    def __init__(self, device: torch.device) -> None:
        from .hostpool import RESIDENT_SLOTS, StagingRing  # hostpool imports residency; keep device.py import-light

        self.device = device
        self._watched: weakref.finalize | None = None  # told when this backend is collected (memory.cleanup)
        self._side = torch.cuda.Stream(device=device)
        finished, wait = (lambda token: token.done.query()), (lambda token: token.done.synchronize())
        # streamed groups' chunks (side stream); whole components' chunks in a ring of their own, so
        # a component's upload never waits for slots a prefetch holds, nor the other way round
        self.staging = StagingRing(self.pin_arena, finished, wait)
        self.uploads = StagingRing(self.pin_arena, finished, wait, max_slots=RESIDENT_SLOTS)

    def pin_arena(self, nbytes: int) -> torch.Tensor:
        if self._watched is None:  # when this backend goes, its staging stays locked in torch's cache
            from .cleanup import note_pinned_dropped  # device.py stays import-light

            self._watched = weakref.finalize(self, note_pinned_dropped)
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    @property
    def side_stream(self) -> Any:
        """The stream streamed copies run on (training's activation offload queues its copies there too)."""
        return self._side

    def copy_group(self, hosts, non_blocking, side_stream, timed):
        """Every copy goes by its `upload_route` (memory/hostpool.py): pinned sources straight,
        plain ones chunk by chunk through a pinned staging ring, the rest synchronously; so no
        pageable tensor is ever copied with non_blocking=True. Streamed groups copy on the side
        stream through `staging`, whole components on the compute stream through `uploads`.

        The ring hands back each full slot with a marker event recorded after the copies that
        read it; the last marker follows every copy of the group, so it is the group's own event
        (compute waits on it); a group with nothing staged records one of its own.
        """
        stream = self._side if side_stream else torch.cuda.current_stream(self.device)
        ring = self.staging if side_stream else self.uploads
        started = torch.cuda.Event(enable_timing=True) if timed else None
        marks: list[CopyToken] = []

        def mark() -> CopyToken:
            done = torch.cuda.Event(enable_timing=timed)
            done.record(stream)
            marks.append(CopyToken(done, started, side_stream))
            return marks[-1]

        with torch.cuda.stream(stream):
            if started is not None:
                started.record(stream)
            tensors, routes = ring.upload(hosts, self.device, non_blocking, mark)
            last = marks[-1] if marks else mark()
        return tensors, CopyToken(last.done, started, side_stream, routes)

    def evicted(self, host: torch.Tensor) -> torch.Tensor:
        return host

    def wait(self, token: Any, tensors: list[torch.Tensor]) -> None:
        if token is None or not token.on_side_stream:
            return  # copied on the compute stream: already ordered before the compute
        compute = torch.cuda.current_stream(self.device)
        compute.wait_event(token.done)
        for tensor in tensors:
            record_stream(tensor, compute)

    def compute_done(self) -> Any:
        marker = torch.cuda.Event()
        marker.record(torch.cuda.current_stream(self.device))
        return marker

    def host_wait(self, marker: Any) -> None:
        marker.synchronize()

    def stamp(self) -> Any:
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def elapsed(self, start: Any, end: Any) -> float:
        if isinstance(end, CopyToken):  # a copy's own duration
            start, end = end.started, end.done
        if start is None or end is None:
            return 0.0
        end.synchronize()
        return start.elapsed_time(end) / 1000.0


def record_stream(tensor: torch.Tensor, stream: Any) -> None:
    """`tensor.record_stream(stream)`, reaching the inner tensors of a wrapper subclass (torchao's
    quantized tensors, anything with `__tensor_flatten__`): the caching allocator tracks the inner
    tensors' memory, and recording only the wrapper would leave it free for the next copy while a
    kernel still reads it (diffusers' group offloading records them the same way)."""
    flatten = getattr(tensor, "__tensor_flatten__", None)
    if flatten is None:
        tensor.record_stream(stream)
        return
    names, _ = flatten()
    for name in names:
        record_stream(getattr(tensor, name), stream)


class ComputeQueueBackend(CpuBackend):
    """Apple MPS and Intel XPU: every copy on the compute queue, no side stream, no pinning.

    The schedule, residency and every tier work as on CUDA, so a model that does not fit still
    runs; what is lost is overlap: a streamed block's copy runs in line with compute instead of
    behind it, so block swap and sequential cost their full copy time. (On Apple silicon host and
    device share memory, so the copy is cheap and pinning would buy nothing.) Copies are queued
    in order on the one queue, so compute never needs to wait on an event.
    """

    copies_to_device = True

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = device

    def copy_group(self, hosts, non_blocking, side_stream, timed):
        return [host.to(self.device) for host in hosts], None


SUPPORTED_DEVICES = ("cuda", "cpu", "mps", "xpu")


def backend_for(device: torch.device) -> Backend:
    if device.type == "cuda":
        return CudaBackend(device)
    if device.type == "cpu":
        return CpuBackend()
    if device.type in ("mps", "xpu"):
        log.warning("vidmem: %s has no side stream here: streamed weights (block_swap, sequential) copy on the "
                    "compute queue, so their copies do not overlap compute; tiers none and model are unaffected.",
                    device.type)
        return ComputeQueueBackend(device)
    raise ValueError(f"device={device} is not supported by vidmem's memory engine; use one of "
                     f"{', '.join(SUPPORTED_DEVICES)} (cuda streams copies behind compute; mps and xpu copy in line).")
