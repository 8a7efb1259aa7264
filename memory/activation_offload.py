"""Activation offload for training: checkpointed block inputs wait in pinned host memory.

With per-block gradient checkpointing the only activations a block keeps from its forward to its
backward are its inputs (the hidden state it was handed); the backward re-runs the block from
them. At Wan 14B 720p that is 0.77 GB per block, 40 blocks: the inputs alone are 31 GB. Offloaded,
each block's input is copied to a host buffer as the block starts (on a stream of its own, after an
event says the compute that produced it is done: the weights' side stream never waits for compute,
memory/device.py) and its device memory is free as soon as the block has run; the backward, which
re-runs blocks in reverse, starts copying the input of the block it needs next while the current
one re-runs, on the weights' side stream and under the same prefetch depth as the weights
(memory/blockswap.py). So the device holds about one block's
activations plus the inputs in flight, and the host holds every block's input.

Why not `torch.autograd.graph.save_on_cpu`: it offloads every tensor autograd saves (inside a
checkpointed block that is nothing, outside it the block inputs), but copies on the compute
stream, pins a fresh buffer per tensor per step, and brings each tensor back only when the
backward asks for it, in line: the copy is exposed in full. Here the same saved-tensor hooks
(`torch.autograd.graph.saved_tensors_hooks`) are layered around each checkpoint call only, so
they see exactly the block's inputs (torch's non-reentrant checkpoint saves them under the hooks
active when it is called, before its own), and the buffers come from an `ActivationPool`: pinned
once per size under the RAM ceiling, reused step after step.

A block's input that is also the previous block's input (Wan's text embedding, the timestep
projection, rotary tables: the loop hands every block the same object) stays on the device by
reference: it lives there anyway, so a host copy would only cost a copy. The first block has no
previous one, so all its tensor inputs are offloaded, those later blocks share included (Wan's
text embedding and timestep projection; tuples such as rotary tables are not saved tensors).
A tensor over the pool's ceiling stays on the device too (counted in `stats()["over_cap"]`).
The training planner runs the same rules: it traces what `saving` offloads per block
(`block_inputs`) and splits it at the pinned ceiling with the pool's own `take`
(`split_at_ceiling`), so plan and run agree on what moves and what stays.

On the CPU (and the tests' stand-in devices) the copies are plain synchronous host copies at the
source's address modulo LINE (MKL rounds by alignment: docs/bit-identity.md), so the schedule and
the bookkeeping run, and training is bit-identical with offload on or off.
"""

from __future__ import annotations

import logging
import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Callable, Iterable, Iterator

import torch

from .device import record_stream
from .hostpool import LINE

log = logging.getLogger("vidmem")

# torch has no public getter for the active saved-tensor hooks (training/autograd.py says more).
_TOP_HOOKS = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)

UNPINNED = 1 << 62  # the ceiling of a backend that does not pin (the CPU): plain RAM, which the RAM budget counts


_ABSENT = object()  # an attribute the module did not have (None is a value diffusers sets)


@contextmanager
def checkpointing_switched(switches: list, enabled: bool, func: Callable) -> Iterator[None]:
    """diffusers' per-block checkpointing (`gradient_checkpointing` and `_gradient_checkpointing_func`
    on each module in `switches`) set to `enabled` through `func`; both put back exactly on exit,
    the instance attribute removed where the module had none. Shared by the training run and the
    planner's trace of what it moves."""
    saved = [(m, m.gradient_checkpointing, m.__dict__.get("_gradient_checkpointing_func", _ABSENT)) for m in switches]
    try:
        for module in switches:
            module.gradient_checkpointing, module._gradient_checkpointing_func = enabled, func
        yield
    finally:
        for module, flag, previous in saved:
            module.gradient_checkpointing = flag
            if previous is _ABSENT:  # diffusers' ModelMixin sets it to None on the instance: that is kept
                module.__dict__.pop("_gradient_checkpointing_func", None)
            else:
                module._gradient_checkpointing_func = previous


class ActivationOffloadError(RuntimeError):
    pass


