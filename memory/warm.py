"""WarmStore: device copies of weights kept between calls, so the next call re-points instead of copying.

A ComfyUI user queues the same graph again and again with a new seed or prompt. Without this, every
call uploads every resident weight again (all of tiers none and model, the core of block swap). A
stage (the Sampler's components, the Decode's VAE) owns one store; when a call ends, the groups
still on the device hand their copies to it instead of dropping them, and the next call's groups
take them back: a tensor whose copy is kept is re-pointed, not copied (`uploaded` vs `reused`).

Keys. A copy is keyed by where its host tensor's bytes live (address, dtype, shape, strides; for a
wrapper subclass such as GGUF's, its inner tensors') and the entry holds the host tensor itself, so
those bytes cannot be freed and the address handed to another tensor while the copy is kept: a key
hit always means the same bytes. Hosts are read-only during inference; code that writes weights in
place (training) must `release_all()` first. When the pinned host pool re-homes a tensor (a block
becomes streamed), `rehome` moves the key with it, so a changed strategy moves only the difference.
Before a call, `retain` keeps only the stage's copies and, when the call will keep them on the
device to its end, takes over those a sibling store of the same pipeline holds (`share_with`:
image-to-video's VAE, used by the sampler and the decode), so the host counts no copy the call
will not take and the device holds one copy of each weight.

Between calls nothing is hooked: modules point at their host storage as after any call; only the
store holds device memory. The host (nodes/host.py inside ComfyUI) asks for memory back through
`release(nbytes)`: kept streamed blocks first, then the cores of components that were not in use
when the call ended, then the rest. During a call (`in_use`) a request from another thread is
refused with a message and applied when the call ends; a call never gives back what it is running.
Mid-call the store may hold nothing (the groups have taken the copies), so a request for
everything is recorded as such, not as a byte count: the call's end then drops all it would keep.

Threads. The call runs on ComfyUI's execution thread; the host may ask for memory back from
another. One lock per store covers every change to the kept copies, the busy check together with
the recording of a refused request, and the call's end (owner cleared, recorded requests taken):
a request is either recorded before the call ends, and applied by it, or sees the call over and
releases at once. The lock is never held across a device copy or a call back into the host.
"""

from __future__ import annotations

import threading
import weakref
from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Iterable, Iterator

import torch

from .units import GiB, human_bytes

# Release ranks: lower goes first when the host asks for memory back.
STREAMED = 0  # a swapped block kept on the device (cheap to stream again)
IDLE_CORE = 1  # a component's resident weights, not in use when the call ended
ACTIVE_CORE = 2  # the component the call ended with (the transformer, the VAE)


class WarmStoreBusy(RuntimeError):
    """The host asked for memory back while the stage's call holds it."""


@dataclass
class _Kept:
    host: torch.Tensor  # held: its bytes (and so the key's address) stay valid while the copy is kept
    copy: torch.Tensor
    nbytes: int
    rank: int
    order: int  # within a rank, later first: the last streamed block kept is the last needed


@dataclass(frozen=True)
class UploadRoutes:
    """How bytes reached the device (memory/hostpool.py, `upload_route` and `StagingRing.upload`)."""

    pinned: int = 0  # from page-locked host copies, straight and asynchronously
    staged: int = 0  # through the pinned staging ring, chunk by chunk
    pageable: int = 0  # synchronous copies (wrapper subclasses, non-contiguous, non_blocking off, no pinning)

    def __add__(self, other: "UploadRoutes") -> "UploadRoutes":
        return UploadRoutes(self.pinned + other.pinned, self.staged + other.staged, self.pageable + other.pageable)

    def describe(self) -> str:
        parts = [f"{human_bytes(n)} {name}" for name, n in
                 (("pinned", self.pinned), ("staged", self.staged), ("pageable", self.pageable)) if n]
        return f" ({', '.join(parts)})" if parts else ""


@dataclass
class CallTally:
    """What one call moved: resident weights copied to the device (and how: `routes`), streamed
    blocks copied (block swap and sequential stream every step by design; how: `streamed_routes`),
    and bytes found already on the device."""

    uploaded_bytes: int = 0
    streamed_bytes: int = 0
    reused_bytes: int = 0
    routes: UploadRoutes = field(default_factory=UploadRoutes)
    streamed_routes: UploadRoutes = field(default_factory=UploadRoutes)


