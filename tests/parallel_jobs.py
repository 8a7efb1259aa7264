"""Small jobs for the worker-pool tests (a module of their own: spawned ranks import them by name)."""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class SumRanks:
    """All-reduce of (rank + 1): proves the ranks share one group; counts runs in the rank's state."""

    def run(self, context):
        value = torch.tensor([float(context.rank + 1)])
        dist.all_reduce(value)
        context.state["runs"] = context.state.get("runs", 0) + 1
        context.progress(1, 1)
        return {"sum": value.item(), "runs": context.state["runs"], "pid": os.getpid()}


@dataclass(frozen=True)
class RaiseOn:
    rank: int
    message: str

    def run(self, context):
        if context.rank == self.rank:
            raise ValueError(self.message)
        dist.barrier()  # the other ranks wait here, as in a collective of a real forward
        return None


@dataclass(frozen=True)
class DieOn:
    rank: int

    def run(self, context):
        if context.rank == self.rank:
            os._exit(3)
        dist.barrier()
        return None


@dataclass(frozen=True)
class KilledOn:
    """SIGKILL, as the out-of-memory killer sends it."""

    rank: int

    def run(self, context):
        if context.rank == self.rank:
            os.kill(os.getpid(), signal.SIGKILL)
        dist.barrier()
        return None


@dataclass(frozen=True)
class SilentDeathAmidNews:
    """Rank 1 raises at once (as a peer whose collective broke does), rank 2 dies without a word a
    moment later (as the out-of-memory killer ends a rank), then rank 0 reports progress at a step
    numbered like the dead rank: the rank to blame is the silent one."""

    def run(self, context):
        if context.rank == 1:
            raise ConnectionError("peer closed the connection")
        if context.rank == 2:
            time.sleep(0.3)
            os._exit(9)
        time.sleep(0.6)
        context.progress(2, 3)
        time.sleep(30)  # stopped by the coordinator


@dataclass(frozen=True)
class Steps:
    """`steps` steps of `seconds` each, reporting progress and checking Cancel between them."""

    steps: int
    seconds: float

    def run(self, context):
        for step in range(self.steps):
            time.sleep(self.seconds)
            context.check_stop()
            context.progress(step + 1, self.steps)
        return self.steps


@dataclass(frozen=True)
class CountTokens:
    """Runs a ParallelSampleJob and records, per denoiser, the token counts entering its blocks[1] in
    every rank (diffusers splits inside blocks[0]'s forward wrapper, so blocks[1] sees a rank's share):
    per rank {denoiser: sorted counts}; a denoiser that never ran is absent."""

    job: object  # a vidmem.pipelines.parallel.ParallelSampleJob

    def run(self, context):
        loaded = self.job._pipeline(context)
        seen: dict[str, set] = {}
        handles = [getattr(loaded.pipe, name).blocks[1].register_forward_pre_hook(
            lambda module, args, name=name: seen.setdefault(name, set()).add(int(args[0].shape[1])))
            for name in loaded.spec.denoisers if getattr(loaded.pipe, name, None) is not None]
        try:
            self.job.run(context)
        finally:
            for handle in handles:
                handle.remove()
        every = [None] * context.world_size
        dist.all_gather_object(every, {name: sorted(counts) for name, counts in seen.items()})
        return every


@dataclass(frozen=True)
class KeepBytes:
    """Each rank keeps `per_rank[rank]` bytes in a warm store of its own (in the rank's state, as a
    rank's pipeline keeps its stores), as device copies a sampling run leaves behind; returns
    what every rank keeps (the collective the coordinator's stand-ins read)."""

    per_rank: tuple[int, ...]

    def run(self, context):
        from vidmem.memory.parallel.kept import gather_kept
        from vidmem.memory.warm import STREAMED, WarmStore

        store = context.state.setdefault("store", WarmStore(f"rank {context.rank}"))
        hosts = context.state.setdefault("hosts", [])  # held: a kept copy's key is its host's address
        for _ in range(self.per_rank[context.rank] // 1024):
            hosts.append(torch.zeros(256))
            store.keep([(hosts[-1], torch.zeros(256))], STREAMED)
        return gather_kept(context)
