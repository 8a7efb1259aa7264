"""What PyTorch's CUDA caching allocator would reserve for a stream of allocations.

Tensor bytes alone understate what a run needs: the caching allocator carves blocks out of
segments it got from cudaMalloc, never moves them, and a later, larger request that fits no free
block gets a new segment even when enough memory is free in pieces. For video models this is
large (a VAE decode that keeps ~15 GiB of tensors can reserve ~21 GiB), so the planner replays
each stage's allocation stream through a model of the allocator:

- sizes round up to 512 bytes; requests up to 1 MiB come from 2 MiB "small" segments, requests up
  to 10 MiB from 20 MiB segments, larger ones get their own segment rounded up to 2 MiB;
- a request takes the smallest free block that fits in its pool (best fit) and splits off the
  rest when more than 512 bytes (small pool) or 1 MiB (large pool) remain;
- freed blocks merge with free neighbours in their segment; segments are kept (cached);
- with a `capacity`, a request that would exceed it first releases every fully free cached
  segment and retries, as the allocator does before raising out-of-memory;
- a block belongs to the stream it was allocated on: once freed, only that stream's requests
  reuse it (vidmem copies streamed weights on a side stream, so they never share segments with
  activations); a block freed while another stream may still read it (`record_stream`) leaves
  `allocated` at once but is reused only once that stream has passed it.

Constants and rules: c10/cuda/CUDACachingAllocator.cpp (`kMinBlockSize`, `kSmallSize`,
`kSmallBuffer`, `kLargeBuffer`, `kMinLargeAlloc`, `kRoundLarge`, `get_free_block`, `should_split`,
`free` with `stream_uses`), with the default configuration (no max_split_size, no expandable
segments).
"""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass
from functools import lru_cache
from typing import Iterable

MIN_BLOCK = 512
SMALL_SIZE = 1 << 20
SMALL_BUFFER = 2 << 20
LARGE_BUFFER = 20 << 20
MIN_LARGE_ALLOC = 10 << 20
ROUND_LARGE = 2 << 20


@dataclass
class _Block:
    size: int
    offset: int
    segment: int
    small: bool
    stream: int = 0
    free: bool = True
    prev: "_Block | None" = None
    next: "_Block | None" = None

    def key(self) -> tuple[int, int, int]:
        return (self.size, self.segment, self.offset)


@dataclass(frozen=True)
class AllocatorPeak:
    allocated: int  # peak of bytes in live blocks (what torch.cuda.max_memory_allocated reports)
    reserved: int  # peak of bytes in segments (what torch.cuda.max_memory_reserved reports)
    out_of_memory: bool = False  # a request could not be met within `capacity`
    active: int = 0  # peak of live blocks and freed ones another stream still reads (torch's active_bytes)


