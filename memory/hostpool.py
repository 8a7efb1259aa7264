"""HostPool: page-locked (pinned) host homes for streamed weights, under a RAM ceiling.

A host-to-device copy is only truly asynchronous from pinned memory. The first time a streamed
tensor is seen, the pool copies it once into a pinned arena and makes that copy the tensor's
home (the pageable original is released, so RAM is not doubled). Later runs find it already
pinned and allocate nothing: the pool never grows run over run. Past the ceiling, or if the
driver refuses to pin, tensors stay pageable and are staged at each copy (below).

Arenas are ARENA_BYTES each, a power of two, because torch's pinned allocator rounds every
request up to one: pinning each 670 MiB Wan 14B block separately would lock 1 GiB apiece. The
ceiling counts arena bytes, i.e. what is really locked. The pool belongs to one loaded pipeline
(both experts of Wan 2.2 A14B share it) and lives as long as that pipeline.

A ceiling the user lowers below what the pool holds (down to 0: no pinning) is applied to the
homes already made too (`fit_ceiling`, at the next apply of a stage that streams; not the decode's,
see apply_strategy's `unpin_beyond_ceiling`): the newest arenas go, their homes move back to
pageable copies at the same address modulo LINE, and a warm store's copies follow them.

File-backed tensors (memory-mapped weight files, the disk tier) get no pinned home: that would
copy the whole model into locked RAM, the very thing the disk tier avoids. They stay in the page
cache and are staged at each copy (below). Tensor subclasses (diffusers' GGUFParameter, torchao's
wrappers) get none either: a home would be a plain tensor, losing the subclass (GGUF's `quant_type`)
or never reaching a wrapper's inner tensors, and they are copied synchronously anyway (below).

A home is made once per source tensor: a source met again in a later call (a LoRA's tensors and
its strength, registered on their layer anew for each call while the pool re-pointed only the
last call's buffer) takes the home it was given, so the pool does not grow call after call.

Every copy, streamed or resident, goes by `upload_route`: a pinned source is copied straight and
asynchronously; a plain contiguous one (pageable: over the ceiling, larger than an arena, refused by
the driver, or a resident weight; or memory-mapped) passes chunk by chunk through a `StagingRing`:
the CPU copies a chunk into a free pinned slot and the device copy reads it asynchronously while
the CPU fills the next slot, the slot filled again only once its copy's event has completed;
anything else (wrapper subclasses, or `non_blocking` turned off) is copied synchronously. So no
pageable tensor is ever copied with non_blocking=True: torch would take the flag, and the driver
would copy through a bounce buffer of its own while the CPU waits, an "asynchronous" copy that is not.
Streamed groups stage on the side stream through the CUDA backend's `staging` ring, whole
components on the compute stream through its `uploads` ring; each ring holds a few slots of at most
RESIDENT_CHUNK_BYTES, whatever the model's size, and pins nothing new run after run.

Why stage a streamed block rather than copy it synchronously: both cost the CPU a pass over the
bytes (the driver's bounce buffer is a memcpy too), but a synchronous copy holds the CPU until the
last byte has crossed (after every copy queued before it on the side stream), so the CPU cannot
queue the next kernels meanwhile and the GPU runs dry once it has worked through what was queued.
Staged, the CPU's memcpy of one chunk overlaps the transfer of the one before, the CPU is free as
soon as the last chunk is queued, and compute waits only on the group's event: the copy costs about
the slower of host memcpy and PCIe and hides behind compute as a copy from a pinned home does. A
pinned home is faster still (no memcpy at all): streamed blocks keep first claim on the ceiling.

Why stage resident weights rather than pin them once: a resident weight is copied once per cold
call and the warm store (memory/warm.py) keeps its device copy afterwards, so a pinned home would
lock its bytes for the pipeline's life to speed up a copy that rarely recurs, and the first copy
into a home costs the same CPU pass as staging. A resident tensor already pinned (a home from an
earlier block swap) is copied straight from it.

A home sits at the same address modulo LINE as the tensor it copies (staging chunks are only a
way through: their device copy is a fresh tensor). Code that
computes on the host copy (a CPU run after a streamed one, the tests' stand-in devices) then
rounds as it did on the original: MKL's default mode picks its matrix-vector kernel by where the
operands lie, so the same bytes at another alignment can give other last bits
(docs/bit-identity.md).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import psutil
import torch
from torch.utils.weak import WeakIdKeyDictionary

from .cleanup import note_pinned_dropped, release_cached_pinned
from .residency import Slot
from .storage.mapping import is_file_backed
from .units import GiB, MiB
from .warm import UploadRoutes

ARENA_BYTES = 1 * GiB
ALIGN = 512  # bytes; each copy starts in a block of its own (arenas and slots start at least LINE-aligned)
LINE = 64  # bytes, a cache line; a copy keeps its original's address modulo LINE (MKL's kernels here look at mod 16)
# Page-locked memory cannot be swapped out; leave the OS and ComfyUI this much RAM unpinned.
PINNED_HEADROOM_BYTES = 8 * GiB


def default_pinned_cap(available: int | None = None) -> int:
    """Half of the RAM that is free now (or `available` bytes: a plan's), keeping PINNED_HEADROOM_BYTES unpinned.

    What a pool has already pinned is not added back: adopting a pageable weight moves it (its old
    bytes are freed), so the free RAM read after pinning is the free RAM before it, and the pool's
    homes count against the ceiling on top (HostPool._allocate, the training and decode callers)."""
    available = psutil.virtual_memory().available if available is None else available
    return max(0, min(available // 2, available - PINNED_HEADROOM_BYTES))


def pinned_cap_bytes(max_pinned_ram_gb: float | None, host_room_bytes: int | None = None) -> int:
    """The user's ceiling in bytes, or the automatic one when unset.

    `host_room_bytes`: what the host's own pinned-memory budget still allows (inside ComfyUI:
    `MAX_PINNED_MEMORY - TOTAL_PINNED_MEMORY` of comfy.model_management, handed over by
    nodes/host.py through `HostPool.host_room_bytes`); None when the host has no such budget.
    The budget is a ceiling both pools share, not a reservation: ComfyUI pins its models' weights
    in place (pages already resident, already missing from the free RAM), so what it has not yet
    pinned takes no RAM from vidmem; what it caps is the locked memory of the whole process. So
    the automatic ceiling stays within what the budget leaves. A user's explicit ceiling is kept.
    """
    if max_pinned_ram_gb is not None:
        return int(max_pinned_ram_gb * GiB)
    cap = default_pinned_cap()
    return cap if host_room_bytes is None else max(0, min(cap, host_room_bytes))


# Every pool alive (one per loaded pipeline): Free VRAM unpins them (nodes/free.py). Weak: a pool goes with its pipeline.
LIVE_POOLS: "weakref.WeakSet[HostPool]" = weakref.WeakSet()


class HostPool:
    def __init__(self, arena_bytes: int = ARENA_BYTES, host_room_bytes: int | None = None) -> None:
        LIVE_POOLS.add(self)
        self.arena_bytes = arena_bytes
        # What the host's pinned budget still allows (see pinned_cap_bytes); the host sets it
        # before each run, since its own pinned memory grows and shrinks between runs.
        self.host_room_bytes = host_room_bytes
        self._arenas: list[torch.Tensor] = []
        self._used = 0  # bytes used in the newest arena
        self._homes: list[list[Slot]] = []  # each home's owners, to move them off an arena `fit_ceiling` drops
        # source tensor -> (its home's owners in `_homes`, the source's version when copied): a source
        # met again takes its home back (`_earlier_home`); weak, so a source's death forgets it
        self._home_of = WeakIdKeyDictionary()
        self.allocations = 0  # tensors ever copied into the pool; flat after the first run
        # Host tensors (by address) left pageable (over the ceiling, or pinning refused) and left in
        # their file mapping (staged at copy time instead): sets, because every call builds its groups
        # again and meets the same tensors; a count per meeting grew call after call.
        self._pageable: set[int] = set()
        self._mapped: set[int] = set()
        self._watched: weakref.finalize | None = None  # told when this pool is collected (memory.cleanup)

    def __repr__(self) -> str:
        return f"HostPool({self.pinned_bytes / GiB:.2f} GiB pinned in {len(self._arenas)} arenas)"

    @property
    def fallbacks(self) -> int:
        """Distinct host tensors left pageable now (each counted once, however many calls met it)."""
        return len(self._pageable)

    @property
    def file_backed(self) -> int:
        """Distinct host tensors left in their file mapping (each counted once)."""
        return len(self._mapped)

    @property
    def pinned_bytes(self) -> int:
        return sum(a.numel() for a in self._arenas)

    def adopt(self, tensors: list[list[Slot]], backend, cap_bytes: int,
              rehomed: Callable[[torch.Tensor, torch.Tensor], None] | None = None) -> list[list[Slot]]:
        """The same tensors with pinned homes where possible; each is re-pointed to it for good.
        `rehomed(old, new)` hears of each move (a warm store's kept copy follows its bytes)."""
        if not backend.can_pin:
            return tensors
        return [self._adopt_one(owners, backend, cap_bytes, rehomed) for owners in tensors]

    def fit_ceiling(self, cap_bytes: int, rehomed: Callable[[torch.Tensor, torch.Tensor], None] | None = None) -> int:
        """Unpin the newest arenas until at most `cap_bytes` stay pinned (a ceiling lowered since the
        homes were made); returns the bytes unpinned. Each home in a dropped arena gets a pageable
        copy at the same address modulo LINE (MKL then rounds as it did), its owners are re-pointed
        to it and `rehomed(old, new)` hears of it (a warm store's copy follows its bytes). Call it
        between calls, when every module points at its host tensors. Each home moves whole: an
        error leaves it where it was, still counted, and the arenas in place."""
        keep = max(0, cap_bytes) // self.arena_bytes
        if len(self._arenas) <= keep:
            return 0
        unpinned = sum(arena.numel() for arena in self._arenas[keep:])
        self._unpin_homes_in(self._arenas[keep:], rehomed)
        self._arenas = self._arenas[:keep]
        self._used = self.arena_bytes if self._arenas else 0  # the kept arenas' spare room is unknown: none is reused
        # No name in this frame refers to a dropped arena, a home in it or its owners (they live and die
        # in `_unpin_homes_in`): torch's host allocator frees them now instead of keeping one locked.
        release_cached_pinned()
        return unpinned

    def _unpin_homes_in(self, dropped: list[torch.Tensor], rehomed) -> None:
        """Move every home inside `dropped` to a pageable copy. A helper of its own so that its loop
        variables (the last home's owners, which view an arena) are gone when it returns."""
        moved = set()  # ids: Slot equality would compare the tensors, and a whole-list remove per home is quadratic
        try:
            for owners in [owners for owners in self._homes if _inside(owners[0].host, dropped)]:
                self._unpin(owners, rehomed)
                moved.add(id(owners))
        finally:  # a home moved before an error is no longer the pool's
            self._homes = [owners for owners in self._homes if id(owners) not in moved]
            self._forget_sources_of(moved)

    def _forget_sources_of(self, moved: set[int]) -> None:
        """No source may lead back to a moved home: it would keep its dropped arena locked."""
        for source in [source for source, (owners, _) in self._home_of.items() if id(owners) in moved]:
            del self._home_of[source]

    def _unpin(self, owners: list[Slot], rehomed) -> None:
        home = owners[0].host
        buffer = torch.empty(_nbytes(home) + LINE, dtype=torch.uint8)
        start = (home.data_ptr() - buffer.data_ptr()) % LINE
        pageable = buffer[start : start + _nbytes(home)].view(home.dtype).view(home.shape)
        pageable.copy_(home)
        for slot in owners:
            if _points_at(slot, home):
                slot.point_to(pageable)
        if rehomed is not None:
            rehomed(home, pageable)

    @property
    def spare_bytes(self) -> int:
        """Room left in the newest arena: new homes fill it before another arena is pinned."""
        return self.arena_bytes - self._used if self._arenas else 0

    def homed_bytes(self, tensors: Iterable[torch.Tensor]) -> int:
        """Bytes of those of `tensors` (each counted once) that already have a home here: streaming
        them again pins nothing new. A planner asks it of a tier's streamed tensors, since the pool
        may also hold homes of tensors the tier keeps resident (an earlier call on another tier)."""
        unique = {t.data_ptr(): t for t in tensors if self._holds(t)}  # homes never overlap
        return sum(_nbytes(t) for t in unique.values())

    def stats(self) -> dict:
        return {"pinned_bytes": self.pinned_bytes, "arenas": len(self._arenas), "allocations": self.allocations,
                "fallbacks": self.fallbacks, "file_backed": self.file_backed}

    def _adopt_one(self, owners: list[Slot], backend, cap_bytes: int, rehomed) -> list[Slot]:
        host = owners[0].host
        if type(host) is not torch.Tensor:  # a subclass stays as it is (module docstring)
            return owners
        if self._holds(host):
            return owners
        earlier = self._earlier_home(host)
        if earlier is not None:
            return self._join(earlier, owners)
        if is_file_backed(host):
            self._mapped.add(host.data_ptr())
            return owners
        home = self._allocate(host, backend, cap_bytes)
        if home is None:
            self._pageable.add(host.data_ptr())
            return owners
        self._pageable.discard(host.data_ptr())  # pinned now, under a ceiling raised since
        home.copy_(host)
        self.allocations += 1
        adopted = _point_owners(owners, home)
        self._homes.append(adopted)
        self._home_of[host] = (adopted, _bytes_seen(host))
        if rehomed is not None:
            rehomed(host, home)
        return adopted

    def _earlier_home(self, source: torch.Tensor) -> list[Slot] | None:
        """The owners of the home an earlier call made for `source`, unless `source` was written since.
        (Its owners then were re-pointed, not `source` itself: a LoRA registers it anew each call.)"""
        found = self._home_of.get(source)
        if found is None:
            return None
        earlier, seen = found
        if not _unchanged(source, seen, earlier[0].host):  # its bytes need a home of their own
            del self._home_of[source]
            return None
        return earlier

    @staticmethod
    def _join(earlier: list[Slot], owners: list[Slot]) -> list[Slot]:
        """`owners` point at the home in `earlier` and join its owners (those a past call dropped leave)."""
        home = earlier[0].host
        earlier[:] = [slot for slot in earlier if _points_at(slot, home)]
        adopted = _point_owners(owners, home)
        earlier.extend(adopted)
        return adopted

    def _allocate(self, host: torch.Tensor, backend, cap_bytes: int) -> torch.Tensor | None:
        size = host.numel() * host.element_size()
        if _skew(host) + size > self.arena_bytes:
            return None
        if not self._arenas or self._used + _skew(host) + size > self.arena_bytes:
            if self.pinned_bytes + self.arena_bytes > cap_bytes:
                return None
            try:
                arena = backend.pin_arena(self.arena_bytes)
            except RuntimeError:  # the driver refused to lock more memory
                return None
            if not self._arenas and not self._watched:  # when this pool goes, its arenas stay locked in torch's cache
                self._watched = weakref.finalize(self, note_pinned_dropped)
            self._arenas.append(arena)
            self._used = 0
        start = self._used + _skew(host)
        self._used = -(-(start + size) // ALIGN) * ALIGN
        return self._arenas[-1][start : start + size].view(host.dtype).view(host.shape)

    def _holds(self, tensor: torch.Tensor) -> bool:
        # a tensor subclass never has a home here (and a wrapper's data_ptr raises); a Parameter may
        return type(tensor) in (torch.Tensor, torch.nn.Parameter) and _inside(tensor, self._arenas)


def _point_owners(owners: list[Slot], home: torch.Tensor) -> list[Slot]:
    """`owners` re-pointed at `home` for good: slots whose host, restored after each call, is the home."""
    adopted = [Slot(s.module, s.name, s.is_parameter, home) for s in owners]
    for slot in adopted:
        slot.point_to(home)
    return adopted


def _version(tensor: torch.Tensor) -> int | None:
    """How many in-place writes `tensor` has seen; None for an inference tensor, which keeps no count."""
    return None if tensor.is_inference() else tensor._version


def _bytes_seen(tensor: torch.Tensor) -> tuple:
    """What says a source still holds the bytes its home was copied from: where they are (a `.data =`
    reassignment moves them without counting a write) and its count of in-place writes."""
    return tensor.data_ptr(), tensor.shape, tensor.stride(), tensor.dtype, _version(tensor)


def _unchanged(source: torch.Tensor, seen: tuple, home: torch.Tensor) -> bool:
    """Whether `source` still holds what its home was copied from. An inference tensor (ComfyUI runs every
    node under inference mode) counts no writes: its bytes are compared with the home's instead."""
    now = _bytes_seen(source)
    if now != seen:
        return False
    return now[-1] is not None or torch.equal(source, home)


def _points_at(slot: Slot, home: torch.Tensor) -> bool:
    """Whether `slot`'s module still holds `home` there (a call's LoRA buffers are gone after it)."""
    table = slot.module._parameters if slot.is_parameter else slot.module._buffers
    tensor = table.get(slot.name)
    return tensor is not None and tensor.data_ptr() == home.data_ptr()


def _inside(tensor: torch.Tensor, arenas: list[torch.Tensor]) -> bool:
    pointer = tensor.data_ptr()
    return any(a.data_ptr() <= pointer < a.data_ptr() + a.numel() for a in arenas)


# Staged copies (streamed and resident): chunks large enough that per-chunk overhead (an event, a
# query) is noise next to the copy (16 MiB is ~1 ms over PCIe 4), few enough slots that the CPU
# filling one overlaps the device reading the others.
RESIDENT_CHUNK_BYTES = 16 * MiB
RESIDENT_SLOTS = 4
# The streamed ring: a prefetch of several groups queues their chunks back to back on the side
# stream, so it may hold more slots in flight; 8 x 16 MiB = 128 MiB pinned at most.
MAX_STAGING_SLOTS = 8

# How a resident tensor reaches the device (`upload_route`).
PINNED, STAGED, PAGEABLE = "pinned", "staged", "pageable"


def upload_route(host: torch.Tensor, non_blocking: bool) -> str:
    """PINNED: already page-locked, copied straight and asynchronously. STAGED: plain contiguous
    host bytes (pageable or memory-mapped), copied through staging slots. PAGEABLE: copied
    synchronously as it is: wrapper subclasses (GGUF, torchao), whose bytes are not one buffer,
    and everything when `non_blocking` is off (the user asked for synchronous copies)."""
    if type(host) is not torch.Tensor or host.device.type != "cpu":
        return PAGEABLE
    if host.is_pinned():
        return PINNED
    return STAGED if non_blocking and host.is_contiguous() else PAGEABLE


@dataclass(eq=False)  # compared by identity
class _StagingSlot:
    buffer: torch.Tensor  # pinned uint8
    token: Any = None  # the device copy that reads this slot, until it is known to have finished


class StagingRing:
    """Pinned staging slots: host bytes (pageable or memory-mapped) -> slot -> device, by chunks.

    `upload` copies chunk after chunk into free slots on the CPU and queues each slot's device copy
    at once. A slot is reused only once the copy that reads it has finished (`finished(token)`,
    else `wait(token)` blocks the host on the oldest), so a new slot is made only while every
    existing one is in flight, and never more than `max_slots`, each rounded up to a power of two
    (as torch's pinned allocator rounds anyway) of at most RESIDENT_CHUNK_BYTES. Slots live as long
    as the backend, so later runs pin nothing new.

    A pin the driver refuses (WSL2's pinned limit, no RAM left to lock) is a host limit, never a
    device out-of-memory error: without any slot a pass is copied synchronously; with slots the
    ring carries on with those it has (smaller ones only cut the bytes into more chunks) and asks
    the driver again at the next pass, not at every chunk.
    """

    def __init__(self, pin: Callable[[int], torch.Tensor], finished: Callable[[Any], bool],
                 wait: Callable[[Any], None], max_slots: int = MAX_STAGING_SLOTS) -> None:
        self._pin, self._finished, self._wait = pin, finished, wait
        self._max_slots = max_slots
        self._slots: list[_StagingSlot] = []
        self._in_order: list[_StagingSlot] = []  # busy slots, oldest copy first
        self._refused = False  # the driver refused a pin during this pass: no new slot until the next
        self.staged_bytes = 0  # bytes copied through the slots, ever
        self.refusals = 0  # pins the driver refused (a pass with no slot at all is then copied synchronously)

    def __repr__(self) -> str:
        return f"StagingRing({len(self._slots)} slots, {self.pinned_bytes / GiB:.2f} GiB pinned)"

    @property
    def pinned_bytes(self) -> int:
        return sum(slot.buffer.numel() for slot in self._slots)

    @property
    def slots(self) -> int:
        return len(self._slots)

    def stats(self) -> dict:
        """For receipts: what staging holds pinned, and how much it has carried."""
        return {"slots": self.slots, "pinned_bytes": self.pinned_bytes, "staged_bytes": self.staged_bytes}

    def upload(self, hosts: list[torch.Tensor], device: torch.device, non_blocking: bool,
               mark: Callable[[], Any]) -> tuple[list[torch.Tensor], UploadRoutes]:
        """Copy `hosts` (a whole component, or a streamed group) to `device` on the current stream,
        each by its `upload_route`; returns the device tensors and the bytes that took each route.

        Staged tensors are cut into chunks packed into this ring's slots: each chunk is copied on
        the CPU into a slot, then to its place in the device tensor asynchronously; a full slot
        is handed back with `mark()`, a token that finishes once the copies queued so far have,
        and is filled again only after that (`_acquire`). A ring that cannot pin its first slot
        (the driver refused: WSL2's pinned limit, no free RAM) copies them synchronously instead,
        and says so in the routes.
        """
        self._refused = False  # memory may have been unlocked since the last refusal: ask again
        routes = [upload_route(host, non_blocking) for host in hosts]
        staged = sum(_aligned(_nbytes(h)) for h, r in zip(hosts, routes) if r == STAGED)
        if staged and not self._has_a_slot(min(staged, RESIDENT_CHUNK_BYTES)):
            routes = [PAGEABLE if route == STAGED else route for route in routes]
            staged = 0
        chunks = _Chunks(self, mark, staged)
        try:
            tensors = [_upload_one(host, route, device, chunks) for host, route in zip(hosts, routes)]
        finally:  # even when a copy fails (out of memory): the slot in use waits for what it queued
            chunks.flush()
        return tensors, UploadRoutes(*(_route_bytes(hosts, routes, route) for route in (PINNED, STAGED, PAGEABLE)))

    def release_after(self, slot: _StagingSlot, token: Any) -> None:
        """`slot` may be reused once the copy behind `token` has finished."""
        slot.token = token
        self._in_order.append(slot)

    def _has_a_slot(self, nbytes: int) -> bool:
        """At least one slot, pinned now if need be; False when the driver refuses to pin it."""
        if not self._slots:
            slot = self._pin_slot(nbytes)
            if slot is None:
                return False
            self._slots.append(slot)
        return True

    def _acquire(self, nbytes: int) -> _StagingSlot:
        """A free slot for a chunk of up to `nbytes` (the ring has at least one: `_has_a_slot`): the
        smallest free one that fits, else a new one pinned (in place of a free one too small, or while
        under `max_slots`), else the largest free one, else the oldest busy one once its copy has
        finished. The last two may be smaller than `nbytes`: `_Chunks` then sends more, smaller chunks."""
        while True:
            free = [slot for slot in self._slots if self._is_free(slot)]
            fitting = [slot for slot in free if slot.buffer.numel() >= nbytes]
            if fitting:
                return min(fitting, key=_slot_bytes)
            if free or len(self._slots) < self._max_slots:
                slot = self._pin_slot(nbytes)  # pinned before a small slot is dropped: a refusal keeps it
                if slot is not None:
                    if free:  # the small free slot gives its place to the bigger one (count stays bounded)
                        self._slots.remove(min(free, key=_slot_bytes))
                    self._slots.append(slot)
                    return slot
                if free:
                    return max(free, key=_slot_bytes)
            self._free_oldest()

    def _pin_slot(self, nbytes: int) -> _StagingSlot | None:
        """A new slot, or None when the driver refuses to pin it (counted, and not asked again this pass).
        The refusal reads "CUDA error: out of memory", which the sampler's ladder would take for the
        device's own: it must not leave here as an error."""
        if self._refused:
            return None
        try:
            return _StagingSlot(self._pin(_power_of_two(nbytes)))
        except RuntimeError:
            self.refusals += 1
            self._refused = True
            return None

    def _free_oldest(self) -> None:
        """Block the host until the oldest busy slot's copy has finished."""
        oldest = self._in_order[0] if self._in_order else self._slots[0]
        if oldest.token is not None:
            self._wait(oldest.token)
        self._mark_free(oldest)

    def _is_free(self, slot: _StagingSlot) -> bool:
        if slot.token is not None and self._finished(slot.token):
            self._mark_free(slot)
        return slot.token is None

    def _mark_free(self, slot: _StagingSlot) -> None:
        slot.token = None
        if slot in self._in_order:
            self._in_order.remove(slot)


def _slot_bytes(slot: _StagingSlot) -> int:
    return slot.buffer.numel()


def _upload_one(host: torch.Tensor, route: str, device: torch.device, chunks: "_Chunks") -> torch.Tensor:
    if route == PINNED:
        return host.to(device, non_blocking=True)
    if route == PAGEABLE:
        return host.to(device)  # synchronous: torch never reads pageable memory behind the CPU's back
    target = torch.empty_like(host, device=device)
    chunks.send(_as_bytes(host), _as_bytes(target))
    return target


class _Chunks:
    """One pass of bytes through a ring's slots: a slot is filled on the CPU piece by piece, each
    piece copied out asynchronously at once; a full slot goes back to the ring with the token of
    its last copy, and the next piece takes a free slot. `total` counts each tensor's bytes
    rounded up to ALIGN, as they are packed, so a group smaller than a chunk takes one slot."""

    def __init__(self, ring: StagingRing, mark: Callable[[], Any], total: int) -> None:
        self._ring, self._mark, self._left = ring, mark, total
        self._slot: _StagingSlot | None = None
        self._used = 0  # bytes of the current slot already filled

    def send(self, source: torch.Tensor, target: torch.Tensor) -> None:
        """Copy the bytes of `source` (uint8, host) into `target` (uint8, device)."""
        offset = 0
        while offset < source.numel():
            space = self._space(source.numel() - offset)
            take = min(source.numel() - offset, space.numel())
            space[:take].copy_(source[offset : offset + take])
            target[offset : offset + take].copy_(space[:take], non_blocking=True)  # from pinned memory
            packed = _aligned(self._used + take)
            self._left -= packed - self._used
            self._used = packed
            self._ring.staged_bytes += take
            offset += take

    def flush(self) -> None:
        if self._slot is not None:
            self._ring.release_after(self._slot, self._mark())
            self._slot = None

    def _space(self, needed: int) -> torch.Tensor:
        if self._slot is not None and self._used < self._slot.buffer.numel():
            return self._slot.buffer[self._used :]
        self.flush()
        self._slot, self._used = self._ring._acquire(min(max(self._left, needed), RESIDENT_CHUNK_BYTES)), 0
        return self._slot.buffer


def _route_bytes(hosts: list[torch.Tensor], routes: list[str], route: str) -> int:
    return sum(_nbytes(host) for host, taken in zip(hosts, routes) if taken == route)


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(-1).view(torch.uint8)  # a view: the tensor is contiguous


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _skew(tensor: torch.Tensor) -> int:
    """Where `tensor` starts within a LINE-byte line: its copy starts at the same place in its own."""
    return tensor.data_ptr() % LINE


def _power_of_two(nbytes: int) -> int:
    return 1 << max(nbytes - 1, 1).bit_length()
