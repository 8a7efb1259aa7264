"""Context-parallel ranks' warm stores, seen from the coordinator (memory/parallel/kept.py).

With real gloo ranks: what each rank keeps reaches its stand-in, the live-store totals count it,
a stand-in's release reaches its own rank only, Free VRAM (`release_everywhere`) empties every
rank, and ranks that are down hold nothing. Without processes: a request while a run is in flight
on another thread is refused and applied at the run's end; `sample_parallel` registers a stand-in
per rank GPU with the host (weights planned per GPU) and records what the ranks reported.
"""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch

from parallel_jobs import KeepBytes
from vidmem.memory import MemoryStrategy
from vidmem.memory.parallel import PoolConfig, WorkerPool
from vidmem.memory.parallel.kept import RankStores, ReleaseJob
from vidmem.memory.strategy import Parallelism
from vidmem.memory.warm import WarmStoreBusy, kept_everywhere, release_everywhere
from vidmem.pipelines.sample import SampleRequest, SampleResult

KIB = 1024


@pytest.fixture(scope="module")
def pool():
    with WorkerPool(PoolConfig.for_cpu(2, threads=1, join_timeout_s=5.0)) as pool:
        yield pool


def keep(stores: RankStores, per_rank: tuple[int, ...]) -> None:
    with stores.running():
        stores.update(stores.pool.run(KeepBytes(per_rank)))


def test_ranks_kept_bytes_are_counted_released_per_rank_and_freed_everywhere(pool):
    stores = RankStores(pool, [torch.device("cpu")] * 2)
    before = kept_everywhere()
    keep(stores, (4 * KIB, 8 * KIB))
    assert [s.held_bytes for s in stores.stores] == [4 * KIB, 8 * KIB]
    assert kept_everywhere() - before == 12 * KIB  # the host's meter sees the ranks' memory

    freed = stores.stores[1].release(3 * KIB)  # a ComfyUI entry's partial unload: rank 1 only
    assert freed >= 3 * KIB and stores.stores[1].held_bytes == 8 * KIB - freed
    assert stores.stores[0].held_bytes == 4 * KIB and stores.stores[1].released_bytes == freed

    release_everywhere()  # Free VRAM
    assert [s.held_bytes for s in stores.stores] == [0, 0]
    assert pool.run(KeepBytes((0, 0))) == (0, 0)  # the ranks themselves say so


def test_ranks_that_are_down_hold_nothing_and_are_not_started_to_give_back():
    pool = WorkerPool(PoolConfig.for_cpu(2, threads=1, join_timeout_s=5.0))
    stores = RankStores(pool, [torch.device("cpu")] * 2)
    keep(stores, (2 * KIB, 2 * KIB))
    assert stores.stores[0].held_bytes == 2 * KIB
    pool.close()
    assert [s.held_bytes for s in stores.stores] == [0, 0] and stores.stores[0].release_all() == 0
    assert not pool.alive and pool.pids == []


class ScriptedPool:
    """A pool without processes: records jobs; a release leaves each rank `nbytes` fewer bytes."""

    def __init__(self, kept: list[int]) -> None:
        self.kept, self.jobs, self.alive = list(kept), [], True

    def run(self, job, *args):
        self.jobs.append(job)
        if isinstance(job, ReleaseJob):
            self.kept = [max(0, k - n) for k, n in zip(self.kept, job.nbytes)]
            return tuple(self.kept)
        return SampleResult({"samples": torch.zeros(1)}, {"parallel": {"per_rank_kept_bytes": list(self.kept)}})


def test_a_request_during_a_run_is_refused_and_applied_when_it_ends():
    pool = ScriptedPool([5 * KIB, 7 * KIB])
    stores = RankStores(pool, [torch.device("cpu")] * 2)
    stores.update(pool.kept)
    refused = []

    def from_another_thread():
        try:
            stores.stores[1].release(KIB)
        except WarmStoreBusy as refusal:
            refused.append(str(refusal))

    with stores.running():
        other = threading.Thread(target=from_another_thread)
        other.start()
        other.join()
        assert refused and "mid-run" in refused[0] and pool.jobs == []  # nothing sent while the run holds the ranks
    assert pool.jobs == [ReleaseJob((0, KIB))]  # applied at the end
    assert [s.held_bytes for s in stores.stores] == [5 * KIB, 6 * KIB]