class OffloadMode(str, Enum):
    """off / on, or auto: on only where the training plan says the step fits with it and not without."""

    OFF = "off"
    ON = "on"
    AUTO = "auto"


def offload_mode(value: object, name: str = "activation_offload") -> OffloadMode:
    """`value` as an OffloadMode: a mode or its name, or a boolean (the input was one before auto
    existed, and saved workflows and prompts still hand True/False over): True is on, False off."""
    if isinstance(value, bool):
        return OffloadMode.ON if value else OffloadMode.OFF
    try:
        return OffloadMode(getattr(value, "value", value))
    except ValueError:
        raise ValueError(f"{name}={value!r} is not one of off, on, auto (a workflow saved with the old boolean: true or false, read as on or off).") from None


def _outer_hooks() -> tuple[Callable, Callable]:
    identity = lambda tensor: tensor  # noqa: E731
    if _TOP_HOOKS is None:
        return identity, identity
    try:
        hooks = _TOP_HOOKS(False)
    except TypeError:  # older signature without the argument
        hooks = _TOP_HOOKS()
    return hooks if hooks is not None else (identity, identity)


def _power_of_two(nbytes: int) -> int:
    return 1 << max(nbytes - 1, 1).bit_length()


def host_buffer_bytes(nbytes: int) -> int:
    """The pinned buffer an input of `nbytes` takes (the pool's size classes; the planner counts the same):
    a power of two with room to start the copy at its source's offset in a line."""
    return _power_of_two(nbytes + LINE)


def _stand_in(nbytes: int) -> torch.Tensor:
    """A buffer that has a size and no memory: what planning runs the pool on."""
    return torch.empty(nbytes, dtype=torch.uint8, device="meta")


@dataclass(frozen=True)
class CeilingSplit:
    """Where one step's block inputs go under a pinned ceiling (`split_at_ceiling`)."""

    moved_bytes: int  # input bytes copied to the host (and back) per step
    host_bytes: int  # the pinned buffers they take (the pool's size classes)
    kept_bytes: int  # inputs over the ceiling: they stay on the device
    kept_inputs: int


def split_at_ceiling(sizes: Iterable[int], cap_bytes: int) -> CeilingSplit:
    """What a run does with block inputs of `sizes` bytes (in the forward's order) under a pinned
    ceiling of `cap_bytes`: the pool's own `take`, on stand-in buffers, so planner and run share
    one rule. Every step after the first reuses the first step's buffers in the same order, so one
    step answers for the run."""
    pool = ActivationPool(_stand_in, cap_bytes)
    moved = kept = count = 0
    for nbytes in sizes:
        if pool.take(nbytes) is None:
            kept, count = kept + nbytes, count + 1
        else:
            moved += nbytes
    return CeilingSplit(moved, pool.pinned_bytes, kept, count)


class ActivationPool:
    """Host buffers for offloaded activations, under a byte ceiling, reused step after step.

    Buffers are sized to powers of two (torch's pinned allocator rounds every request up to one
    anyway) and kept by size: a training step offloads the same shapes every step (one bucket), so
    from the second step on nothing new is pinned. `pin(nbytes)` makes one uint8 buffer (the
    backend's `pin_arena`; plain memory on the CPU). `cap_bytes` counts every buffer made; past it,
    or when the driver refuses to pin, `take` answers None and the tensor stays on the device.
    """

    def __init__(self, pin: Callable[[int], torch.Tensor], cap_bytes: int) -> None:
        self._pin, self.cap_bytes = pin, max(0, int(cap_bytes))
        self._free: dict[int, list[torch.Tensor]] = {}
        self._made: list[torch.Tensor] = []
        self.in_use = 0  # buffers taken and not given back
        self.refused = ""  # the driver's refusal to pin, once met: nothing more is asked of it this run

    def __repr__(self) -> str:
        return f"ActivationPool({len(self._made)} buffers, {self.pinned_bytes} bytes, {self.in_use} in use)"

    @property
    def pinned_bytes(self) -> int:
        return sum(buffer.numel() for buffer in self._made)

    def take(self, nbytes: int) -> torch.Tensor | None:
        size = host_buffer_bytes(nbytes)
        free = self._free.get(size)
        if free:
            self.in_use += 1
            return free.pop()
        if self.refused or self.pinned_bytes + size > self.cap_bytes:
            return None
        try:
            buffer = self._pin(size)
        except RuntimeError as error:  # the driver refused to lock more memory: asking again per input would too
            self.refused = str(error).splitlines()[0] if str(error) else type(error).__name__
            return None
        self._made.append(buffer)
        self.in_use += 1
        return buffer

    def give(self, buffer: torch.Tensor) -> None:
        self._free.setdefault(buffer.numel(), []).append(buffer)
        self.in_use -= 1

    def release(self) -> int:
        """Drop every buffer (the run is over; called in a `finally`, so it never raises over the
        error on its way out). Returns how many were still taken: 0 unless a step was not closed."""
        self._free.clear()
        self._made.clear()
        return self.in_use