@dataclass(eq=False)  # compared by identity: held in the set of live stores
class WarmStore:
    """One stage's device copies between its calls; `label` names it in host logs and messages."""

    label: str
    device: torch.device | None = None
    tally: CallTally = field(default_factory=CallTally)
    released_bytes: int = 0  # given back at the host's request, ever
    host_entry: object | None = None  # what the host registered for this store, kept alive with it
    _kept: dict = field(default_factory=dict)
    _owner: int | None = None  # thread id of the call in progress
    _deferred: int = 0  # bytes the host asked for during a call
    _deferred_all: bool = False  # the host asked for everything during a call
    _backend: weakref.ref | None = None  # the backend whose copies are kept
    _siblings: weakref.WeakSet = field(default_factory=weakref.WeakSet, repr=False)  # the pipeline's other stages
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)  # see "Threads" above

    def __post_init__(self) -> None:
        _LIVE.add(self)

    # --- a call --------------------------------------------------------------------------------

    @contextmanager
    def in_use(self, device: torch.device, backend: object | None = None) -> Iterator["WarmStore"]:
        """For the length of one call on `device` through `backend`: copies kept for another device
        or made by another backend (its own streams; a pipeline keeps one per device) are dropped,
        the tally restarts, and host requests from other threads are refused until the end."""
        with self._lock:
            if self.device is not None and self.device != device:
                self._kept.clear()
            if backend is not None:
                if self._backend is not None and self._backend() is not backend:
                    self._kept.clear()
                self._backend = weakref.ref(backend)
            self.device, self.tally = device, CallTally()
            self._owner = threading.get_ident()
        try:
            yield self
        finally:
            with self._lock:  # a request recorded after this would wait for a call that has ended
                self._owner = None
                deferred, everything = self._deferred, self._deferred_all
                self._deferred, self._deferred_all = 0, False
            if everything:
                self.release_all()
            elif deferred:
                self.release(deferred)

    @property
    def busy(self) -> bool:
        return self._owner is not None

    def take(self, hosts: list[torch.Tensor]) -> list[torch.Tensor | None]:
        """The kept copy of each host (removed from the store: the caller owns it now), or None."""
        keys = [storage_key(host) for host in hosts]
        with self._lock:
            found = [self._kept.pop(key, None) for key in keys]
        return [kept.copy if kept is not None else None for kept in found]

    def holds_all(self, hosts: list[torch.Tensor]) -> bool:
        keys = _keys_of(hosts)
        with self._lock:
            return keys <= self._kept.keys()

    def count(self, copied: int, reused: int, streamed: bool, routes: UploadRoutes | None = None) -> None:
        """`routes`: how the `copied` bytes travelled, as the backend reported it; a backend that
        reports nothing copied them synchronously from where they live (pageable)."""
        routes = routes if routes is not None else UploadRoutes(pageable=copied)
        if streamed:
            self.tally.streamed_bytes += copied
            self.tally.streamed_routes += routes
        else:
            self.tally.uploaded_bytes += copied
            self.tally.routes += routes
        self.tally.reused_bytes += reused

    def keep(self, pairs: list[tuple[torch.Tensor, torch.Tensor]], rank: int) -> None:
        """Keep `(host, device copy)` pairs until the next call takes them or the host asks."""
        entries = [(storage_key(host), host, copy, _nbytes(copy)) for host, copy in pairs]
        with self._lock:
            for key, host, copy, nbytes in entries:
                self._kept[key] = _Kept(host, copy, nbytes, rank, len(self._kept))

    def rehome(self, old: torch.Tensor, new: torch.Tensor) -> None:
        """`old`'s bytes now live at `new` (the pinned pool adopted them): its copy follows."""
        old_key, new_key = storage_key(old), storage_key(new)
        with self._lock:
            kept = self._kept.pop(old_key, None)
            if kept is not None:
                kept.host = new
                self._kept[new_key] = kept

    # --- giving memory back ----------------------------------------------------------------------

    @property
    def held_bytes(self) -> int:
        with self._lock:  # the host reads it from its own thread while a call's groups take copies
            return _bytes_of(self._kept.values())

    def held_bytes_of(self, hosts: list[torch.Tensor]) -> int:
        """Bytes kept for those of `hosts` the store holds copies of: what a call over them can take
        back. The rest (a text encoder the last call kept, left out of this one) is not room the
        call can count on (`retain` drops it)."""
        keys = _keys_of(hosts)
        with self._lock:
            return _bytes_of(kept for key, kept in self._kept.items() if key in keys)

    def retain(self, hosts: list[torch.Tensor], *, take_over: bool, device: torch.device | None = None) -> int:
        """Keep only the copies of `hosts` (the tensors of the stage about to run); returns the bytes
        dropped. Call it before the host is told what the store holds: a copy this call will not take
        (a text encoder the last call kept, left out of this one) would otherwise stay on the device
        for the whole call and be counted by the host as loaded, so it would free too little. A call on
        another `device` than the copies' takes none of them: all go now, not only when the call starts
        (`in_use`), or the host would count them as loaded on the new device.

        `take_over`: this call keeps every one of `hosts` on the device until it ends (the sampler
        under tier none; the decode, whose VAE is its only component), so the copies a sibling store
        holds (`share_with`) move here and the device keeps one. A call that drops a component
        mid-call (tier model and block swap evict the VAE once the transformer runs) passes False:
        taking the sibling's copy would only lose it. Decided by this call, not the last one, so a
        cancelled call or a changed tier cannot leave two copies."""
        keys = _keys_of(hosts)
        with self._lock:
            elsewhere = device is not None and self.device is not None and self.device != device
            dropped = [key for key in self._kept if elsewhere or key not in keys]
            freed = _bytes_of(self._kept.pop(key) for key in dropped)
        if take_over:
            for sibling in list(self._siblings):
                self._take_over(sibling, keys)
        return freed

    def share_with(self, other: "WarmStore") -> None:
        """`other` is another stage's store of the same pipeline, whose components this stage may use
        too (image-to-video's VAE: the sampler encodes the image with it, the decode decodes): a
        `retain(..., take_over=True)` of either store moves the other's copies of its stage to it, so
        the device holds one copy."""
        if other is not self:
            self._siblings.add(other)
            other._siblings.add(self)

    def _take_over(self, other: "WarmStore", keys: set) -> None:
        """Move `other`'s copies of `keys` here, when they were made where this store's copies are
        (same device and backend; a store that keeps nothing yet takes on the other's): a call on
        another device then drops them with this store's own (`in_use`). Both stores are locked: a
        copy is in one of them at every moment, never in neither nor in both."""
        with _locked(self, other):
            if other._owner is not None or not other._kept:
                return
            if self.device is None and not self._kept:
                self.device, self._backend = other.device, other._backend
            mine = self._backend() if self._backend is not None else None
            theirs = other._backend() if other._backend is not None else None
            if self.device != other.device or mine is None or mine is not theirs:
                return
            for key in keys & other._kept.keys():
                self._kept[key] = other._kept.pop(key)

    @property
    def tensors(self) -> int:
        with self._lock:
            return len(self._kept)

    def release(self, nbytes: int) -> int:
        """Drop kept copies, streamed blocks first, until `nbytes` are freed; returns bytes dropped.

        Refused (WarmStoreBusy) while a call on another thread holds the store; the request is
        then applied when that call ends."""
        with self._lock:
            self._refuse_if_busy(nbytes)
            freed = 0
            for key, kept in sorted(self._kept.items(), key=lambda item: (item[1].rank, -item[1].order)):
                if freed >= nbytes:
                    break
                del self._kept[key]
                freed += kept.nbytes
            self.released_bytes += freed
        return freed

    def forget(self) -> None:
        """Drop every kept copy without counting it as given back (the end of a call replaces them)."""
        with self._lock:
            self._kept.clear()

    def release_all(self) -> int:
        """Drop every kept copy; returns bytes dropped. Refused while a call on another thread holds
        the store even when it holds nothing now (the call's groups have taken the copies and would
        hand them back at its end); the call's end then drops everything."""
        with self._lock:
            self._refuse_if_busy(None)
            freed = _bytes_of(self._kept.values())
            self._kept.clear()
            self.released_bytes += freed
        return freed

    def _refuse_if_busy(self, nbytes: int | None) -> None:
        """`nbytes` None: the host asked for everything. Called with the lock held, so the refusal is
        recorded before the call's end can take the recorded requests, or the call is seen over."""
        if self._owner is None or self._owner == threading.get_ident():
            return
        if nbytes is None:
            self._deferred_all = True
            what = "everything it keeps"
        else:
            self._deferred = max(self._deferred, nbytes)
            what = f"{nbytes / GiB:.2f} GiB of kept weights"
        raise WarmStoreBusy(f"vidmem: {self.label} is running on {self.device} and cannot give memory back "
                            f"mid-call; it will release {what} when the call ends.")

    def describe(self) -> str:
        tally = self.tally
        streamed = (f", {human_bytes(tally.streamed_bytes)} streamed{tally.streamed_routes.describe()}"
                    if tally.streamed_bytes else "")
        return (f"warm: {human_bytes(tally.uploaded_bytes)} uploaded{tally.routes.describe()}, "
                f"{human_bytes(tally.reused_bytes)} reused"
                f"{streamed}, {human_bytes(self.held_bytes)} kept")

    def as_dict(self) -> dict:
        tally = self.tally
        return {"uploaded_bytes": tally.uploaded_bytes, "streamed_bytes": tally.streamed_bytes,
                "reused_bytes": tally.reused_bytes, "kept_bytes": self.held_bytes, "kept_tensors": self.tensors,
                "upload_pinned_bytes": tally.routes.pinned, "upload_staged_bytes": tally.routes.staged,
                "upload_pageable_bytes": tally.routes.pageable,
                "stream_pinned_bytes": tally.streamed_routes.pinned,
                "stream_staged_bytes": tally.streamed_routes.staged,
                "stream_pageable_bytes": tally.streamed_routes.pageable,
                "summary": self.describe()}


