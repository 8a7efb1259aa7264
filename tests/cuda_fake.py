"""A recording fake of the CUDA API, so the engine's CUDA path runs (and is checked) on a CPU.

`FakeCuda.install(monkeypatch)` replaces what vidmem calls in `torch.cuda` (streams, events,
`stream()` contexts, synchronize, memory statistics, empty_cache, ipc_collect), `Tensor.record_stream`,
pinned allocations (`torch.empty(..., pin_memory=True)`) and the copies themselves (`Tensor.to` while a
fake stream is current), and logs every call in order in `fake.log` as tuples:

    ("copy", stream, storage_ptr)        a tensor copied to the device on `stream` ("compute" | "side")
    ("record", event_id, stream)         Event.record
    ("wait_event", stream, event_id)     Stream.wait_event: `stream` waits for the event
    ("record_stream", storage_ptr, stream)
    ("event_sync", event_id)             Event.synchronize: the host waits for one event
    ("device_sync",)                     torch.cuda.synchronize: the host waits for everything
    ("pin", nbytes)                      a pinned host allocation
    ("stage", nbytes)                    a host copy into pinned memory inside a stream context (a staging slot filled)
    ("oom", stream)                      the injected out-of-memory error (the copy group is abandoned)
    (kind, group_name)                   the engine's observer events (onload, prefetch, evict), via `observe`
    ...and the memory statistics calls by name.

Every host-to-device copy (`Tensor.to`, or `Tensor.copy_` into a tensor that is not pinned, while a fake
stream is current) is also kept in `fake.transfers` as a `Transfer`: its stream, whether its source was
pinned (allocated by the fake with `pin_memory=True`; `Tensor.is_pinned` answers the same), its
non_blocking flag and its bytes. A device tensor allocated with `torch.empty_like` inside a stream
context sits at its source's address modulo 64, as copies do (`copy_at_same_alignment`).

Tensors stay on the CPU (the backend's device is `cpu`, so `.to(device)` is a real copy), while
every CUDA call the backend makes goes through the fake. Events never complete on their own (a
pessimistic GPU): `query()` is False until the host synchronizes on the event, on a later one
recorded on the same stream, or on one recorded after that stream waited for it. `oom_at`: raise torch.OutOfMemoryError on that copy (1-based, counting
copies on `oom_stream` only when given), once.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import itertools
from dataclasses import dataclass

import numpy
import torch

from backends import copy_at_same_alignment


@dataclass(frozen=True)
class Transfer:
    """One host-to-device copy."""

    stream: str
    source_pinned: bool
    non_blocking: bool
    nbytes: int


class FakeStream:
    def __init__(self, fake: "FakeCuda", name: str) -> None:
        self.fake, self.name = fake, name

    def wait_event(self, event: "FakeEvent") -> None:
        self.fake.log.append(("wait_event", self.name, event.id))
        self.fake.waits.append((self.name, next(self.fake.positions), event))

    def synchronize(self) -> None:
        self.fake.log.append(("stream_sync", self.name))

    def __repr__(self) -> str:
        return f"FakeStream({self.name})"


class FakeEvent:
    """torch.cuda.Event; `finished` and `synchronized` are also what the host pool's staging tests read."""

    def __init__(self, fake: "FakeCuda", enable_timing: bool = False) -> None:
        self.fake, self.enable_timing = fake, enable_timing
        self.id = next(fake.ids)
        self.stream: str | None = None
        self.position = -1  # index in its stream's order of records
        self.finished = self.synchronized = False

    def record(self, stream: FakeStream | None = None) -> None:
        stream = stream or self.fake.current
        self.stream = stream.name
        self.position = next(self.fake.positions)
        self.fake.log.append(("record", self.id, stream.name))

    def query(self) -> bool:
        return self.finished or self.fake.completed(self)

    def synchronize(self) -> None:
        self.fake.log.append(("event_sync", self.id))
        self.fake.finish(self.stream, self.position)
        self.synchronized = self.finished = True

    def elapsed_time(self, end: "FakeEvent") -> float:
        if not (self.enable_timing and end.enable_timing):
            raise RuntimeError("elapsed_time needs events created with enable_timing=True")
        self.fake.log.append(("elapsed_time", self.id, end.id))
        return 1.0  # milliseconds


