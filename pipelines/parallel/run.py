"""The coordinator's side of a context-parallel Sampler run.

Everything that can be refused is refused here, before a rank starts: the family (anything but
Wan), an activation chunk count, an attention kernel with no context-parallel version, ring on the CPU, heads or
tokens that do not divide by the degree, a pipeline the ranks could not reopen, copies of the pipeline (one per
rank and this process's) beyond the machine's RAM and swap. The pool of ranks hangs off the pipeline it
serves (`pipe.vidmem_worker_pool`), so it is reused run over run and goes away with the pipeline: its finalizer
stops the ranks. Beside it hang the stand-ins of the ranks' warm stores (`pipe.vidmem_rank_stores`, memory/parallel/kept.py):
each run registers one per rank GPU with the host and records what the ranks keep afterwards.
"""

from __future__ import annotations

import weakref
from dataclasses import replace

import torch

from ...memory.hostpool import pinned_cap_bytes
from ...memory.parallel import RankStores, WorkerPool
from ...memory.strategy import MemoryStrategy
from ...memory.units import GiB
from ..family import ModelError, denoisers
from ..loader import torch_dtype
from ..hooks import RunHooks
from ..sample import SampleRequest, SampleResult
from ..sample_checks import masked_by, refuse_cache_in_parallel, refuse_windows_in_parallel, validate_request
from ..speed import resolve_speed
from .checks import check_context_parallel, check_parallel_attention, rank_strategy
from .job import ParallelSampleJob
from .planning import check_parallel_ram, rank_rooms, run_plan
from .ranks import Ranks
from .source import PipelineSource

POOL_ATTRIBUTE = "vidmem_worker_pool"
STORES_ATTRIBUTE = "vidmem_rank_stores"  # the stand-ins of the ranks' warm stores (memory/parallel/kept.py)
# The diffusers pipelines holding a pool, so Free VRAM can stop every one of them without being
# wired to the pipeline (templates feed it the decoded frames). Weak: a dropped pipeline's pool
# is closed by its own finalizer.
_POOLED: "weakref.WeakSet" = weakref.WeakSet()


def sample_parallel(loaded, strategy: MemoryStrategy, request: SampleRequest, ranks: Ranks,
                    hooks: RunHooks = RunHooks(), pool: WorkerPool | None = None) -> SampleResult:
    """Sample across `ranks` with the strategy's context parallelism; rank 0's latent and receipt.

    `pool`: run on these ranks instead of the pipeline's own (tests share one pool between
    pipelines: a rank holds one pipeline at a time and reopens when the source changes).
    """
    validate_request(loaded, request)
    refuse_windows_in_parallel(request)
    strategy = rank_strategy(strategy)
    refuse_cache_in_parallel(request.cache)
    run_loaded = loaded.image_mode() if request.image is not None else loaded
    device_type = "cuda" if ranks.gpus else "cpu"
    if device_type == "cpu" or torch.cuda.is_available():  # refused here, before any rank starts (ranks check again)
        resolved = resolve_speed(request.speed, torch.device(device_type), torch_dtype(loaded.dtype_name),
                                 denoisers(loaded.pipe, loaded.spec), context_parallel=True,
                                 masked_by=masked_by(loaded))
        check_parallel_attention(resolved, denoisers(loaded.pipe, loaded.spec), strategy.parallel.context_parallel.value)
    check_context_parallel(run_loaded, request.width, request.height, request.frames, strategy.parallel,
                           ranks.degree, device_type)
    plan = run_plan(loaded, strategy, request, ranks)
    check_parallel_ram(plan)
    shared = rank_pinned_share(strategy, ranks.degree, hooks.pinned_room())
    job = ParallelSampleJob(PipelineSource.of(loaded), shared, request)
    pool = pool if pool is not None else pool_for(loaded, ranks)
    if pool.config.world_size != ranks.degree:
        raise ModelError(f"the pool has {pool.config.world_size} ranks but the run asks for {ranks.degree}.")
    kept = rank_stores_for(loaded, pool, ranks)
    with kept.running():  # the host's requests for the ranks' memory wait for the run's end
        if ranks.gpus:  # inside ComfyUI its own models may hold the ranks' GPUs (GPU 0 above all)
            for room, store in zip(rank_rooms(loaded, plan, ranks), kept.stores):
                hooks.make_room(room.total_bytes, room.device, warm=store, weight_bytes=room.weight_bytes)
        result = pool.run(job, hooks.on_step, hooks.check_interrupt)
        kept.update(result.receipt.get("parallel", {}).get("per_rank_kept_bytes"))
    if shared is not strategy:  # the receipt shows the user's strategy, and the automatic ceiling's share beside it
        result.receipt["strategy"] = strategy.describe()
        result.receipt.setdefault("parallel", {})["pinned_ceiling_per_rank_gb"] = round(shared.max_pinned_ram_gb, 2)
    # Rank 0's tensors arrive in shared memory (a file descriptor per tensor) and ComfyUI's output
    # cache would keep those segments: the run returns ordinary copies of all of them (the video,
    # LTX-2's audio latents, any metadata tensor).
    result.latent = owned_copy(result.latent)
    return result


