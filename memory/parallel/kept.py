"""Context-parallel ranks' warm stores, as the coordinator's memory manager sees them.

Each rank's `sample()` has its own WarmStore, which can keep weights on the rank's GPU between runs
as a one-GPU run's does. That memory lives in another process, so ComfyUI could neither count it nor
take it back, and Free VRAM (memory/warm.py `release_everywhere`) reached only the coordinator's
own stores. Now the coordinator holds one stand-in per rank (`RankStore`): it joins the live
stores, so `kept_everywhere` counts it and `release_everywhere` reaches it, and the host registers
it like any store (nodes/host.py, through `make_room(..., warm=stand_in)`). What a stand-in holds is
what its rank reported at the end of the last job (`RankStores.update`); nothing while the ranks
are down (a closed pool's processes took their memory with them).

Giving memory back sends a `ReleaseJob` through the rank pool: the pool runs every job on every
rank in lockstep, so each rank releases its own share from its stores (streamed blocks first, as a
store does) and they gather what each still keeps. While a run is in flight the pool is taken: a
request from another thread is refused with WarmStoreBusy, as a store's is mid-call, and applied
when the run ends. A request never starts ranks that are down.

(While `ParallelSampleJob` ends each job with `memory.cleanup.free_memory`, which drops every live
store, the ranks report 0 kept: see docs/warm-runs.md, "Context-parallel ranks' warm stores".)
"""

from __future__ import annotations

import logging
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator

import torch
import torch.distributed as dist

from ..units import GiB
from ..warm import WarmStoreBusy, kept_everywhere, release_up_to, track
from .pool import RankError

log = logging.getLogger("vidmem")


@dataclass(frozen=True)
class ReleaseJob:
    """Run on every rank: rank r gives back up to `nbytes[r]` of what its stores keep; returns (on
    rank 0) the bytes each rank still keeps."""

    nbytes: tuple[int, ...]

    def run(self, context) -> tuple[int, ...]:
        release_up_to(self.nbytes[context.rank])
        return gather_kept(context)


def gather_kept(context) -> tuple[int, ...]:
    """What every rank's stores keep now, gathered on every rank (a collective: all ranks call it)."""
    kept = [0] * context.world_size
    dist.all_gather_object(kept, kept_everywhere())
    return tuple(kept)


class RankStores:
    """The stand-ins for one pool's ranks, and the lock that keeps their requests off a running job.

    `devices[r]` is rank r's device as this process numbers it; `pool` runs jobs on the ranks
    (`memory.parallel.WorkerPool`: `run(job)` and `alive`).
    """

    def __init__(self, pool, devices: list[torch.device], label: str = "context-parallel rank") -> None:
        self.pool = pool
        self.stores = [RankStore(f"{label} {rank} ({device})", device, rank, self)
                       for rank, device in enumerate(devices)]
        self._lock = threading.RLock()  # held by the thread running a job; re-entered by its own requests
        self._deferred = [0] * len(devices)  # bytes asked for per rank during a run on another thread

    def __repr__(self) -> str:
        held = ", ".join(f"{store.held_bytes / GiB:.2f}" for store in self.stores)
        return f"RankStores({len(self.stores)} ranks, GiB kept: {held})"

    @contextmanager
    def running(self) -> Iterator["RankStores"]:
        """For the length of one job on the ranks: other threads' requests wait for its end."""
        with self._lock:
            try:
                yield self
            finally:
                deferred, self._deferred = self._deferred, [0] * len(self.stores)
                if any(deferred):
                    self._send(deferred)

    def update(self, kept: tuple[int, ...] | list[int] | None) -> None:
        """What each rank keeps now, as the ranks reported it (None: not reported, nothing known kept)."""
        for store, nbytes in zip(self.stores, kept or [0] * len(self.stores)):
            store.kept = int(nbytes)

    def release(self, rank: int, nbytes: int) -> int:
        """Ask rank `rank` to give back up to `nbytes`; returns the bytes it dropped."""
        store = self.stores[rank]
        if not self._lock.acquire(blocking=False):
            self._deferred[rank] = max(self._deferred[rank], nbytes)
            raise WarmStoreBusy(f"vidmem: {store.label} is running a job and cannot give memory back mid-run; it "
                                f"will release {min(nbytes, store.held_bytes) / GiB:.2f} GiB when the run ends.")
        try:
            before = store.held_bytes
            if before == 0 or nbytes <= 0:
                return 0
            self._send([nbytes if r == rank else 0 for r in range(len(self.stores))])
            freed = max(0, before - store.held_bytes)
            store.released_bytes += freed
            return freed
        finally:
            self._lock.release()

    def _send(self, nbytes: list[int]) -> None:
        if not self.pool.alive:  # the ranks are down: their memory went with them; never start them for this
            self.update(None)
            return
        try:
            self.update(self.pool.run(ReleaseJob(tuple(nbytes))))
        except RankError as failure:
            # The pool closed itself: the ranks, and all they kept, are gone. Never raise into the
            # host's memory manager for that (nodes/host.py gives back, it does not fail).
            log.warning("vidmem: the ranks stopped while giving memory back (%s); they hold nothing now", failure)
            self.update(None)


@dataclass(eq=False)  # compared by identity: held in the set of live stores
class RankStore:
    """One rank's kept device memory, in the coordinator: what a WarmStore offers the host
    (`held_bytes`, `release`, `release_all`, `label`, `device`, `host_entry`), answered by the rank."""

    label: str
    device: torch.device
    rank: int
    group: RankStores = field(repr=False)
    kept: int = 0  # what the rank reported it keeps
    released_bytes: int = 0  # given back at the host's request, ever
    host_entry: object | None = None  # what the host registered for this store, kept alive with it

    def __post_init__(self) -> None:
        track(self)

    @property
    def held_bytes(self) -> int:
        return self.kept if self.group.pool.alive else 0

    def release(self, nbytes: int) -> int:
        return self.group.release(self.rank, nbytes)

    def release_all(self) -> int:
        return self.release(self.held_bytes + 1) if self.held_bytes else 0