class CachingAllocatorModel:
    def __init__(self, capacity: int | None = None) -> None:
        self.capacity = capacity
        self.allocated = self.reserved = self.held_bytes = 0
        self.peak_allocated = self.peak_reserved = self.peak_active = 0
        self.out_of_memory = False
        self._free: dict[tuple[int, bool], list[tuple[int, int, int, _Block]]] = {}  # (stream, small) -> blocks
        self._segments: dict[int, _Block] = {}  # segment id -> its first block
        self._live: dict[int, _Block] = {}
        self._held: set[int] = set()  # handles freed but still read by another stream
        self._next_segment = 0

    def malloc(self, handle: int, nbytes: int, stream: int = 0) -> None:
        size = MIN_BLOCK if nbytes < MIN_BLOCK else -(-nbytes // MIN_BLOCK) * MIN_BLOCK
        small = size <= SMALL_SIZE
        block = self._take_free(size, small, stream) or self._new_segment(size, small, stream)
        remaining = block.size - size
        if remaining >= MIN_BLOCK if small else remaining > SMALL_SIZE:
            rest = _Block(remaining, block.offset + size, block.segment, small, stream, prev=block, next=block.next)
            if block.next is not None:
                block.next.prev = rest
            block.next, block.size = rest, size
            self._insert_free(rest)
        block.free = False
        self._live[handle] = block
        self.allocated += block.size
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        self.peak_active = max(self.peak_active, self.allocated + self.held_bytes)

    def hold(self, handle: int) -> None:
        """Free `handle` while another stream may still read it: out of `allocated` now, its block
        reusable only after `free` (torch: `record_stream`, the block's events not yet complete)."""
        self.allocated -= self._live[handle].size
        self.held_bytes += self._live[handle].size
        self._held.add(handle)

    def free(self, handle: int) -> None:
        block = self._live.pop(handle)
        if handle in self._held:
            self._held.discard(handle)
            self.held_bytes -= block.size
        else:
            self.allocated -= block.size
        block.free = True
        for neighbour in (block.prev, block.next):
            if neighbour is None or not neighbour.free:
                continue
            self._remove_free(neighbour)
            first, second = (neighbour, block) if neighbour is block.prev else (block, neighbour)
            first.size += second.size
            first.next = second.next
            if second.next is not None:
                second.next.prev = first
            block = first
        self._insert_free(block)

    def peak(self) -> AllocatorPeak:
        return AllocatorPeak(self.peak_allocated, self.peak_reserved, self.out_of_memory, self.peak_active)

    def _take_free(self, size: int, small: bool, stream: int) -> _Block | None:
        pool = self._free.get((stream, small), [])
        index = bisect.bisect_left(pool, (size, -1, -1))
        return pool.pop(index)[3] if index < len(pool) else None

    def _new_segment(self, size: int, small: bool, stream: int = 0) -> _Block:
        segment_size = SMALL_BUFFER if small else LARGE_BUFFER if size < MIN_LARGE_ALLOC else -(-size // ROUND_LARGE) * ROUND_LARGE
        if self.capacity is not None and self.reserved + segment_size > self.capacity:
            self._release_cached()
            if self.reserved + segment_size > self.capacity:
                self.out_of_memory = True
        self._next_segment += 1
        block = _Block(segment_size, 0, self._next_segment, small, stream)
        self._segments[block.segment] = block
        self.reserved += segment_size
        self.peak_reserved = max(self.peak_reserved, self.reserved)
        return block

    def _release_cached(self) -> None:
        """Return every segment that is one free block to the driver (cudaFree)."""
        for pool in self._free.values():
            whole = [entry for entry in pool if entry[3].prev is None and entry[3].next is None]
            for entry in whole:
                pool.remove(entry)
                self.reserved -= entry[3].size
                del self._segments[entry[3].segment]

    def _insert_free(self, block: _Block) -> None:
        bisect.insort(self._free.setdefault((block.stream, block.small), []), (*block.key(), block))

    def _remove_free(self, block: _Block) -> None:
        pool = self._free[(block.stream, block.small)]
        pool.pop(bisect.bisect_left(pool, block.key()))


ONLOAD, FREE, EVICT, RELEASE = range(4)  # WeightTimeline moves
COPY_STREAM = 1  # the stream streamed weights are copied on (the compute stream is 0)


@dataclass(frozen=True)
class WeightTimeline:
    """Weights allocated and freed between a call's own allocations, by a tier that moves them
    module by module while the call runs (`schedule.stream_timeline`).

    `groups[g]`: the bytes of group g's tensors; `copied[g]`: allocated on the copy stream (a
    streamed group) rather than the compute stream (a layer's upcast workspace). `start`: the groups
    on the device before the first event, each as (group, held: evicted, still read; oldest first).
    `moves`: (position, op, group),
    applied in order before event `position`: ONLOAD allocates the group, FREE frees it, EVICT frees
    it while the GPU may still read it (`CachingAllocatorModel.hold`), RELEASE returns the group's
    oldest evicted copy to its pool.
    """

    groups: tuple[tuple[int, ...], ...]
    copied: tuple[bool, ...]
    start: tuple[tuple[int, bool], ...] = ()
    moves: tuple[tuple[int, int, int], ...] = ()


def replay(resident: Iterable[int], events: tuple[int, ...], capacity: int | None = None,
           held: Iterable[int] = (), timeline: WeightTimeline | None = None) -> AllocatorPeak:
    """Allocate `held` and `resident` tensors (weights) first, then replay a trace's event stream.

    `held`: blocks freed but not yet reusable, so in segments and never in `allocated`: a streamed
    group evicted while the GPU may still read it (its memory is marked with `record_stream`, and
    the caching allocator hands it out again only once the compute stream has passed that point).
    `timeline`: weights that come and go between the events (the sequential tier's leaves).
    Memoised: tiers that leave the same tensors resident replay the same stream once.
    """
    return _replay(tuple(resident), tuple(events), capacity, tuple(held), timeline)


@lru_cache(maxsize=256)
def _replay(resident: tuple[int, ...], events: tuple[int, ...], capacity: int | None,
            held: tuple[int, ...] = (), timeline: WeightTimeline | None = None) -> AllocatorPeak:
    model = CachingAllocatorModel(capacity)
    for index, nbytes in enumerate(held):
        model.malloc(-1 - len(resident) - index, nbytes)
    model.allocated = model.peak_allocated = model.peak_active = 0  # in segments, not in torch's allocated counter
    handle = 0
    for nbytes in resident:
        model.malloc(-1 - handle, nbytes)
        handle += 1
    moving = _Moving(model, timeline, -1 - len(resident) - len(held)) if timeline is not None else None
    moves = timeline.moves if timeline is not None else ()
    applied = count = 0
    for index, event in enumerate(events):
        while applied < len(moves) and moves[applied][0] <= index:
            moving.apply(moves[applied])
            applied += 1
        if event > 0:
            model.malloc(count, event)
            count += 1
        else:
            model.free(-event - 1)
    for move in moves[applied:]:
        moving.apply(move)
    return model.peak()


class _Moving:
    """A WeightTimeline's groups in the allocator model: live copies, and evicted ones still read."""

    def __init__(self, model: CachingAllocatorModel, timeline: WeightTimeline, first_handle: int) -> None:
        self.model, self.timeline, self.next_handle = model, timeline, first_handle
        self.on: dict[int, list[int]] = {}
        self.held: dict[int, deque] = {}
        for group, still_read in timeline.start:
            if not still_read:
                self.apply((0, ONLOAD, group))
                continue
            handles = [self._malloc(nbytes, self._stream(group)) for nbytes in timeline.groups[group]]
            for handle in handles:
                model.hold(handle)
            self.held.setdefault(group, deque()).append(handles)

    def apply(self, move: tuple[int, int, int]) -> None:
        _, op, group = move
        if op == ONLOAD and group not in self.on:
            self.on[group] = [self._malloc(nbytes, self._stream(group)) for nbytes in self.timeline.groups[group]]
        elif op in (FREE, EVICT) and group in self.on:
            handles = self.on.pop(group)
            for handle in handles:
                (self.model.free if op == FREE else self.model.hold)(handle)
            if op == EVICT:
                self.held.setdefault(group, deque()).append(handles)
        elif op == RELEASE and self.held.get(group):
            for handle in self.held[group].popleft():
                self.model.free(handle)

    def _stream(self, group: int) -> int:
        return COPY_STREAM if self.timeline.copied[group] else 0

    def _malloc(self, nbytes: int, stream: int) -> int:
        handle, self.next_handle = self.next_handle, self.next_handle - 1
        self.model.malloc(handle, nbytes, stream)
        return handle