def owned_copy(value):
    """`value` with every tensor in it (through dicts, lists and tuples) cloned out of shared memory."""
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, dict):
        return {key: owned_copy(item) for key, item in value.items()}
    if type(value) in (list, tuple):
        return type(value)(owned_copy(item) for item in value)
    return value


def rank_pinned_share(strategy: MemoryStrategy, ranks: int, host_room_bytes: int | None) -> MemoryStrategy:
    """Each rank's share of the automatic pinned ceiling, computed once here.

    Left to itself every rank would size its pinned pool from the same free RAM at the same
    moment (N x half of it, breaking PINNED_HEADROOM_BYTES); the ranks on this machine share one
    ceiling instead, within the host's pinned budget. A ceiling the user set is kept, per rank.
    """
    if strategy.max_pinned_ram_gb is not None:
        return strategy
    return replace(strategy, max_pinned_ram_gb=pinned_cap_bytes(None, host_room_bytes) / ranks / GiB)


def rank_stores_for(loaded, pool: WorkerPool, ranks: Ranks) -> RankStores:
    """The stand-ins of `pool`'s ranks' warm stores (memory/parallel/kept.py), kept on the pipeline
    with its pool: ComfyUI counts what the ranks keep and Free VRAM reaches it. New with a new pool
    or other GPUs."""
    devices = [torch.device("cuda", gpu) for gpu in ranks.gpus] or [torch.device("cpu")] * ranks.degree
    held = getattr(loaded.pipe, STORES_ATTRIBUTE, None)
    if held is not None and held.pool is pool and [store.device for store in held.stores] == devices:
        return held
    stores = RankStores(pool, devices, label=f"{type(loaded.pipe).__name__} context-parallel rank")
    setattr(loaded.pipe, STORES_ATTRIBUTE, stores)
    return stores


def pool_for(loaded, ranks: Ranks) -> WorkerPool:
    """The pipeline's pool for these ranks, started on first use (a different set of ranks replaces it)."""
    held = getattr(loaded.pipe, POOL_ATTRIBUTE, None)
    if held is not None and held[0] == ranks:
        return held[1]
    close_pool(loaded)
    pool = WorkerPool(ranks.pool_config())
    setattr(loaded.pipe, POOL_ATTRIBUTE, (ranks, pool))
    _POOLED.add(loaded.pipe)
    return pool


def close_pool(loaded) -> None:
    """Stop the pipeline's ranks (on unload, or when the Free node asks); the next run starts new ones."""
    held = getattr(loaded.pipe, POOL_ATTRIBUTE, None)
    if held is not None:
        held[1].close()
        setattr(loaded.pipe, POOL_ATTRIBUTE, None)
    _POOLED.discard(loaded.pipe)


def close_all_pools() -> int:
    """Stop the ranks of every pipeline in this process (Free VRAM); returns how many pools were stopped."""
    stopped = 0
    for pipe in list(_POOLED):
        held = getattr(pipe, POOL_ATTRIBUTE, None)
        if held is not None:
            held[1].close()
            setattr(pipe, POOL_ATTRIBUTE, None)
            stopped += 1
    _POOLED.clear()
    return stopped