def _view_like(buffer: torch.Tensor, tensor: torch.Tensor) -> torch.Tensor:
    """A view of `buffer` shaped as `tensor`, starting at `tensor`'s address modulo LINE."""
    start = (tensor.data_ptr() - buffer.data_ptr()) % LINE
    nbytes = tensor.numel() * tensor.element_size()
    return buffer[start : start + nbytes].view(tensor.dtype).view(tensor.shape)


class InlineCopies:
    """CPU (and MPS/XPU's one queue): synchronous copies; on the CPU the host copy is handed back
    as it is (its buffer returns to the pool when the step closes)."""

    stream = None

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.hands_back_host = device.type == "cpu"

    def to_host(self, tensor: torch.Tensor, host: torch.Tensor) -> Any:
        host.copy_(tensor)
        return None

    def to_device(self, host: torch.Tensor, filled: Any) -> tuple[torch.Tensor, Any]:
        return (host if self.hands_back_host else host.to(self.device)), None

    def wait(self, tensor: torch.Tensor, token: Any) -> None:
        return None

    def settle(self) -> None:
        return None


class SideStreamCopies:
    """CUDA: copies ordered by events, never a host wait inside the block loop.

    To the host, on a stream of its own (`down`): it waits for an event recorded on the compute
    stream (the input has been computed), copies into the pinned buffer, and the device tensor is
    `record_stream`ed on it so the allocator keeps it until the copy has read it. Not on the weights'
    side stream: a wait for compute there would hold every weight prefetch queued after it, and the
    link copies both ways at once. To the device, on the weights' side stream (the backward's
    schedule is theirs): it waits for the buffer's fill, copies non_blocking from it; compute waits on
    its event and the tensor is recorded on the compute stream. A buffer goes back to the pool as soon
    as its copy to the device is queued: the next fill waits for the side stream's copies queued
    before it (`_read`), and the host waits for both streams once per step (`settle`).
    """

    hands_back_host = False

    def __init__(self, device: torch.device, stream: Any) -> None:
        self.device, self.stream = device, stream
        self.down = torch.cuda.Stream(device)
        self._filled: Any = None  # event after the last copy to the host
        self._read: Any = None  # event after the last copy to the device (a buffer read)

    def to_host(self, tensor: torch.Tensor, host: torch.Tensor) -> Any:
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.down):
            self.down.wait_event(ready)
            if self._read is not None:  # the buffer may be one a queued copy to the device still reads
                self.down.wait_event(self._read)
            host.copy_(tensor, non_blocking=True)
            self._filled = _mark(self.down)
        record_stream(tensor, self.down)
        return self._filled

    def to_device(self, host: torch.Tensor, filled: Any) -> tuple[torch.Tensor, Any]:
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(filled)  # done long before in a backward: the wait costs nothing then
            tensor = host.to(self.device, non_blocking=True)  # pinned source: truly asynchronous
            self._read = _mark(self.stream)
        return tensor, self._read

    def wait(self, tensor: torch.Tensor, token: Any) -> None:
        compute = torch.cuda.current_stream(self.device)
        compute.wait_event(token)
        record_stream(tensor, compute)

    def settle(self) -> None:
        """The host waits for the last copy each way (once per step, after the backward)."""
        for event in (self._filled, self._read):
            if event is not None:
                event.synchronize()
        self._filled = self._read = None


