"""What a rank does around `sample()`: its cached device memory is returned at the end of every
job (the per-GPU plan gives rank 0's GPU to the coordinator's decode afterwards)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from vidmem.memory import MemoryStrategy
from vidmem.memory.parallel import RankContext
from vidmem.memory.strategy import Parallelism
from vidmem.pipelines.parallel import job as job_module
from vidmem.pipelines.parallel.job import ParallelSampleJob
from vidmem.pipelines.sample import SampleRequest, SampleResult


@pytest.fixture
def rank_job(monkeypatch):
    """A job whose pipeline, sampling and collectives are stand-ins; returns the calls made."""
    calls = []
    monkeypatch.setattr(ParallelSampleJob, "_pipeline", lambda self, context: SimpleNamespace())
    monkeypatch.setattr(job_module, "check_context_parallel", lambda *args: None)
    monkeypatch.setattr(job_module, "dist", SimpleNamespace(all_gather_object=lambda out, value: None,
                                                            get_backend=lambda: "gloo"))
    monkeypatch.setattr(job_module, "free_memory", lambda device: calls.append(("free", device)))

    def fake_sample(loaded, strategy, request, hooks, device):
        calls.append(("sample", device))
        if request.seed == 13:
            raise RuntimeError("broken step")
        return SimpleNamespace(receipt={"stages": []})

    monkeypatch.setattr(job_module, "sample", fake_sample)
    strategy = MemoryStrategy(parallel=Parallelism(context_parallel="ulysses", degree=2))
    return calls, lambda seed: ParallelSampleJob(None, strategy, SampleRequest("a cat", "", 32, 32, 5, 1, 5.0, seed=seed))


@pytest.mark.parametrize("rank", [0, 1])
def test_every_rank_frees_its_cached_memory_after_the_job(rank_job, rank):
    calls, job = rank_job
    device = torch.device("cpu")
    job(1).run(RankContext(rank, 2, device))
    assert calls == [("sample", device), ("free", device)]


def test_a_failed_job_frees_too(rank_job):
    calls, job = rank_job
    with pytest.raises(RuntimeError, match="broken step"):
        job(13).run(RankContext(0, 2, torch.device("cpu")))
    assert calls[-1] == ("free", torch.device("cpu"))


def rank_zero_result() -> SampleResult:
    """What a pool's run returns: rank 0's result."""
    return SampleResult({"samples": torch.zeros(1, 16, 2, 4, 4)})


def test_ranks_share_the_automatic_pinned_ceiling(tiny_loaded, monkeypatch):
    """Each rank gets cap / ranks of one ceiling computed by the coordinator (within the host's
    pinned room), not the whole automatic ceiling each; a ceiling the user set is kept."""
    from vidmem.memory.units import GiB
    from vidmem.pipelines.hooks import RunHooks
    from vidmem.pipelines.parallel import Ranks, run

    sent, rooms, receipts = [], [], []

    def rank_zero(job):  # rank 0's receipt names the strategy it ran
        result = rank_zero_result()
        result.receipt.update(strategy=job.strategy.describe(), parallel={"ranks": 2})
        return result

    pool = SimpleNamespace(config=SimpleNamespace(world_size=2), alive=False,
                           run=lambda job, *args: sent.append(job) or rank_zero(job))
    monkeypatch.setattr(run, "pinned_cap_bytes", lambda gb, room: rooms.append(room) or 10 * GiB)
    hooks = RunHooks(pinned_room=lambda: 6 * GiB)
    request = SampleRequest("a cat", "", 32, 32, 9, 1, 1.0, seed=0)
    for pinned in (None, 3.0):
        strategy = MemoryStrategy(offload="block_swap", blocks_to_swap=1, max_pinned_ram_gb=pinned,
                                  parallel=Parallelism(context_parallel="ulysses", degree=2))
        receipts.append(run.sample_parallel(tiny_loaded("wan2.1-t2v"), strategy, request, Ranks(cpu_processes=2),
                                            hooks, pool).receipt)
    assert [job.strategy.max_pinned_ram_gb for job in sent] == [5.0, 3.0]
    # the receipt shows what the user set, and the automatic share apart
    assert "max_pinned_ram_gb" not in receipts[0]["strategy"] and receipts[0]["parallel"]["pinned_ceiling_per_rank_gb"] == 5.0
    assert "max_pinned_ram_gb=3" in receipts[1]["strategy"] and "pinned_ceiling_per_rank_gb" not in receipts[1]["parallel"]
    assert rooms == [6 * GiB], "the host's pinned room bounds the shared ceiling"


def test_the_coordinator_makes_room_on_every_rank_s_gpu_before_the_run(tiny_loaded, monkeypatch):
    """Inside ComfyUI its own models may fill the ranks' GPUs: the host is asked for each GPU's
    planned peak (per rank) before the ranks load."""
    from vidmem.pipelines.hooks import RunHooks
    from vidmem.pipelines.parallel import Ranks, ranks as ranks_module, run
    from vidmem.pipelines.parallel.planning import plan_explicit
    from vidmem.memory.plan.stages import VideoShape

    monkeypatch.setattr(ranks_module.dist, "is_nccl_available", lambda: True)
    asked, order = [], []
    pool = SimpleNamespace(config=SimpleNamespace(world_size=2), alive=False,
                           run=lambda job, *args: order.append("run") or rank_zero_result())
    hooks = RunHooks(make_room=lambda nbytes, device, **registration: asked.append((device, nbytes)) or order.append("room"))
    strategy = MemoryStrategy(offload="none", parallel=Parallelism(gpus=(1, 3), context_parallel="ulysses"))
    request = SampleRequest("a cat", "", 32, 32, 9, 1, 5.0, seed=0)
    ranks = Ranks(gpus=(1, 3))
    run.sample_parallel(tiny_loaded("wan2.1-t2v"), strategy, request, ranks, hooks, pool)
    plan = plan_explicit(tiny_loaded("wan2.1-t2v"), VideoShape(32, 32, 9, cfg=True), strategy, ranks, None, None)
    assert asked == [(torch.device("cuda", 1), plan.gpus[0].peak_bytes), (torch.device("cuda", 3), plan.gpus[1].peak_bytes)]
    assert all(nbytes > 0 for _, nbytes in asked) and order == ["room", "room", "run"]


@pytest.mark.parametrize("offload", ["none", "block_swap"])
def test_copies_of_the_pipeline_beyond_ram_and_swap_are_refused_before_a_rank_starts(tiny_loaded, monkeypatch,
                                                                                    offload):
    """Every rank loads its own copy beside the coordinator's, whatever tier the user set by hand: a
    machine whose RAM and swap cannot hold them all is told so before a rank starts (a rank the
    out-of-memory killer ends would only show its exit code)."""
    import psutil

    from vidmem.memory.plan.parallel_checks import ParallelError
    from vidmem.pipelines.parallel import Ranks, run
    from vidmem.pipelines.parallel.planning import run_plan

    started = []
    pool = SimpleNamespace(config=SimpleNamespace(world_size=2), alive=False,
                           run=lambda job, *args: started.append(job) or rank_zero_result())
    strategy = MemoryStrategy(offload=offload, blocks_to_swap=1 if offload == "block_swap" else 0,
                              parallel=Parallelism(context_parallel="ulysses", degree=2))
    request = SampleRequest("a cat", "", 32, 32, 9, 1, 5.0, seed=0)
    loaded, ranks = tiny_loaded("wan2.1-t2v"), Ranks(cpu_processes=2)
    needed = run_plan(loaded, strategy, request, ranks).host_bytes
    monkeypatch.setattr(psutil, "swap_memory", lambda: SimpleNamespace(total=needed // 4))
    monkeypatch.setattr(psutil, "virtual_memory", lambda: SimpleNamespace(total=needed // 2, available=needed // 2))
    with pytest.raises(ParallelError, match=r"2 ranks .* needs .* of RAM: each rank and this process hold their own "
                                            r"copy .*Use fewer GPUs"):
        run.sample_parallel(loaded, strategy, request, ranks, pool=pool)
    assert started == []
    monkeypatch.setattr(psutil, "swap_memory", lambda: SimpleNamespace(total=needed // 2 + 1))  # RAM + swap suffice
    run.sample_parallel(loaded, strategy, request, ranks, pool=pool)
    assert len(started) == 1