_LIVE: "weakref.WeakSet" = weakref.WeakSet()  # every store of a pipeline still loaded (and ranks' stand-ins)


def release_everywhere() -> int:
    """Every live store gives back all it keeps (Free VRAM, an out-of-memory error); returns bytes
    dropped. A store whose call runs on another thread gives its share back when that call ends."""
    freed = 0
    for store in list(_LIVE):
        try:
            freed += store.release_all()
        except WarmStoreBusy:
            pass  # deferred by the store itself
    return freed


def rehome_everywhere(old: torch.Tensor, new: torch.Tensor) -> None:
    """`old`'s bytes now live at `new`: every live store's copy follows (a pipeline's stages share its
    pinned pool, so the decode's store may hold a copy of a home the sampler's call moves)."""
    for store in list(_LIVE):
        rehome = getattr(store, "rehome", None)  # a rank's stand-in keeps no keys here
        if rehome is not None:
            rehome(old, new)


def release_up_to(nbytes: int) -> int:
    """Live stores give back up to `nbytes` between them, each its streamed blocks first; returns
    bytes dropped (a context-parallel rank answering its coordinator, memory/parallel/kept.py)."""
    freed = 0
    for store in list(_LIVE):
        if freed >= nbytes:
            break
        try:
            freed += store.release(nbytes - freed)
        except WarmStoreBusy:
            pass  # deferred by the store itself
    return freed