def _mark(stream: Any) -> Any:
    event = torch.cuda.Event()
    event.record(stream)
    return event


def copies_for(backend) -> InlineCopies | SideStreamCopies:
    """The backend's side stream when it has one (CudaBackend), else inline copies."""
    stream = getattr(backend, "side_stream", None)
    return SideStreamCopies(backend.device, stream) if stream is not None else InlineCopies(backend.device)


@dataclass(eq=False)
class _Saved:
    """One offloaded tensor: its host copy, and its device copy once brought back."""

    block: "_Block"
    buffer: torch.Tensor
    host: torch.Tensor
    nbytes: int
    source: "_Source"
    filled: Any = None  # the copy to the host (an event on CUDA)
    device: torch.Tensor | None = None
    token: Any = None  # the copy back to the device
    unpacked: bool = False


@dataclass(eq=False)
class _Block:
    index: int
    saved: list[_Saved] = field(default_factory=list)
    onloaded: bool = False


@dataclass(frozen=True)
class _Kept:
    """A tensor left on the device (shared with the previous block, or over the ceiling)."""

    packed: Any
    source: "_Source"


@dataclass(frozen=True)
class _Source:
    """The saved tensor's version when saved. Saved-tensor hooks switch off autograd's own check that a
    tensor the backward needs was not changed in place since (and an offloaded copy would hand back the
    old values): `check` makes it again, while the tensor is alive to be looked at."""

    tensor: weakref.ref
    version: int

    @classmethod
    def of(cls, tensor: torch.Tensor) -> "_Source":
        return cls(weakref.ref(tensor), tensor._version)

    def check(self) -> None:
        tensor = self.tensor()
        if tensor is not None and tensor._version != self.version:
            raise RuntimeError(
                "one of the variables needed for gradient computation has been modified by an inplace operation: "
                f"a checkpointed block's input of shape {list(tensor.shape)} is at version {tensor._version}; expected "
                f"version {self.version} instead (vidmem's activation offload saved it before the change).")