def _settle_before_faking() -> None:
    """Let what torch and diffusers set up on first use see the real functions, whatever ran before this test.

    - torch's `with torch.device(...)` recognises factory functions from a table built on first use: built while
      `torch.empty` is the fake's (pinning), it misses the real one, and modules built on `meta` get CPU weights.
    - diffusers' transformers import peft, which imports bitsandbytes, which registers CUDA kernels when torch says
      a GPU is there; diffusers' hooks evaluate `torch.cuda.Stream | None` annotations at import (the fake's is a
      function)."""
    with torch.device("meta"):
        torch.empty(0)
    if importlib.util.find_spec("diffusers") is not None:
        importlib.import_module("diffusers.models.transformers")
        importlib.import_module("diffusers.hooks")


class FakeCuda:
    def __init__(self, oom_at: int | None = None, oom_stream: str | None = None, allocator: str = "native") -> None:
        self.allocator = allocator
        self.oom_stream = oom_stream  # count only copies on this stream toward oom_at
        self.log: list[tuple] = []
        self.ids = itertools.count(1)
        self.positions = itertools.count()
        self.compute = FakeStream(self, "compute")
        self.side_streams: list[FakeStream] = []
        self.current = self.compute
        self.done_up_to: dict[str, int] = {}
        self.waits: list[tuple[str, int, FakeEvent]] = []  # (stream, position, event it waited for)
        self.copies = 0
        self.in_context = 0  # inside torch.cuda.stream(...): where the backend copies
        self.transfers: list[Transfer] = []
        self.pinned: dict[int, torch.Tensor] = {}  # storage pointer -> buffer, kept alive so no pointer is reused
        self._inside_copy = 0  # a copy's own inner work is not another copy
        self.oom_at = oom_at
        self.device_bytes = {"allocated": 3 << 20, "reserved": 8 << 20, "free": 100 << 20, "total": 1 << 30}

    def finish(self, stream: str, position: int) -> None:
        """Everything on `stream` up to `position` is done, and so is every event it waited for."""
        if position <= self.done_up_to.get(stream, -1):
            return
        self.done_up_to[stream] = position
        for waiting, at, event in self.waits:
            if waiting == stream and at < position and event.stream is not None:
                self.finish(event.stream, event.position)

    def completed(self, event: FakeEvent) -> bool:
        return event.position <= self.done_up_to.get(event.stream, -1)

    def observe(self, kind: str, group) -> None:
        self.log.append((kind, group.name))

    def calls(self, *kinds: str) -> list[tuple]:
        return [entry for entry in self.log if entry[0] in kinds]

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return type(tensor) is torch.Tensor and _ptr(tensor) in self.pinned

    def pinned_bytes(self) -> int:
        """Bytes ever allocated pinned (buffers are kept alive, so this never shrinks)."""
        return sum(buffer.numel() for buffer in self.pinned.values())

    def pageable_async(self) -> list[Transfer]:
        """Copies the README forbids: non_blocking from pageable memory."""
        return [t for t in self.transfers if t.non_blocking and not t.source_pinned]

    def _transfer(self, source: torch.Tensor, destination: torch.Tensor, non_blocking: bool) -> None:
        self.transfers.append(Transfer(self.current.name, self.is_pinned(source), bool(non_blocking),
                                       source.numel() * source.element_size()))
        self.log.append(("copy", self.current.name, _ptr(destination)))

    # --- installation -----------------------------------------------------------------------

    def install(self, monkeypatch) -> "FakeCuda":
        _settle_before_faking()
        fake = self
        cuda = torch.cuda

        def new_stream(device=None, priority=0):
            stream = FakeStream(fake, "side" if not fake.side_streams else f"side{len(fake.side_streams)}")
            fake.side_streams.append(stream)
            return stream

        @contextlib.contextmanager
        def stream_context(stream):
            previous, fake.current = fake.current, stream
            fake.in_context += 1
            try:
                yield
            finally:
                fake.current = previous
                fake.in_context -= 1

        def record(name, value=None):
            def call(*args, **kwargs):
                fake.log.append((name,))
                return value() if callable(value) else value
            return call

        monkeypatch.setattr(cuda, "Stream", new_stream)
        monkeypatch.setattr(cuda, "Event", lambda enable_timing=False, **kw: FakeEvent(fake, enable_timing))
        monkeypatch.setattr(cuda, "current_stream", lambda device=None: fake.current)
        monkeypatch.setattr(cuda, "stream", stream_context)
        monkeypatch.setattr(cuda, "synchronize", record("device_sync"))
        monkeypatch.setattr(cuda, "is_available", lambda: True)
        # Optimizers ask before each step (a CUDA build asks the driver, which raises where there is none).
        monkeypatch.setattr(cuda, "is_current_stream_capturing", lambda: False)
        monkeypatch.setattr(cuda, "mem_get_info", record("mem_get_info", lambda: (fake.device_bytes["free"], fake.device_bytes["total"])))
        monkeypatch.setattr(cuda, "memory_allocated", record("memory_allocated", lambda: fake.device_bytes["allocated"]))
        monkeypatch.setattr(cuda, "memory_reserved", record("memory_reserved", lambda: fake.device_bytes["reserved"]))
        monkeypatch.setattr(cuda, "max_memory_allocated", record("max_memory_allocated", lambda: fake.device_bytes["allocated"]))
        monkeypatch.setattr(cuda, "reset_peak_memory_stats", record("reset_peak_memory_stats"))
        monkeypatch.setattr(cuda, "empty_cache", record("empty_cache"))
        monkeypatch.setattr(cuda, "ipc_collect", record("ipc_collect"))
        monkeypatch.setattr(cuda, "get_allocator_backend", record("get_allocator_backend", lambda: fake.allocator))
        monkeypatch.setattr(cuda, "get_device_properties", record("get_device_properties", lambda: _Properties(fake.device_bytes["total"])))
        monkeypatch.setattr(torch._C, "_host_emptyCache", record("host_empty_cache"), raising=False)
        monkeypatch.setattr(torch.Tensor, "record_stream", lambda t, stream: fake.log.append(("record_stream", _ptr(t), stream.name)))
        self._patch_copies(monkeypatch)
        self._patch_pinning(monkeypatch)
        return self

    def _patch_copies(self, monkeypatch) -> None:
        """`Tensor.to` inside a fake stream context (the backend's copies) is logged on that stream."""
        fake, original = self, torch.Tensor.to

        def to(tensor, *args, **kwargs):
            out = original(tensor, *args, **kwargs)
            if fake.in_context and not fake._inside_copy:
                fake.copies += fake.oom_stream in (None, fake.current.name)
                if fake.copies == fake.oom_at and fake.oom_stream in (None, fake.current.name):
                    fake.log.append(("oom", fake.current.name))
                    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB (fake)")
                if out is tensor:  # same device: make the copy real, as a device copy would be
                    fake._inside_copy += 1
                    try:
                        out = copy_at_same_alignment(tensor)
                    finally:
                        fake._inside_copy -= 1
                fake._transfer(tensor, out, kwargs.get("non_blocking", False))
            return out

        original_copy, original_empty_like = torch.Tensor.copy_, torch.empty_like

        def copy_(destination, source, non_blocking=False):
            out = original_copy(destination, source, non_blocking)
            if fake.in_context and not fake._inside_copy:
                if fake.is_pinned(destination):  # filling a staging slot: a host copy
                    fake.log.append(("stage", source.numel() * source.element_size()))
                else:
                    fake._transfer(source, destination, non_blocking)
            return out

        def empty_like(tensor, *args, **kwargs):
            if fake.in_context and "device" in kwargs and type(tensor) is torch.Tensor and tensor.is_contiguous():
                return _empty_at_same_alignment(tensor)
            return original_empty_like(tensor, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, "to", to)
        monkeypatch.setattr(torch.Tensor, "copy_", copy_)
        monkeypatch.setattr(torch, "empty_like", empty_like)

    def _patch_pinning(self, monkeypatch) -> None:
        fake, original = self, torch.empty

        def empty(*args, pin_memory=False, **kwargs):
            if pin_memory:
                out = original(*args, **kwargs)
                fake.log.append(("pin", out.numel() * out.element_size()))
                fake.pinned[_ptr(out)] = out
                return out
            return original(*args, **kwargs)

        monkeypatch.setattr(torch, "empty", empty)
        monkeypatch.setattr(torch.Tensor, "is_pinned", lambda tensor, device=None: fake.is_pinned(tensor))


class _Properties:
    def __init__(self, total_memory: int) -> None:
        self.total_memory = total_memory


def _empty_at_same_alignment(tensor: torch.Tensor) -> torch.Tensor:
    """Fresh memory for a copy of `tensor` at its address modulo 64 (see copy_at_same_alignment)."""
    nbytes = tensor.numel() * tensor.element_size()
    line = numpy.empty(nbytes + 64, dtype=numpy.uint8)
    start = (tensor.data_ptr() - line.ctypes.data) % 64
    return torch.from_numpy(line[start : start + nbytes]).view(tensor.dtype).view(tensor.shape)


def _ptr(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()