def track(store) -> None:
    """`store` joins the live stores: anything with `held_bytes`, `release(nbytes)` and `release_all()`
    (a rank's stand-in in the coordinator, memory/parallel/kept.py), held weakly like a WarmStore."""
    _LIVE.add(store)


def kept_everywhere() -> int:
    """Device bytes every live store keeps between calls (the memory meter shows vidmem's share)."""
    return sum(store.held_bytes for store in list(_LIVE))


def call_on(store: WarmStore | None, backend):
    """`store.in_use(backend.device, backend)`, or nothing where the backend keeps no store (the CPU)."""
    return store.in_use(backend.device, backend) if store is not None else nullcontext()


@contextmanager
def _locked(*stores: WarmStore) -> Iterator[None]:
    """Hold the locks of `stores`, always taken in the same order, so two stores taking over each
    other's copies at once cannot each wait for the other's lock."""
    with ExitStack() as stack:
        for store in sorted(stores, key=id):
            stack.enter_context(store._lock)
        yield


def _bytes_of(kept: Iterable[_Kept]) -> int:
    return sum(entry.nbytes for entry in kept)


def _keys_of(hosts: list[torch.Tensor]) -> set:
    return {storage_key(host) for host in hosts}


def storage_key(tensor: torch.Tensor) -> tuple:
    """Where `tensor`'s bytes live and how they are read: equal keys, same bytes (while held)."""
    flatten = getattr(tensor, "__tensor_flatten__", None)
    if flatten is not None:  # a wrapper subclass (GGUF, torchao) has no storage of its own
        names, _ = flatten()
        return (type(tensor).__name__, tuple(tensor.shape), *(storage_key(getattr(tensor, name)) for name in names))
    return (tensor.data_ptr(), tensor.dtype, tuple(tensor.shape), tuple(tensor.stride()), tensor.device.type)


def _nbytes(tensor: torch.Tensor) -> int:
    flatten = getattr(tensor, "__tensor_flatten__", None)
    if flatten is not None:
        names, _ = flatten()
        return sum(_nbytes(getattr(tensor, name)) for name in names)
    return tensor.numel() * tensor.element_size()

