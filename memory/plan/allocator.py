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
  segment and retries, as the allocator does before raising out-of-memory.

Constants and rules: c10/cuda/CUDACachingAllocator.cpp (`kMinBlockSize`, `kSmallSize`,
`kSmallBuffer`, `kLargeBuffer`, `kMinLargeAlloc`, `kRoundLarge`, `get_free_block`, `should_split`),
with the default configuration (no max_split_size, no expandable segments, one stream).
"""

from __future__ import annotations

import bisect
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


class CachingAllocatorModel:
    def __init__(self, capacity: int | None = None) -> None:
        self.capacity = capacity
        self.allocated = self.reserved = 0
        self.peak_allocated = self.peak_reserved = 0
        self.out_of_memory = False
        self._free: dict[bool, list[tuple[int, int, int, _Block]]] = {True: [], False: []}
        self._segments: dict[int, _Block] = {}  # segment id -> its first block
        self._live: dict[int, _Block] = {}
        self._next_segment = 0

    def malloc(self, handle: int, nbytes: int) -> None:
        size = MIN_BLOCK if nbytes < MIN_BLOCK else -(-nbytes // MIN_BLOCK) * MIN_BLOCK
        small = size <= SMALL_SIZE
        block = self._take_free(size, small) or self._new_segment(size, small)
        remaining = block.size - size
        if remaining >= MIN_BLOCK if small else remaining > SMALL_SIZE:
            rest = _Block(remaining, block.offset + size, block.segment, small, prev=block, next=block.next)
            if block.next is not None:
                block.next.prev = rest
            block.next, block.size = rest, size
            self._insert_free(rest)
        block.free = False
        self._live[handle] = block
        self.allocated += block.size
        self.peak_allocated = max(self.peak_allocated, self.allocated)

    def free(self, handle: int) -> None:
        block = self._live.pop(handle)
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
        return AllocatorPeak(self.peak_allocated, self.peak_reserved, self.out_of_memory)

    def _take_free(self, size: int, small: bool) -> _Block | None:
        pool = self._free[small]
        index = bisect.bisect_left(pool, (size, -1, -1))
        return pool.pop(index)[3] if index < len(pool) else None

    def _new_segment(self, size: int, small: bool) -> _Block:
        segment_size = SMALL_BUFFER if small else LARGE_BUFFER if size < MIN_LARGE_ALLOC else -(-size // ROUND_LARGE) * ROUND_LARGE
        if self.capacity is not None and self.reserved + segment_size > self.capacity:
            self._release_cached()
            if self.reserved + segment_size > self.capacity:
                self.out_of_memory = True
        self._next_segment += 1
        block = _Block(segment_size, 0, self._next_segment, small)
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
        bisect.insort(self._free[block.small], (*block.key(), block))

    def _remove_free(self, block: _Block) -> None:
        pool = self._free[block.small]
        pool.pop(bisect.bisect_left(pool, block.key()))


def replay(resident: Iterable[int], events: tuple[int, ...], capacity: int | None = None,
           held: Iterable[int] = ()) -> AllocatorPeak:
    """Allocate `held` and `resident` tensors (weights) first, then replay a trace's event stream.

    `held`: blocks freed but not yet reusable, so in segments and never in `allocated`: a streamed
    group evicted while the GPU may still read it (its memory is marked with `record_stream`, and
    the caching allocator hands it out again only once the compute stream has passed that point).
    Memoised: tiers that leave the same tensors resident replay the same stream once.
    """
    return _replay(tuple(resident), tuple(events), capacity, tuple(held))


@lru_cache(maxsize=256)
def _replay(resident: tuple[int, ...], events: tuple[int, ...], capacity: int | None,
            held: tuple[int, ...] = ()) -> AllocatorPeak:
    model = CachingAllocatorModel(capacity)
    for index, nbytes in enumerate(held):
        model.malloc(-1 - len(resident) - index, nbytes)
    model.allocated = model.peak_allocated = 0  # in segments, not in torch's allocated counter
    handle = 0
    for nbytes in resident:
        model.malloc(-1 - handle, nbytes)
        handle += 1
    count = 0
    for event in events:
        if event > 0:
            model.malloc(count, event)
            count += 1
        else:
            model.free(-event - 1)
    return model.peak()