def test_sample_parallel_registers_a_stand_in_per_rank_gpu_and_records_what_ranks_keep(tiny_loaded, monkeypatch):
    from vidmem.pipelines.hooks import RunHooks
    from vidmem.pipelines.parallel import Ranks, ranks as ranks_module, run
    from vidmem.pipelines.parallel.planning import plan_explicit
    from vidmem.memory.plan.stages import VideoShape

    monkeypatch.setattr(ranks_module.dist, "is_nccl_available", lambda: True)
    loaded, asked = tiny_loaded("wan2.1-t2v"), []
    pool = ScriptedPool([3 * KIB, 9 * KIB])
    pool.config = SimpleNamespace(world_size=2)
    hooks = RunHooks(make_room=lambda nbytes, device, warm=None, weight_bytes=0: asked.append(
        (device, nbytes, warm, weight_bytes)))
    strategy = MemoryStrategy(offload="none", parallel=Parallelism(gpus=(1, 3), context_parallel="ulysses"))
    request, ranks = SampleRequest("a cat", "", 32, 32, 9, 1, 5.0, seed=0), Ranks(gpus=(1, 3))
    try:
        run.sample_parallel(loaded, strategy, request, ranks, hooks, pool)
        stores = getattr(loaded.pipe, run.STORES_ATTRIBUTE)
        plan = plan_explicit(loaded, VideoShape(32, 32, 9, cfg=True), strategy, ranks, None, None)
        assert [(d, n, w) for d, n, _, w in asked] == [
            (torch.device("cuda", gpu), g.peak_bytes, g.weights_bytes)
            for gpu, g in zip((1, 3), plan.gpus)]
        assert [store for _, _, store, _ in asked] == stores.stores and all(w > 0 for *_, w in asked)
        assert [s.device for s in stores.stores] == [torch.device("cuda", 1), torch.device("cuda", 3)]
        assert [s.held_bytes for s in stores.stores] == [3 * KIB, 9 * KIB]
        run.sample_parallel(loaded, strategy, request, ranks, hooks, pool)
        assert getattr(loaded.pipe, run.STORES_ATTRIBUTE) is stores  # the same pool: the same stand-ins
    finally:
        release_everywhere()
        setattr(loaded.pipe, run.STORES_ATTRIBUTE, None)  # the shared pipeline, left as found
    assert pool.kept == [0, 0] and isinstance(pool.jobs[-1], ReleaseJob)


def test_a_ranks_job_reports_what_its_stores_keep(monkeypatch):
    """ParallelSampleJob gathers every rank's kept bytes after sample() into rank 0's receipt."""
    from vidmem.memory.parallel import RankContext
    from vidmem.memory.warm import STREAMED, WarmStore
    from vidmem.pipelines.parallel import job as job_module
    from vidmem.pipelines.parallel.job import ParallelSampleJob

    store, host = WarmStore("a rank's sampler"), torch.zeros(512)

    def fake_sample(loaded, strategy, request, hooks, device):
        store.keep([(host, torch.zeros(512))], STREAMED)  # what a run on a GPU leaves kept
        return SampleResult({"samples": torch.zeros(1)}, {"stages": []})

    def all_gather_object(out, value):  # every rank reports what this one does
        out[:] = [value] * len(out)

    monkeypatch.setattr(ParallelSampleJob, "_pipeline", lambda self, context: SimpleNamespace())
    monkeypatch.setattr(job_module, "check_context_parallel", lambda *args: None)
    monkeypatch.setattr(job_module, "free_memory", lambda device: None)
    monkeypatch.setattr(job_module, "sample", fake_sample)
    fake_dist = SimpleNamespace(all_gather_object=all_gather_object, get_backend=lambda: "gloo")
    monkeypatch.setattr(job_module, "dist", fake_dist)
    strategy = MemoryStrategy(parallel=Parallelism(context_parallel="ulysses", degree=2))
    job = ParallelSampleJob(None, strategy, SampleRequest("a cat", "", 32, 32, 5, 1, 5.0, seed=1))
    result = job.run(RankContext(0, 2, torch.device("cpu")))
    assert result.receipt["parallel"]["per_rank_kept_bytes"] == [kept_everywhere()] * 2 and store.held_bytes == 512 * 4


def test_comfyui_counts_a_ranks_memory_and_takes_it_back(monkeypatch):
    """Registered through the host like any store (tests/comfy_fake.py, ComfyUI 0.8.0's manager):
    its free figure counts what the rank keeps; unload_all_models sends the rank a ReleaseJob."""
    from comfy_fake import FakeComfy
    from vidmem.nodes import host

    comfy = FakeComfy.install(monkeypatch)
    monkeypatch.setattr(host, "model_management", comfy.mm)
    pool = ScriptedPool([64 * KIB, 0])
    stores = RankStores(pool, [comfy.device, torch.device("cpu")])
    with stores.running():
        host.make_room(128 * KIB, comfy.device, warm=stores.stores[0], weight_bytes=64 * KIB)
        stores.update(pool.kept)
    assert comfy.entries() == ["VidmemWeights"] and comfy.free_bytes() == comfy.total_bytes - 64 * KIB
    comfy.mm.unload_all_models()
    assert stores.stores[0].held_bytes == 0 and pool.jobs == [ReleaseJob((64 * KIB + 1, 0))]
    assert comfy.free_bytes() == comfy.total_bytes and not comfy.entries()


def test_ranks_that_fail_while_giving_back_hold_nothing_and_nothing_raises_into_the_host():
    from vidmem.memory.parallel import RankError

    class FailingPool(ScriptedPool):
        def run(self, job, *args):
            self.alive = False  # a pool closes itself when a rank fails
            raise RankError(1, "the process died with exit code 9")

    pool = FailingPool([5 * KIB, 7 * KIB])
    stores = RankStores(pool, [torch.device("cpu")] * 2)
    stores.update(pool.kept)
    assert stores.stores[1].release_all() == 7 * KIB  # the rank's memory went with it
    assert [s.held_bytes for s in stores.stores] == [0, 0]