class ActivationOffload:
    """One training run's activation offload: `saving(args)` around each checkpoint call (in
    forward order), `begin_backward()` before `loss.backward()`, `close()` after each step."""

    def __init__(self, copies: InlineCopies | SideStreamCopies, pool: ActivationPool, prefetch: int = 1) -> None:
        self.copies, self.pool, self.prefetch = copies, pool, max(1, int(prefetch))
        self._blocks: list[_Block] = []
        self._previous: list[weakref.ref] = []
        self._carried: set[int] = set()
        self.offloaded_bytes = 0  # bytes copied to the host, every step of the run
        self.on_demand = 0  # blocks whose inputs were copied back only when asked for (not prefetched)
        self.prefetched = 0
        self.over_cap = 0

    def stats(self) -> dict:
        return {"offloaded_bytes": self.offloaded_bytes, "prefetched_blocks": self.prefetched,
                "on_demand_blocks": self.on_demand, "over_cap": self.over_cap,
                "host_buffer_bytes": self.pool.pinned_bytes}

    @contextmanager
    def saving(self, args: tuple) -> Iterator[None]:
        """Around one checkpointed block call: its tensor inputs not shared with the previous
        block's are offloaded when checkpoint saves them."""
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        shared = {id(ref()) for ref in self._previous if ref() is not None}
        self._carried = {id(t) for t in tensors if id(t) not in shared and t.device == self.copies.device}
        self._previous = [weakref.ref(t) for t in tensors]
        self._blocks.append(_Block(len(self._blocks)))
        outer_pack, outer_unpack = _outer_hooks()

        def pack(tensor: torch.Tensor):
            if id(tensor) in self._carried:
                saved = self._offload(tensor)
                if saved is not None:
                    return saved
            return _Kept(outer_pack(tensor), _Source.of(tensor))

        def unpack(packed):
            packed.source.check()
            return outer_unpack(packed.packed) if isinstance(packed, _Kept) else self._bring_back(packed)

        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
                yield
        finally:
            self._carried = set()

    def block_inputs(self) -> list[list[int]]:
        """Bytes offloaded per checkpointed block so far in this step (forward order); the planner
        traces them (memory/plan/train.py), the run's total is `offloaded_bytes`."""
        return [[saved.nbytes for saved in block.saved] for block in self._blocks]

    def begin_backward(self) -> None:
        """The backward re-runs the last block first: start copying the inputs of the last blocks that moved
        any (past the pinned ceiling the last blocks kept theirs on the device: nothing to copy there)."""
        self._previous = []
        for block in self._moved(self._blocks)[: self.prefetch]:
            self._onload(block)
            self.prefetched += 1

    def close(self) -> None:
        """After the step (or an error in it): every buffer back to the pool, nothing held (also when waiting
        for the copies raises: a sticky CUDA error; the run is ending then and drops the pool)."""
        try:
            self.copies.settle()
        finally:
            for block in self._blocks:
                for saved in block.saved:
                    if saved.buffer is not None:
                        self.pool.give(saved.buffer)
                        saved.buffer = None
                    saved.device = saved.host = None
            self._blocks, self._previous, self._carried = [], [], set()

    def _offload(self, tensor: torch.Tensor) -> _Saved | None:
        nbytes = tensor.numel() * tensor.element_size()
        if not tensor.is_contiguous() or type(tensor) is not torch.Tensor:
            return None
        buffer = self.pool.take(nbytes)
        if buffer is None:
            if not self.over_cap:  # the plan assumed every input fits the pinned ceiling: say so once
                if self.pool.refused:
                    log.warning("vidmem: activation offload: the driver refused to pin more host memory (%s) after "
                                "%d MiB; block inputs beyond it stay on the GPU (free host RAM, or lower "
                                "max_pinned_ram_gb to what this machine can lock)", self.pool.refused,
                                self.pool.pinned_bytes >> 20)
                else:
                    log.warning("vidmem: activation offload: the pinned-memory ceiling (%d MiB) is spent; block "
                                "inputs beyond it stay on the GPU (raise max_pinned_ram_gb)", self.pool.cap_bytes >> 20)
            self.over_cap += 1
            return None
        host = _view_like(buffer, tensor)
        block = self._blocks[-1]
        saved = _Saved(block, buffer, host, nbytes, _Source.of(tensor))
        saved.filled = self.copies.to_host(tensor, host)
        block.saved.append(saved)
        self.offloaded_bytes += nbytes
        return saved

    def _bring_back(self, saved: _Saved) -> torch.Tensor:
        if saved.unpacked:
            raise ActivationOffloadError("an offloaded activation was asked for twice (backward with retain_graph, "
                                         "or a double backward); turn activation_offload off for that.")
        if not saved.block.onloaded:
            self._onload(saved.block)
            self.on_demand += 1
        for earlier in self._moved(self._blocks[: saved.block.index])[: self.prefetch]:
            if not earlier.onloaded:
                self._onload(earlier)
                self.prefetched += 1
        tensor, saved.device, saved.unpacked = saved.device, None, True
        self.copies.wait(tensor, saved.token)
        return tensor

    @staticmethod
    def _moved(blocks: list[_Block]) -> list[_Block]:
        """`blocks` that offloaded an input, last first (the backward's order)."""
        return [block for block in reversed(blocks) if block.saved]

    def _onload(self, block: _Block) -> None:
        block.onloaded = True
        for saved in block.saved:
            saved.device, saved.token = self.copies.to_device(saved.host, saved.filled)
            if not self.copies.hands_back_host:  # read only by side-stream copies queued before any refill
                self.pool.give(saved.buffer)
                saved.buffer, saved.host = None, None
